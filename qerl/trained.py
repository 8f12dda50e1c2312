"""A trained run, rebuilt or written out for serving: its base in the format it was trained on, the
adapters and trained norms (``qerl.load_trained``, ``qerl.export_trained``, ``python -m qerl generate`` /
``export``). Above both the trainer (which builds the policy) and qerl.export (which writes the files)."""

from __future__ import annotations

from pathlib import Path

import torch

from qerl import formats
from qerl.export import (
    _is_lora_key,
    adapter_info,
    dense_model,
    export_compressed_tensors,
    export_peft_adapter,
)
from qerl.paths import check_new_or_empty


def load_trained(path, device=None, dtype: str | None = None):
    """(model, tokenizer) of a trained run: the base in the format it was trained on (quantized as in
    training), its adapters and trained norms loaded.

    ``path``: a qerl checkpoint folder (checkpoints/step-N), or an adapter folder qerl exported
    (checkpoints/step-N/adapter). A PEFT adapter from elsewhere records no base format: load that
    with peft on its base model.
    """
    from qerl.checkpoint import load_trainable, read_checkpoint_config
    from qerl.config import TrainConfig, parse_method
    from qerl.policy import build_policy

    ck = {**read_checkpoint_config(path), **adapter_info(path)}
    method = ck.get("method")
    if not method:
        raise ValueError(f"{path}: no qerl method recorded (a PEFT adapter qerl did not write); load it with "
                         f"peft on its base model, or use `python -m qerl eval --adapter {path} --method ...`")
    if not ck.get("model"):
        raise ValueError(f"{path}: the base model is not recorded")
    policy = {k: ck[k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "train_norms") if k in ck}
    cfg = TrainConfig(model=ck["model"], **parse_method(method), **policy, **({"dtype": dtype} if dtype else {}))
    import torch as _torch

    model, tok, _, _ = build_policy(cfg, device=_torch.device(device) if device else None, lora=cfg.lora)
    load_trainable(path, model)
    model.eval()
    model.qerl_method = method
    return model, tok



def export_trained(path, out_dir, merge: bool = False, device=None) -> dict:
    """Write a trained run for serving, with trained norms folded into the base (no modules_to_save).

    merge=True: one plain transformers model (bf16): the dequantized 4-bit base (or the bf16 base)
    with the LoRA update merged. Opens with AutoModelForCausalLM.from_pretrained(out_dir).
    merge=False (4-bit methods): a compressed-tensors checkpoint of the 4-bit base (what vLLM
    loads) plus out_dir/adapter, a PEFT LoRA adapter whose base_model_name_or_path is out_dir:
    ``vllm serve out_dir --enable-lora --lora-modules mine=out_dir/adapter``.
    """
    out_dir = Path(out_dir)
    check_new_or_empty(out_dir)
    model, tok = load_trained(path, device=device)
    method = model.qerl_method
    fmt = method.split("_", 1)[0]
    if merge or formats.is_dense(fmt):
        if not merge:
            raise ValueError(f"{path} is a {method} run (a bf16 base): pass --merge to write one merged model")
        dense_model(model, merge_lora=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.config.use_cache = True
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        return {"out_dir": str(out_dir), "merged": True, "method": method}
    from qerl.noise import find_norms

    norms = {f"{n}.weight" for n, _ in find_norms(model)}
    state = {k: v for k, v in model.state_dict().items() if not _is_lora_key(k)}
    state = {k: v.to(torch.bfloat16) if k in norms else v for k, v in state.items()}  # trained norms, folded
    summary = export_compressed_tensors(state, out_dir, fmt=fmt, config=model.config, tokenizer=tok)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)
    info = export_peft_adapter(model, out_dir / "adapter", str(out_dir.resolve()), norms=False,
                               metadata={"qerl_base_format": fmt, "qerl_method": method,
                                         "qerl_base_model": str(out_dir.resolve())})
    return {**summary, "merged": False, "method": method, "adapter": info["out_dir"]}
