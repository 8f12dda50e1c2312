"""A trained run's adapter outside qerl: PEFT loads a bf16_lora adapter on its recorded base with
qerl's logits; an nvfp4_lora adapter names its NVFP4 base, qerl.load_trained rebuilds it with the
trained logits, and `python -m qerl export --merge` gives a plain transformers model that matches.

Run: python -m pytest tests/test_trained_adapters.py -q      (~30 s on 2 cores)
"""

import json

import pytest
import torch

import qerl
from qerl.cli import main
from qerl.config import make_config
from qerl.export import adapter_info
from qerl.models import load_model


def _train_one_step(model_dir, out, method, **kw):
    cfg = make_config("smoke", model=str(model_dir), method=method, eval_datasets=(), max_steps=1, prompts_per_step=2,
                      num_generations=4, max_completion_length=6, micro_batch_size=8, lora_rank=4, lora_alpha=8,
                      learning_rate=5e-2, warmup_ratio=0.0, save_every=0, max_prompt_length=512, num_iterations=1,
                      output_dir=str(out), wandb_mode="disabled", **kw)
    model, tok = load_model(str(model_dir), dtype=torch.bfloat16)
    assert qerl.train(cfg, model=model, tokenizer=tok)["status"] == "ok"
    return model, out / "checkpoints" / "step-1"


IDS = torch.tensor([[5, 17, 33, 60, 91, 120, 7, 200]])


@torch.no_grad()
def _logits(model):
    return model(input_ids=IDS.to(next(model.parameters()).device)).logits.float().cpu()


def _close(a, b, rel):
    err = float((a - b).abs().max())
    assert err <= rel * float(a.abs().max()), f"max |diff| {err:.4g} vs max |logit| {float(a.abs().max()):.4g}"


def test_bf16_lora_adapter_loads_with_auto_peft(tiny_llama_dir, tmp_path, text_rewards):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    trained, ck = _train_one_step(tiny_llama_dir, tmp_path / "run", "bf16_lora")
    adapter = ck / "adapter"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(tiny_llama_dir.resolve())
    assert adapter_info(adapter) == {"model": str(tiny_llama_dir.resolve()), "method": "bf16_lora",
                                     "base_format": "bf16"}
    ours = _logits(trained.eval())
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.bfloat16).eval()
    theirs = _logits(peft_model)
    base = _logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16).eval())
    _close(ours, theirs, 0.02)
    assert float((ours - base).abs().max()) > 10 * 0.02 * float(ours.abs().max()) / 2, "the adapter did not move"


def test_nvfp4_adapter_names_its_base_loads_and_merges(tiny_llama_dir, tmp_path, text_rewards, capsys):
    from transformers import AutoModelForCausalLM

    trained, ck = _train_one_step(tiny_llama_dir, tmp_path / "run", "nvfp4_lora", train_norms=True)
    ours = _logits(trained.eval())
    info = adapter_info(ck / "adapter")
    assert info["base_format"] == "nvfp4" and info["method"] == "nvfp4_lora"
    assert info["model"] == str(tiny_llama_dir.resolve())

    for path in (ck, ck / "adapter"):  # the checkpoint, or the adapter qerl wrote in it
        model, _ = qerl.load_trained(path)
        assert torch.equal(_logits(model), ours), path

    assert main(["generate", "--adapter", str(ck / "adapter"), "--prompt", "w5 w6", "--max-new-tokens", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"]) == 1
    merged = tmp_path / "merged"
    assert main(["export", "--adapter", str(ck / "adapter"), "--out", str(merged), "--merge"]) == 0
    assert not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.bfloat16).eval()
    _close(ours, _logits(plain), 0.02)
    # the bf16 original is another base: the adapter does not belong to it
    bf16_base = _logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16).eval())
    assert float((bf16_base - ours).abs().max()) > float((_logits(plain) - ours).abs().max())


def test_export_without_merge_writes_4bit_base_and_adapter_without_modules_to_save(tiny_llama_dir, tmp_path,
                                                                                  text_rewards):
    _, ck = _train_one_step(tiny_llama_dir, tmp_path / "run", "nvfp4_lora", train_norms=True)
    assert json.loads((ck / "adapter" / "adapter_config.json").read_text())["modules_to_save"]
    out = tmp_path / "served"
    assert main(["export", "--adapter", str(ck), "--out", str(out)]) == 0
    conf = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert not conf.get("modules_to_save") and conf["base_model_name_or_path"] == str(out.resolve())
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    with pytest.raises(FileExistsError):
        qerl.export_trained(ck, out)
