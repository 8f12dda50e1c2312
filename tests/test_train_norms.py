"""--train-norms (the official code's --ln): the AQN norm weights train in fp32 next to the adapters, AQN
noise lands on the trained weights only while sampling, and the weights are saved with the checkpoint
and the PEFT adapter (modules_to_save) and reloaded from either.

Run: python -m pytest tests/test_train_norms.py -q      (tiny random Llama, CPU, ~20 s)
"""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qerl import train as qtrain
from qerl.checkpoint import load_trainable, read_checkpoint_config
from qerl.cli_train import add_train_args, config_from_args
from qerl.config import make_config
from qerl.noise import find_norms
from qerl.policy import build_policy
from qerl.train import train

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model = _conftest.make_tiny_model




def _norms(model):
    return [m.weight.detach().clone() for _, m in find_norms(model)]


def _cfg(tmp_path, tiny_dir, **kw):
    base = dict(output_dir=str(tmp_path / "run"), model=str(tiny_dir), method="nvfp4_lora_aqn", train_norms=True,
                eval_datasets=(), max_steps=3, num_stages=3, sigma_start=0.05, sigma_end=0.01, save_every=1,
                max_completion_length=6, prompts_per_step=2, num_generations=4, micro_batch_size=8, lora_rank=4,
                lora_alpha=8, max_prompt_length=512, wandb_mode="disabled", learning_rate=1e-2, num_iterations=1)
    return make_config("smoke", **{**base, **kw})


def test_build_policy_makes_the_norms_trainable_fp32(tiny_llama_dir):
    model, _, trainable, info = build_policy(_cfg(Path("."), tiny_llama_dir), device=torch.device("cpu"))
    norms = [m.weight for _, m in find_norms(model)]
    assert len(norms) == 4 and info["trainable_norms"] == 4  # 2 layers x (input, post_attention)
    assert all(w.requires_grad and w.dtype == torch.float32 for w in norms)
    assert all(any(w is t for t in trainable) for w in norms)
    lora = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert len(trainable) == len(lora) + 4
    model, _, trainable, info = build_policy(_cfg(Path("."), tiny_llama_dir, train_norms=False),
                                             device=torch.device("cpu"))
    assert "trainable_norms" not in info and not any(m.weight.requires_grad for _, m in find_norms(model))
    with pytest.raises(ValueError, match="bf16_full"):
        make_config("smoke", method="bf16_full", train_norms=True)


def test_noise_on_trained_norms_only_while_sampling_then_saved_and_reloaded(tmp_path, tiny_llama_dir, text_rewards,
                                                                            monkeypatch):
    seen = []  # the norm weights each rollout samples with
    real = qtrain.make_engine

    def spy(model, *a, **k):
        engine = real(model, *a, **k)
        gen = engine.generate

        def generate(*ga, **gk):
            seen.append(_norms(model))
            return gen(*ga, **gk)

        engine.generate = generate
        return engine

    monkeypatch.setattr(qtrain, "make_engine", spy)
    initial = _norms(build_policy(_cfg(tmp_path, tiny_llama_dir), device=torch.device("cpu"))[0])
    train(_cfg(tmp_path, tiny_llama_dir))
    cks = tmp_path / "run" / "checkpoints"

    def ck_norms(step):
        model = build_policy(_cfg(tmp_path, tiny_llama_dir), device=torch.device("cpu"))[0]
        load_trainable(cks / f"step-{step}", model)
        return _norms(model)

    clean = [initial, ck_norms(1), ck_norms(2)]  # the weights before the rollout of step 0, 1, 2
    assert all(not torch.equal(a, b) for a, b in zip(clean[0], clean[1])), "norms did not train"
    assert all(not torch.equal(a, b) for a, b in zip(clean[1], clean[2]))
    assert len(seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(seen[0], clean[0]))  # stage 0: no noise
    for step, sigma in ((1, 0.05), (2, 0.01)):  # stages 1 and 2: noise of sigma on top of the trained weights
        noise = torch.cat([s - c for s, c in zip(seen[step], clean[step])])
        assert 0.5 * sigma < noise.std() < 1.5 * sigma, (step, noise.std())
    # the PEFT adapter carries the trained norms as modules_to_save and reloads them
    last = ck_norms(3)
    adapter = cks / "step-3" / "adapter"
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(acfg["modules_to_save"]) == ["input_layernorm", "post_attention_layernorm"]
    assert read_checkpoint_config(adapter)["train_norms"] and read_checkpoint_config(cks / "step-3")["train_norms"]
    model = build_policy(_cfg(tmp_path, tiny_llama_dir), device=torch.device("cpu"))[0]
    load_trainable(adapter, model)
    assert all(torch.equal(a, b) for a, b in zip(_norms(model), last))


def test_peft_loads_the_trained_norms(tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl.export import export_peft_adapter

    model = build_policy(_cfg(tmp_path, tiny_llama_dir, method="bf16_lora"), device=torch.device("cpu"))[0]
    with torch.no_grad():
        for _, m in find_norms(model):
            m.weight.add_(torch.randn_like(m.weight) * 0.1)
    info = export_peft_adapter(model, tmp_path / "adapter", str(tiny_llama_dir))
    assert info["modules_to_save"] == ["input_layernorm", "post_attention_layernorm"]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ours = dict(find_norms(model))
    theirs = {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules()
              if n.endswith(("input_layernorm", "post_attention_layernorm"))}
    assert len(ours) == 4
    for name, m in ours.items():
        assert torch.equal(theirs[name].modules_to_save["default"].weight, m.weight.detach()), name


def test_cli_flag():
    p = argparse.ArgumentParser()
    add_train_args(p)
    assert config_from_args(p.parse_args(["--profile", "smoke", "--train-norms"])).train_norms is True
    assert config_from_args(p.parse_args(["--profile", "smoke", "--train-norms", "false"])).train_norms is False
    assert config_from_args(p.parse_args(["--profile", "smoke"])).train_norms is False
    with pytest.raises(SystemExit):
        p.parse_args(["--train-norms", "maybe"])


def test_kl_reference_uses_the_initial_norms(tiny_llama_dir):
    """beta > 0: the reference policy is the model without adapters AND with its norms as loaded."""
    from qerl.train import adapters_disabled

    model, _, _, _ = build_policy(_cfg(Path("."), tiny_llama_dir), device=torch.device("cpu"))
    initial = _norms(model)
    with torch.no_grad():
        for _, m in find_norms(model):
            m.weight.add_(0.1)
    trained = _norms(model)
    with adapters_disabled(model):
        assert all(torch.equal(a, b) for a, b in zip(_norms(model), initial))
    assert all(torch.equal(a, b) for a, b in zip(_norms(model), trained))


def test_resume_with_trained_norms_matches_uninterrupted(tmp_path, tiny_llama_dir, text_rewards):
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    train(_cfg(tmp_path, tiny_llama_dir, output_dir=str(full)))
    train(_cfg(tmp_path, tiny_llama_dir, output_dir=str(cut)), stop_after=2)
    train(_cfg(tmp_path, tiny_llama_dir, output_dir=str(cut), resume_from="auto"))
    from safetensors.torch import load_file

    a = load_file(str(full / "checkpoints" / "step-3" / "trainable.safetensors"))
    b = load_file(str(cut / "checkpoints" / "step-3" / "trainable.safetensors"))
    assert sum("layernorm" in n for n in a) == 4 and a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
