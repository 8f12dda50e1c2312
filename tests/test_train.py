"""The RL loop end to end: metrics, LoRA updates, W&B offline read-back, exact resume, NaN guard,
and the CLI smoke profile on the embedded model.

Run: python -m pytest tests/test_train.py -q      (the embedded-model smoke run takes a few minutes)
"""

import importlib.util
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from qerl import rewards as qrewards
from qerl.config import make_config
from qerl.logging import read_metrics, read_wandb_offline
from qerl.train import NonFiniteError, train

# tests/conftest.py's builders (a plain `import conftest` can pick up tests/kernels/conftest.py)
_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model, make_tiny_tokenizer = _conftest.make_tiny_model, _conftest.make_tiny_tokenizer

REQUIRED = ["reward", "reward_std", "frac_reward_zero_std", "entropy", "kl", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
            "num_tokens", "step_time", "aqn/sigma", "aqn/stage", "aqn/num_modules", "sampling/entropy",
            "sampling/logprob_gap", "time/rollout_s", "time/train_s", "throughput/rollout_tokens_per_s",
            "memory/peak_gib", "loss", "grad_norm", "learning_rate", "perf/train_tokens_per_s", "perf/train_tflops",
            "perf/mfu"]


@pytest.fixture
def text_rewards(monkeypatch):
    """A random tiny model never solves arithmetic: reward a deterministic hash of the text instead,
    so advantages are non-zero and the update path is exercised (resume stays exact)."""

    def fake(completions, golds, **kw):
        r = [float(zlib.crc32(c.encode()) % 2) for c in completions]
        return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))

    monkeypatch.setattr(qrewards, "score_batch", fake)


def tiny_cfg(out, **kw):
    base = dict(output_dir=str(out), method="nvfp4_lora_aqn", eval_datasets=(), max_steps=3, save_every=1,
                max_completion_length=8, prompts_per_step=2, num_generations=4, micro_batch_size=4, lora_rank=4,
                lora_alpha=8, num_stages=3, max_prompt_length=512, wandb_mode="offline", num_iterations=2,
                sigma_start=0.05, sigma_end=0.01)
    return make_config("smoke", **{**base, **kw})


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def test_end_to_end_metrics_lora_and_wandb(tmp_path, text_rewards):
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    summary = train(tiny_cfg(tmp_path / "a"), model=model, tokenizer=tok)
    assert summary["status"] == "ok"
    rows = read_metrics(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["aqn/num_modules"] in (0, 4)  # 2 layers x (input, post_attention) norms
        assert r["perf/train_tokens_per_s"] > 0 and r["perf/train_tflops"] > 0
        assert r["perf/mfu"] is None  # a CPU has no bf16 peak in qerl.perf's table
    assert rows[0]["aqn/sigma"] == 0.0 and rows[-1]["aqn/sigma"] > 0  # stage 0 is noise-free
    assert any(abs(r["loss"]) > 0 for r in rows)
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert any(torch.count_nonzero(p) > 0 for p in b), "LoRA B never moved"
    wb = read_wandb_offline(tmp_path / "a")
    assert wb["config"]["method"] == "nvfp4_lora_aqn"
    hist = [h for h in wb["history"] if "train/reward" in h]  # W&B: TRL's names under train/
    assert [h["train/reward"] for h in hist] == [r["reward"] for r in rows]
    assert [h["train/sampling/sampling_logp_difference/mean"] for h in hist] == [r["sampling/logprob_gap"] for r in rows]
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert "git_sha" in cfg["provenance"] and cfg["provenance"]["torch"] == torch.__version__


def test_resume_matches_uninterrupted(tmp_path, text_rewards):
    tok = make_tiny_tokenizer()
    full = make_tiny_model("llama")
    train(tiny_cfg(tmp_path / "full"), model=full, tokenizer=tok)
    train(tiny_cfg(tmp_path / "cut"), model=make_tiny_model("llama"), tokenizer=tok, stop_after=2)
    resumed = make_tiny_model("llama")
    train(tiny_cfg(tmp_path / "cut", resume_from="auto"), model=resumed, tokenizer=tok)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3]
    for k in ("reward", "loss", "grad_norm", "entropy", "sampling/entropy", "aqn/sigma"):
        assert a[2][k] == b[2][k], k
    for (n, p), (_, q) in zip(lora_state(full).items(), lora_state(resumed).items()):
        assert torch.equal(p, q), n


