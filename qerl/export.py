"""Export: 4-bit checkpoints in compressed-tensors format, PEFT adapters, trained models for serving,
and the streaming quantizer.

    export_compressed_tensors(model, "out/", tokenizer=tok)          # a quantize_()d model -> vLLM
    export_peft_adapter(model, "adapter/", "Qwen/Qwen2.5-7B-Instruct")  # LoRA -> PeftModel
    quantize_checkpoint("/data/Qwen2.5-7B-Instruct", "out/", formats.QERL_FORMAT)  # `python -m qerl quantize`
    model, tok = load_trained("runs/x/checkpoints/step-60")         # quantized base + adapter, as trained
    export_trained("runs/x/checkpoints/step-60", "served/", merge=True)  # `python -m qerl export`

A trained adapter belongs to the base it was trained on: the 4-bit base of an nvfp4_lora run is
not the bf16 model (logits differ by several nats), so every adapter qerl writes records, in the
metadata of adapter_model.safetensors (``qerl_base_format``, ``qerl_method``, ``qerl_base_model``),
which base it needs; adapter_config.json's base_model_name_or_path is the real model id or folder.

On disk, per quantized Linear `<p>` (the module names of the source checkpoint):
    nvfp4: <p>.weight_packed uint8 [out, in/2], <p>.weight_scale float8_e4m3fn [out, in/16],
           <p>.weight_global_scale float32 [1] (a divisor); config "nvfp4-pack-quantized"
    mxfp4: <p>.weight_packed uint8 [out, in/2], <p>.weight_scale uint8 (E8M0) [out, in/32];
           config "mxfp4-pack-quantized"
    nf4:   <p>.weight_packed uint8 [out, in/2], <p>.weight_absmax float32 [out*in/64]; a
           qerl-specific config (quant_method "qerl") that vLLM and transformers do NOT read.
Everything else (embeddings, norms, lm_head, biases) is bf16. Fused projections (q,k,v) and
(gate,up) share one NVFP4 global scale, because vLLM fuses them into one GEMM and reads a single
scale (docs/formats.md).

quantize_checkpoint streams: it reads the source safetensors tensor by tensor (safe_open is
memory-mapped) and quantizes one decoder layer at a time, so peak memory is about one layer plus
one output shard, not the model.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from qerl import formats, hub
from qerl.arch import FUSED_GROUPS, LINEAR_NAMES, PROJECTIONS, check_supported
from qerl.models import TOKENIZER_FILES, read_config_file, resolve_model_path
from qerl.paths import check_new_or_empty

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3  # small shards keep the streaming writer's memory low

_LAYER_LINEAR = re.compile(
    r"^(?P<layer>.*\blayers\.(?P<idx>\d+))\.(?:" + "|".join(PROJECTIONS) + r")\.(?P<proj>"
    + "|".join(LINEAR_NAMES) + r")\.weight$")
_LAYER = re.compile(r"^(?P<layer>.*\blayers\.(?P<idx>\d+))\.")


# ----------------------------------------------------------------------------------------------
# config.json


def quantization_config(fmt: str, ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict:
    """The `quantization_config` entry of config.json for `fmt` (its spec's export_config)."""
    return formats.get(fmt).export_config(list(LINEAR_NAMES), list(ignore))


def _detect_format(state: dict) -> str:
    """The registered format whose packed tensor names are exactly those of the state's modules."""
    prefixes = {k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed")}
    if not prefixes:
        raise ValueError("no packed weights in the state dict; pass fmt= or quantize first")
    prefix = min(prefixes)
    present = {k[len(prefix) + 1:] for k in state if k.startswith(prefix + ".weight_")}
    found = [f for f in formats.names() if set(formats.get(f).tensor_names) == present]
    if len(found) != 1:
        raise ValueError(f"cannot tell the format of {prefix} from its tensors {sorted(present)} "
                         f"(matches {found}); pass fmt=")
    return found[0]


def _write_config(config: dict, out_dir: Path, fmt: str, ignore) -> None:
    config = dict(config)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    # bf16 for the unquantized tensors; "torch_dtype" too for readers older than transformers 5.
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(fmt, ignore)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# Writing safetensors shards


class _ShardWriter:
    """Collects tensors and writes HF-style shards (+ index) once a shard reaches max_bytes."""

    def __init__(self, out_dir: Path, max_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give shards their final names, write the index if sharded."""
        if self.pending or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self.parts, names):
            tmp.rename(self.out_dir / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names


def _prepare_out_dir(out_dir, src: Path | None = None) -> Path:
    out_dir = Path(out_dir)
    if src is not None and out_dir.resolve() == src.resolve():
        raise ValueError(f"--out must differ from the source folder ({src})")
    if out_dir.is_dir() and any(out_dir.glob("*.safetensors")):
        raise FileExistsError(f"{out_dir} already holds *.safetensors files: choose an empty "
                              f"or new folder (qerl never overwrites a checkpoint)")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _quantize_group(weights: dict[str, torch.Tensor], fmt: str, fused: bool = True):
    """Quantize the Linear weights of one decoder layer {module name: [out, in]}.

    Returns {module name: {tensor name: tensor}}. For a format with a fused global scale (nvfp4)
    the members of each fused group present here share the scale of their largest |w| (FORMATS.md).
    """
    shared = {}
    fuse = formats.get(fmt).fused_global_scale if fused else None
    if fuse is not None:
        for _, group in FUSED_GROUPS:
            members = [n for n in weights if n.rsplit(".", 1)[-1] in group]
            if members:
                gs = fuse([weights[n] for n in members])
                shared.update({n: gs for n in members})
    return {n: formats.quantize(w, fmt, global_scale=shared.get(n)) for n, w in weights.items()}


# ----------------------------------------------------------------------------------------------
# (a) compressed-tensors checkpoint of an in-memory quantized model


def _is_lora_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def export_compressed_tensors(model_or_state, out_dir, fmt: str | None = None, config=None,
                              tokenizer=None, merge_lora: bool = False,
                              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write a quantize_()d model (or its state dict) as a compressed-tensors checkpoint.

    The QuantLinear buffers already carry the on-disk names, so this is a state-dict filter:
    packed tensors keep their dtypes, every other floating tensor becomes bf16, a tied lm_head is
    written once (as the embedding), config.json gains `quantization_config`, and the tokenizer
    (if given) is saved beside it.

    LoRA: vLLM's checkpoint has no place for adapters. With merge_lora=False a model whose
    lora_B is non-zero is refused (export the adapter with export_peft_adapter instead); with
    merge_lora=True each base is dequantized, W + scaling * B @ A is formed and requantized
    (fused groups again share one global scale), which adds a second rounding.
    Returns {"out_dir", "format", "num_quantized", "bytes"}.
    """
    from qerl.qlinear import QuantLinear

    is_module = isinstance(model_or_state, torch.nn.Module)
    quant_modules = {}
    if is_module:
        model = model_or_state
        config = config if config is not None else getattr(model, "config", None)
        quant_modules = {n: m for n, m in model.named_modules()
                         if isinstance(m, QuantLinear) and not formats.is_dense(m.fmt)}
        fmts = {m.fmt for m in quant_modules.values()}
        if not fmts:
            raise ValueError("the model has no 4-bit QuantLinear modules: quantize it with "
                             "qerl.quantize.quantize_ first (or use save_pretrained for bf16)")
        if len(fmts) > 1 or (fmt is not None and fmt not in fmts):
            raise ValueError(f"model holds formats {sorted(fmts)}, asked for {fmt!r}: one "
                             f"checkpoint holds one format")
        fmt = fmts.pop()
        state = model.state_dict()
    else:
        state = dict(model_or_state)
        if fmt is None:
            fmt = _detect_format(state)
        prefixes = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}
        quant_modules = {p: None for p in prefixes}
    spec = formats.get(fmt)
    if config is None:
        raise ValueError("config= is needed to write config.json when exporting a state dict")
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    lora_keys = [k for k in state if _is_lora_key(k)]
    live = [k for k in lora_keys if ".lora_B." in k and bool(state[k].abs().max() > 0)]
    if live and not merge_lora:
        raise ValueError(
            f"{len(live)} LoRA adapters are non-zero (e.g. {live[0]}): a compressed-tensors "
            f"checkpoint holds only the base. Save them with export_peft_adapter, or pass "
            f"merge_lora=True to fold them into the 4-bit weights (requantizes)")
    if live and not is_module:
        raise ValueError("merge_lora=True needs the model, not a state dict")
    for k in lora_keys:
        del state[k]
    if live:
        state.update(_merged_packed_state(quant_modules, fmt))

    if cfg.get("tie_word_embeddings") and "lm_head.weight" in state:
        del state["lm_head.weight"]  # tied: transformers and vLLM rebuild it from the embedding

    out_dir = _prepare_out_dir(out_dir)
    packed_suffixes = tuple("." + n for n in spec.tensor_names)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    for name in sorted(state):
        t = state[name]
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: there is nothing to export")
        if not name.endswith(packed_suffixes) and t.is_floating_point():
            t = t.to(torch.bfloat16)
        writer.add(name, t)
    writer.finish()
    ignore = ["lm_head"] + sorted(
        n for n, m in (model.named_modules() if is_module else [])
        if isinstance(m, (torch.nn.Linear, QuantLinear)) and n not in quant_modules
        and n != "lm_head" and ".lora_" not in n and not n.endswith(("lora_A", "lora_B")))
    _write_config(cfg, out_dir, fmt, ignore)
    gen = getattr(model_or_state, "generation_config", None) if is_module else None
    if gen is not None:
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return {"out_dir": str(out_dir), "format": fmt, "num_quantized": len(quant_modules),
            "bytes": writer.total_bytes}


@torch.no_grad()
def _merged_packed_state(quant_modules: dict, fmt: str) -> dict[str, torch.Tensor]:
    """Packed tensors of W + scaling * B @ A for every QuantLinear, fused groups sharing scales."""
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in quant_modules.items():
        w = m.dequantized_weight(torch.float32)
        if m.r:
            w = w + m.scaling * (m.lora_B.weight.float() @ m.lora_A.weight.float())
        layer = name.rsplit(".", 2)[0]  # model.layers.3.self_attn.q_proj -> model.layers.3
        by_layer.setdefault(layer, {})[name] = w
    out = {}
    for weights in by_layer.values():
        for name, tensors in _quantize_group(weights, fmt).items():
            out.update({f"{name}.{k}": v for k, v in tensors.items()})
    return out


# ----------------------------------------------------------------------------------------------
# (b) PEFT adapter


def export_peft_adapter(model, out_dir, base_model_name_or_path: str, tokenizer=None, metadata: dict | None = None,
                        norms: bool = True) -> dict:
    """Write the LoRA adapters of a quantize_()d model as a PEFT LoRA adapter.

    Produces adapter_model.safetensors (keys `base_model.model.<module>.lora_{A,B}.weight`, as
    peft's get_peft_model_state_dict names them) and adapter_config.json, so that
    `peft.PeftModel.from_pretrained(dense_model, out_dir)` reproduces our outputs on the dense
    (or dequantized) base. Ranks or alphas that differ between modules go to rank_pattern /
    alpha_pattern. Trained AQN norm weights (``train_norms``: input/post_attention_layernorm weights
    with requires_grad) are saved as PEFT's modules_to_save, as the official code's ``--ln`` does:
    keys ``base_model.model.<norm>.weight`` (fp32, as trained); ``norms=False`` leaves them out (they
    were folded into an exported base). ``metadata`` (str values) goes into the safetensors header.
    Returns {"out_dir", "num_modules", "target_modules", "modules_to_save"}.
    """
    from peft import LoraConfig

    from qerl.noise import find_norms
    from qerl.qlinear import QuantLinear

    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.r > 0}
    if not mods:
        raise ValueError("the model has no LoRA adapters (QuantLinear with lora_rank > 0)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in mods.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight.detach().cpu().contiguous()
    norms = [(n, m) for n, m in find_norms(model) if m.weight.requires_grad] if norms else []
    for name, m in norms:
        tensors[f"base_model.model.{name}.weight"] = m.weight.detach().cpu().contiguous()
    modules_to_save = sorted({n.rsplit(".", 1)[-1] for n, _ in norms}) or None
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata=meta)

    # Short names (q_proj, ...) when every such module in the model has an adapter, which is
    # what PEFT users and vLLM expect; otherwise the full names, so PEFT adds nothing extra.
    short = sorted({n.rsplit(".", 1)[-1] for n in mods})
    covered = all(n in mods for n, m in model.named_modules()
                  if n.rsplit(".", 1)[-1] in short and isinstance(m, (QuantLinear, torch.nn.Linear))
                  and ".lora_" not in n and not n.endswith(("lora_A", "lora_B")))
    targets = short if covered else sorted(mods)
    first = next(iter(mods.values()))
    r, alpha = first.r, first.lora_alpha
    rank_pattern = {n: m.r for n, m in mods.items() if m.r != r}
    alpha_pattern = {n: m.lora_alpha for n, m in mods.items() if m.lora_alpha != alpha}
    dropout = next((mm.p for m in mods.values() for mm in [m.lora_dropout]
                    if isinstance(mm, torch.nn.Dropout)), 0.0)
    LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
               bias="none", task_type="CAUSAL_LM", rank_pattern=rank_pattern,
               alpha_pattern=alpha_pattern, base_model_name_or_path=str(base_model_name_or_path),
               modules_to_save=modules_to_save, inference_mode=True).save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return {"out_dir": str(out_dir), "num_modules": len(mods), "target_modules": targets,
            "modules_to_save": modules_to_save}


