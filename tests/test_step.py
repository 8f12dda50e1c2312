"""The trainer core: chunked training log-probs, fp32 master weights for bf16_full, the
rollout-gap guard, and reusing the training forward's log-probs as old log-probs.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_step.py -q
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from qerl.rollout.hf import token_logprobs

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model, make_tiny_tokenizer = _conftest.make_tiny_model, _conftest.make_tiny_tokenizer


# ----------------------------------------------------------------------------- chunked log-probs
def _unchunked(h, w, ids, T):
    logp_all = torch.log_softmax((h.float() @ w.float().t()) / T, dim=-1)
    return logp_all.gather(-1, ids[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_logprobs_equal_unchunked_values_and_grads(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).float().requires_grad_(True)
    w = torch.randn(50, 16, generator=g).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    up = torch.randn(3, 7, generator=g)
    ref_lp, ref_ent = _unchunked(h, w, ids, 0.7)
    (ref_lp * up).sum().backward()
    ref_gh, ref_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, ent = token_logprobs(h, w, ids, 0.7, with_entropy=True, chunk_rows=chunk)
    assert lp.shape == ids.shape and ent.shape == ids.shape and not ent.requires_grad
    (lp * up).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, ref_gw, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        lp2, none = token_logprobs(h, w, ids, 0.7, chunk_rows=chunk)
    assert none is None and torch.equal(lp2, lp.detach())


def test_chunked_logprobs_keep_no_full_logits(monkeypatch):
    """Under autograd no tensor of [rows, vocabulary] is saved for the backward: at most one chunk's
    logits exist at a time (the checkpointed chunk keeps only its inputs)."""
    h = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(1000, 8)
    ids = torch.randint(0, 1000, (64,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(h, w, ids, 1.0, with_entropy=True, chunk_rows=16)
    assert max(saved) <= max(16 * 1000, w.numel())  # never 64 x 1000 at once
    lp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    with pytest.raises(ValueError, match="chunk_rows"):
        token_logprobs(h, w, ids, chunk_rows=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_logprobs_peak_memory_on_gpu():
    """8 x 2048 rows of a 7B-sized head (152k vocabulary): one fp32 copy of the unchunked logits alone
    is 9.3 GiB; the chunked forward + backward stays within a few chunks (0.58 GiB each) of its inputs,
    and gives the unchunked values (bf16 operands, fp32 logits as on the GPU path)."""
    from qerl.rollout.common import lm_logits
    from qerl.rollout.hf import LOGPROB_CHUNK_ROWS

    torch.manual_seed(0)
    H, V = 3584, 152064
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(8, 2048, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, V, (8, 2048), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = token_logprobs(h, w, ids, 1.0, with_entropy=True)
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    chunk = LOGPROB_CHUNK_ROWS * V * 4 / 2**30
    assert extra < 8 * chunk + 3 * h.numel() * 2 / 2**30, f"{extra:.2f} GiB above the inputs"
    with torch.no_grad():
        ref = torch.log_softmax(lm_logits(h[:1], w), -1).gather(-1, ids[:1, :, None]).squeeze(-1)
    torch.testing.assert_close(lp[:1].detach(), ref, atol=1e-3, rtol=1e-3)
    assert torch.isfinite(h.grad).all() and torch.isfinite(ent).all()


# ----------------------------------------------------------------------------- the trainer

from qerl import step as qstep  # noqa: E402
from qerl import train as qtrain  # noqa: E402
from qerl.config import make_config  # noqa: E402
from qerl.logging import read_metrics  # noqa: E402


def tiny_cfg(out, **kw):
    base = dict(output_dir=str(out), method="nvfp4_lora", eval_datasets=(), max_steps=1, save_every=0,
                max_completion_length=8, prompts_per_step=2, num_generations=4, micro_batch_size=4, lora_rank=4,
                lora_alpha=8, num_stages=3, max_prompt_length=512, wandb_mode="disabled", num_iterations=1,
                sigma_start=0.05, sigma_end=0.01)
    return make_config("smoke", **{**base, **kw})


def run_tiny(cfg):
    qtrain.train(cfg, model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    return [r for r in read_metrics(cfg.output_dir) if "loss" in r]


def test_bf16_full_fp32_masters_move_at_lr_1e5(tmp_path, text_rewards, monkeypatch):
    """One step at lr 1e-5 changes >= 90% of the weights that got a non-zero gradient (the fp32
    masters; a bf16 AdamW step of 1e-5 rounds away on most weights), and the bf16 weights are the
    masters rounded."""
    seen = {}
    real = qtrain.make_optimizer

    def spy(cfg, params, total):
        opt, sched = real(cfg, params, total)
        seen["opt"] = opt

        def pre(o, *_):
            seen["before"] = [p.detach().clone() for p in qtrain.optimizer_params(o)]
            seen["grad"] = [None if p.grad is None else p.grad.detach().clone() for p in qtrain.optimizer_params(o)]
        opt.register_step_pre_hook(pre)
        return opt, sched

    monkeypatch.setattr(qtrain, "make_optimizer", spy)
    cfg = tiny_cfg(tmp_path / "full", method="bf16_full", learning_rate=1e-5)
    model = make_tiny_model("llama")
    qtrain.train(cfg, model=model, tokenizer=make_tiny_tokenizer())
    opt = seen["opt"]
    master = opt.qerl_master
    assert master is not None and all(m.dtype == torch.float32 for m in master.masters)
    assert all(p.grad is None for p in master.params if p.dtype == torch.bfloat16)  # moved into the masters
    moved = total = 0
    for before, g, after in zip(seen["before"], seen["grad"], qtrain.optimizer_params(opt)):
        if g is None:
            continue
        nz = g != 0
        total += int(nz.sum())
        moved += int((after.detach() != before)[nz].sum())
    assert total > 1000 and moved / total >= 0.9, (moved, total)
    for p, m in zip(master.params, master.masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "full/checkpoints/step-1/trainable.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}  # the checkpoint holds the masters


def test_bf16_full_resume_restores_masters(tmp_path, text_rewards):
    cfg = tiny_cfg(tmp_path / "r", method="bf16_full", max_steps=2, save_every=1, learning_rate=1e-5)
    qtrain.train(cfg, model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    straight = read_metrics(tmp_path / "r")
    cfg2 = tiny_cfg(tmp_path / "s", method="bf16_full", max_steps=2, save_every=1, learning_rate=1e-5)
    qtrain.train(cfg2, model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer(), stop_after=1)
    cfg3 = tiny_cfg(tmp_path / "s", method="bf16_full", max_steps=2, save_every=1, learning_rate=1e-5,
                    resume_from="auto")
    qtrain.train(cfg3, model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    resumed = read_metrics(tmp_path / "s")
    a = [r for r in straight if r["step"] == 2 and "loss" in r][0]
    b = [r for r in resumed if r["step"] == 2 and "loss" in r][0]
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def _count_forwards(monkeypatch):
    calls = {"no_grad": 0, "grad": 0}
    real = qstep.sequence_logprobs

    def counting(*a, **k):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return real(*a, **k)

    monkeypatch.setattr(qstep, "sequence_logprobs", counting)
    return calls


@pytest.mark.parametrize("kw, reused", [(dict(num_iterations=1), True),
                                        (dict(num_iterations=2), False),
                                        (dict(num_iterations=1, mini_batch_size=4), False)])
def test_old_logprobs_forward_skipped_only_for_one_update(tmp_path, text_rewards, monkeypatch, kw, reused):
    calls = _count_forwards(monkeypatch)
    run_tiny(tiny_cfg(tmp_path / "c", **kw))
    assert (calls["no_grad"] == 0) is reused and calls["grad"] > 0
    assert qstep.reuse_training_logprobs(tiny_cfg(tmp_path, **kw), 8) is reused


def test_reused_old_logprobs_give_the_separate_forwards_loss(tmp_path, text_rewards, monkeypatch):
    calls = _count_forwards(monkeypatch)
    a = run_tiny(tiny_cfg(tmp_path / "reuse", max_steps=2))
    assert calls["no_grad"] == 0
    monkeypatch.setattr(qstep, "reuse_training_logprobs", lambda cfg, n: False)
    b = run_tiny(tiny_cfg(tmp_path / "separate", max_steps=2))
    assert calls["no_grad"] > 0
    for x, y in zip(a, b):
        for k in ("loss", "grad_norm", "reward", "sampling/logprob_gap"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k
        assert x["clip_ratio/region_mean"] == 0.0


class _ShiftedEngine:
    """A broken rollout: its log-probs are 1 nat below what the model gives."""

    def __init__(self, engine):
        self.engine, self.pad_id = engine, engine.pad_id

    def generate(self, *a, **k):
        ro = self.engine.generate(*a, **k)
        ro.logprobs = ro.logprobs - 1.0 * ro.completion_mask
        return ro


def test_broken_rollout_stops_with_the_measured_gap(tmp_path, text_rewards, monkeypatch):
    real = qtrain.make_engine
    monkeypatch.setattr(qtrain, "make_engine", lambda *a, **k: _ShiftedEngine(real(*a, **k)))
    cfg = tiny_cfg(tmp_path / "gap", max_steps=5, max_logprob_gap_steps=2)
    with pytest.raises(qtrain.RolloutGapError, match=r"gap 1\.0\d\d nats at step 2.*max_logprob_gap=0\.2"):
        run_tiny(cfg)
    import json

    summary = json.loads((tmp_path / "gap/summary.json").read_text())
    assert summary["status"] == "stopped" and "gap" in summary["error"]
    # AQN runs are exempt (their noise widens the gap on purpose); 0 disables the check
    assert len(run_tiny(tiny_cfg(tmp_path / "aqn", method="nvfp4_lora_aqn", max_steps=3, max_logprob_gap_steps=2))) == 3
    assert len(run_tiny(tiny_cfg(tmp_path / "off", max_steps=3, max_logprob_gap_steps=0))) == 3


def test_gap_guard_config_and_cli_line(monkeypatch, capsys):
    with pytest.raises(ValueError, match="max_logprob_gap must be > 0"):
        make_config("smoke", max_logprob_gap=0.0)
    with pytest.raises(ValueError, match="max_logprob_gap_steps"):
        make_config("smoke", max_logprob_gap_steps=-1)
    from qerl.cli import main

    def broken(cfg):
        raise qtrain.RolloutGapError("broken rollout: mean |rollout - training| log-prob gap 0.412 nats at step 3")

    monkeypatch.setattr(qtrain, "train", broken)
    assert main(["train", "--profile", "smoke", "--max-logprob-gap", "0.3"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: broken rollout: mean |rollout - training| log-prob gap 0.412 nats at step 3"]


def test_dapo_with_every_completion_masked_trains_on_nothing(tmp_path, text_rewards):
    """mask_truncated_completions on completions that are all truncated: no loss token anywhere; dapo's
    global normaliser is clamped at 1 like the others, so the step has loss 0 instead of an error."""
    rows = run_tiny(tiny_cfg(tmp_path / "d", loss_type="dapo", mask_truncated_completions=True, max_completion_length=2))
    assert rows[0]["completions/clipped_ratio"] == 1.0 and rows[0]["loss"] == 0.0