def test_nan_loss_stops_with_clear_error(tmp_path, text_rewards, monkeypatch):
    from qerl import loss as qloss

    real = qloss.policy_loss

    def nan_loss(*a, **k):
        loss, m = real(*a, **k)
        return loss * float("nan"), m

    monkeypatch.setattr(qloss, "policy_loss", nan_loss)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        train(tiny_cfg(tmp_path / "nan", wandb_mode="disabled"), model=make_tiny_model("llama"),
              tokenizer=make_tiny_tokenizer())


def test_bad_config_values():
    with pytest.raises(ValueError, match="loss_type"):
        make_config("smoke", loss_type="ppo")
    with pytest.raises(ValueError, match="unknown method"):
        make_config("smoke", method="int8_lora")
    with pytest.raises(ValueError, match="unknown profile"):
        make_config("huge")
    with pytest.raises(ValueError, match="bigmath_config"):
        make_config("smoke", bigmath_config="level_9")
    with pytest.raises(ValueError, match="engine must be"):
        make_config("smoke", engine="vllm")


def test_bigmath_config_reaches_the_loader(tmp_path, monkeypatch):
    """The trainer asks for the configured BigMath subset (the paper's 32B row: levels 4-5)."""
    from qerl import data as qdata

    seen = {}

    def fake_load(name, split, **kw):
        seen.update(kw, name=name)
        raise RuntimeError("stop here")

    monkeypatch.setattr(qdata, "load_dataset_split", fake_load)
    with pytest.raises(RuntimeError, match="stop here"):
        train(tiny_cfg(tmp_path / "bm", dataset="bigmath", bigmath_config="level_4_5", wandb_mode="disabled"),
              model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    assert seen["name"] == "bigmath" and seen["config"] == "level_4_5"


@pytest.mark.slow
def test_cli_smoke_profile_on_embedded_model(tmp_path, smollm2):
    """The issue's acceptance run: `python -m qerl train --profile smoke` on the embedded model. Its evaluations
    before and after (asserted nowhere here) decode 8 tokens instead of the profile's 32: on the CPU's NVFP4
    reference path they took a third of the run."""
    out = tmp_path / "smoke"
    r = subprocess.run([sys.executable, "-m", "qerl", "train", "--profile", "smoke", "--output-dir", str(out),
                        "--max-steps", "2", "--save-every", "0", "--eval-max-completion-length", "8"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in read_metrics(out) if "reward" in x]  # the other lines are evaluations
    assert [x["step"] for x in rows] == [1, 2]
    assert all(k in rows[0] for k in REQUIRED)
    assert (out / "checkpoints" / "step-2" / "adapter" / "adapter_config.json").exists()
    assert read_wandb_offline(out)["config"]["profile"] == "smoke"


def test_rollout_rows_bound_the_engine_and_keep_the_tokens(tmp_path, text_rewards, monkeypatch):
    """rollout_rows N: the trainer's fast engine decodes on N rows (freed rows taking waiting sequences), and
    a seeded run gives the same rewards and losses as one row per sequence."""
    from qerl import train as qtrain

    made = []
    real = qtrain.make_engine
    monkeypatch.setattr(qtrain, "make_engine", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    tok = make_tiny_tokenizer()
    kw = dict(wandb_mode="disabled", max_steps=2, engine="fast")
    train(tiny_cfg(tmp_path / "all", **kw), model=make_tiny_model("llama"), tokenizer=tok)
    train(tiny_cfg(tmp_path / "rows", rollout_rows=3, **kw), model=make_tiny_model("llama"), tokenizer=tok)
    assert made[0].max_batch is None and made[1].max_batch == 3 and made[1].last_stats["refills"] == 5
    a, b = read_metrics(tmp_path / "all"), read_metrics(tmp_path / "rows")
    assert [r.get("rollout/refills") for r in b] == [5, 5] and "rollout/refills" not in a[0]
    for k in ("reward", "loss", "sampling/entropy"):
        assert [r[k] for r in a] == pytest.approx([r[k] for r in b], abs=1e-5), k
    with pytest.raises(ValueError, match="rollout_rows"):
        make_config("smoke", rollout_rows=-1)