# ----------------------------------------------------------------------------------------------
# Streaming quantization of an HF folder (the `quantize` CLI)


def _source_folder(name_or_path, cache_dir=None) -> Path:
    """A local HF folder for a folder, a .gguf, the default model, or a hub id (downloaded)."""
    path = resolve_model_path(name_or_path, cache_dir)
    if Path(path).is_dir():
        return Path(path)
    hub.online()  # no network: offline mode, so a model not in the cache fails at once
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                            "*.model", "*.jinja"]))
    except Exception as exc:  # hub errors come in many types; all mean "could not get it"
        raise FileNotFoundError(
            f"{name_or_path!r} is not a local folder or .gguf file, and downloading it from the "
            f"Hugging Face hub failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


def _safe_open(f: Path):
    """safe_open(f); a file it cannot read is a ValueError naming it (not the reader's SafetensorError)."""
    try:
        return safe_open(str(f), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors' errors of a truncated or corrupt file
        raise ValueError(f"cannot read {f} ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}): "
                         "the file is truncated or corrupt") from exc


def _tensor_index(src: Path) -> dict[str, Path]:
    """Map every tensor name of a safetensors checkpoint to the shard file holding it."""
    index_file = src / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {k: src / v for k, v in weight_map.items()}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in src.iterdir())[:12]
        raise FileNotFoundError(
            f"no *.safetensors in {src} (found {found}); only safetensors checkpoints are "
            f"supported: re-save with model.save_pretrained(dir) (safe_serialization is the "
            f"default)")
    out = {}
    for f in files:
        with _safe_open(f) as h:
            out.update({k: f for k in h.keys()})
    return out


def quantize_checkpoint(src, out_dir, fmt: str, progress: bool = True, cache_dir=None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Quantize the decoder linears of an HF Llama/Qwen2/Qwen3 checkpoint, streaming.

    `src`: a local HF folder, a .gguf file, DEFAULT_MODEL, or a hub id. `out_dir` receives
    config.json (with quantization_config), the tokenizer files, generation_config.json and
    *.safetensors with the source's module names. Shapes are checked before anything is written.
    Returns {"out_dir", "format", "num_quantized", "num_copied", "bytes", "source_bytes",
    "seconds"}.
    """
    spec = formats.get(fmt)
    t0 = time.perf_counter()
    if Path(out_dir).resolve() != Path(src).expanduser().resolve():  # the same folder: the clearer error below
        check_new_or_empty(out_dir)
    src = _source_folder(src, cache_dir)
    cfg = read_config_file(src / "config.json")
    check_supported(cfg.get("model_type"), "qerl quantizes", f" (architectures={cfg.get('architectures')})")
    where = _tensor_index(src)

    # Plan: which tensors are quantized (per layer), which are copied; check every shape first.
    layers: dict[int, dict[str, str]] = {}
    layer_other: dict[int, list[str]] = {}
    other: list[str] = []
    for name in where:
        m = _LAYER_LINEAR.match(name)
        if m:
            layers.setdefault(int(m["idx"]), {})[name[: -len(".weight")]] = name
            continue
        m = _LAYER.match(name)
        (layer_other.setdefault(int(m["idx"]), []) if m else other).append(name)
    if not layers:
        raise ValueError(f"no decoder linears ({', '.join(LINEAR_NAMES)}) found in {src}")
    bad = []
    for mods in layers.values():
        for module, name in mods.items():
            with _safe_open(where[name]) as h:
                shape = tuple(h.get_slice(name).get_shape())
            try:
                formats.check_shape(shape, fmt)
            except ValueError as exc:
                bad.append(f"{module}: {exc}")
    if bad:
        raise ValueError(f"{len(bad)} linear weights cannot be stored as {fmt} "
                         f"(block size {spec.block_size}): " + "; ".join(bad[:4])
                         + (" ..." if len(bad) > 4 else ""))

    out_dir = _prepare_out_dir(out_dir, src)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = _safe_open(f)
        return handles[f].get_tensor(name)

    def copy(name: str) -> None:
        t = read(name)
        writer.add(name, t.to(torch.bfloat16) if t.is_floating_point() else t)

    tied = cfg.get("tie_word_embeddings", False)
    n_quant = n_copied = 0
    order = sorted(layers)
    bar = tqdm(total=len(order) + 1, desc=f"quantize {fmt}", unit="layer", disable=not progress)
    try:
        for name in sorted(other):  # embeddings, final norm, lm_head
            if tied and name == "lm_head.weight":
                continue  # written once, as the embedding
            copy(name)
            n_copied += 1
        bar.update(1)
        for idx in order:
            weights = {module: read(name) for module, name in layers[idx].items()}
            for module, tensors in _quantize_group(weights, fmt).items():
                for k, v in tensors.items():
                    writer.add(f"{module}.{k}", v)
                n_quant += 1
            del weights
            for name in sorted(layer_other.get(idx, [])):  # norms, q/k/v biases
                copy(name)
                n_copied += 1
            bar.update(1)
        leftover = set(layer_other) - set(layers)
        for idx in sorted(leftover):
            for name in sorted(layer_other[idx]):
                copy(name)
                n_copied += 1
        writer.finish()
    finally:
        bar.close()
        handles.clear()

    _write_config(cfg, out_dir, fmt, ["lm_head"])
    for fname in TOKENIZER_FILES + ("generation_config.json",):
        if (src / fname).is_file():
            shutil.copyfile(src / fname, out_dir / fname)
    source_bytes = sum(f.stat().st_size for f in set(where.values()))
    return {"out_dir": str(out_dir), "format": fmt, "num_quantized": n_quant,
            "num_copied": n_copied, "bytes": writer.total_bytes, "source_bytes": source_bytes,
            "seconds": round(time.perf_counter() - t0, 2)}


def load_quantized_state(out_dir) -> dict[str, torch.Tensor]:
    """All tensors of an exported checkpoint folder (all shards), for tests and inspection."""
    out = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


# ----------------------------------------------------------------------------------------------
# Trained models: the run's adapter, load_trained, and export for serving


def base_model_ref(model: str) -> str:
    """The base model as others can open it: a local folder as an absolute path, the embedded default
    and .gguf files as their converted HF folder, a hub id unchanged."""
    from qerl.models import RANDOM_PREFIX

    if str(model).startswith(RANDOM_PREFIX):
        return str(model)
    path = resolve_model_path(model)
    return str(Path(path).resolve()) if Path(path).is_dir() else path


def adapter_metadata(cfg) -> dict:
    """What an adapter of this run needs besides its weights: base format, method, base model."""
    return {"qerl_base_format": cfg.fmt, "qerl_method": cfg.method, "qerl_base_model": base_model_ref(cfg.model),
            "qerl_train_norms": str(bool(cfg.train_norms)).lower()}


def export_run_adapter(model, out_dir, cfg, tokenizer=None) -> dict:
    """The PEFT adapter of a run's model: base_model_name_or_path the real base, and adapter_metadata."""
    return export_peft_adapter(model, out_dir, base_model_ref(cfg.model), tokenizer=tokenizer,
                               metadata=adapter_metadata(cfg))


def adapter_info(path) -> dict:
    """{model, method, base_format, train_norms} that a qerl adapter folder records (empty for others)."""
    f = Path(path) / "adapter_model.safetensors"
    if not f.is_file():
        return {}
    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata() or {}
    out = {"model": meta.get("qerl_base_model"), "method": meta.get("qerl_method"),
           "base_format": meta.get("qerl_base_format")}
    return {k: v for k, v in out.items() if v}


@torch.no_grad()
def dense_model(model, merge_lora: bool = True):
    """The qerl policy as a plain transformers model, in place: every QuantLinear becomes an nn.Linear
    holding its dequantized base (plus scaling * B @ A when ``merge_lora``), norms and all in bf16."""
    from qerl.qlinear import QuantLinear

    for name, m in list(model.named_modules()):
        if not isinstance(m, QuantLinear):
            continue
        w = m.dequantized_weight(torch.float32)
        if merge_lora and m.r:
            w = w + m.scaling * (m.lora_B.weight.float() @ m.lora_A.weight.float())
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=w.device,
                              dtype=torch.bfloat16)
        lin.weight.copy_(w.to(torch.bfloat16))
        if m.bias is not None:
            lin.bias.copy_(m.bias.detach().to(torch.bfloat16))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, lin)
    for p in model.parameters():
        p.requires_grad_(False)
    model.to(torch.bfloat16)
    for attr in ("qerl_initial_norms", "qerl_quantize_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model
