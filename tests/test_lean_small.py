"""The lean small profile: gradient checkpointing (same update, less memory), the KV cache sized from the
run's prompts, evaluation batches, and what a run records (peak memory in the summary, the command and
where its data came from)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from qerl.config import eval_settings, make_config
from qerl.logging import read_metrics
from qerl.train import train

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)


def _cfg(out, **kw):
    base = dict(output_dir=str(out), method="nvfp4_lora_aqn", eval_datasets=(), max_steps=2, save_every=0,
                max_completion_length=6, prompts_per_step=2, num_generations=4, micro_batch_size=4, lora_rank=4,
                lora_alpha=8, num_stages=2, max_prompt_length=512, wandb_mode="disabled", num_iterations=1,
                sigma_start=0.05, sigma_end=0.01, learning_rate=1e-2)
    return make_config("smoke", **{**base, **kw})


def test_small_profile_is_lean():
    cfg = make_config("small")
    assert cfg.gradient_checkpointing and eval_settings(cfg)["batch_size"] == 256
    assert eval_settings(make_config("small", eval_batch_size=0))["batch_size"] == 64  # max(micro_batch_size, 8)
    assert make_config("smoke").eval_before and not make_config("small", eval_before=False).eval_before
    with pytest.raises(ValueError, match="eval_batch_size"):
        make_config("small", eval_batch_size=-1)


def test_gradient_checkpointing_gives_the_same_update(tmp_path, monkeypatch):
    from qerl import rewards as qrewards

    def fake(completions, golds, **kw):  # a reward that varies, so the update is not zero
        r = [float(len(c) % 2) for c in completions]
        return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))

    monkeypatch.setattr(qrewards, "score_batch", fake)
    tok, states, grads = _conftest.make_tiny_tokenizer(), [], []
    for gc in (False, True):
        model = _conftest.make_tiny_model("llama")
        train(_cfg(tmp_path / f"gc{gc}", gradient_checkpointing=gc, max_steps=1), model=model, tokenizer=tok)
        states.append({n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n})
        grads.append([r["grad_norm"] for r in read_metrics(tmp_path / f"gc{gc}")])
    assert grads[0][0] > 0 and grads[0] == pytest.approx(grads[1], rel=1e-5)
    moved = 0
    for n, p in states[0].items():
        torch.testing.assert_close(p, states[1][n], rtol=1e-5, atol=1e-6)
        moved += ".lora_B." in n and bool(torch.count_nonzero(p))
    assert moved


def test_run_records_peak_memory_command_and_data_source(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/qerl/__main__.py", "train", "--profile", "smoke"])
    tok = _conftest.make_tiny_tokenizer()
    out = tmp_path / "run"
    summary = train(_cfg(out, max_steps=1, eval_datasets=("arith",), eval_limit=2, eval_before=False,
                         eval_max_completion_length=4), model=_conftest.make_tiny_model("llama"), tokenizer=tok)
    assert summary["status"] == "ok" and summary["memory/peak_gib"] > 0  # the CPU: the process's peak RSS
    assert "eval_before/arith/accuracy" not in summary and "eval/arith/accuracy" in summary
    assert [r["step"] for r in read_metrics(out)][0] == 1  # no step-0 evaluation
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["data_sources"] == {"arith": "built-in"}
    assert cfg["command"].endswith("-m qerl train --profile smoke")
    assert json.loads((out / "summary.json").read_text())["memory/peak_gib"] == summary["memory/peak_gib"]


def test_training_cache_is_sized_from_the_longest_prompt(tmp_path, monkeypatch):
    from qerl import train as qtrain

    seen = {}
    real = qtrain.make_engine

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(qtrain, "make_engine", spy)
    tok = _conftest.make_tiny_tokenizer()
    train(_cfg(tmp_path / "r", max_steps=1), model=_conftest.make_tiny_model("llama"), tokenizer=tok)
    from qerl import data as qdata

    recs = qdata.load_dataset_split("arith", "train", seed=0, levels=make_config("smoke").arith_levels)
    recs, _ = qdata.tokenize_prompts(recs, tok, 512)
    assert seen["max_seq_len"] == max(len(r["prompt_ids"]) for r in recs) + 6 < 512
