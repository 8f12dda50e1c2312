"""The trainer core: fp32 master weights for bf16_full, the rollout-gap guard, and reusing the
training forward's log-probs as old log-probs (the chunked log-probs: test_logprobs.py).

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_step.py -q
"""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model, make_tiny_tokenizer = _conftest.make_tiny_model, _conftest.make_tiny_tokenizer


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


def test_step_refuses_what_it_cannot_run(tmp_path):
    """step() needs the step's prompts and the tokenizer that scores them; ``Batch.given`` (a benchmark's
    own advantages) needs one advantage per completion."""
    cfg = tiny_cfg(tmp_path)
    with pytest.raises(ValueError, match="needs the step's prompts"):
        qstep.step(cfg, None, None, None, None, [], None, 0, tokenizer=None)
    with pytest.raises(ValueError, match="needs the step's prompts"):
        qstep.step(cfg, None, None, None, None, [], [{"prompt_ids": [1, 2]}], 0, tokenizer=None)
    ro = qstep.RolloutOutput(*(torch.ones(2, 3, dtype=torch.long),) * 4, torch.zeros(2, 3), torch.zeros(2, 3),
                             torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="3 advantages for 2 completions"):
        qstep.Batch.given(ro, torch.zeros(3), [2], 0)
    b = qstep.Batch.given(ro, torch.arange(2.0), [2], 0)
    assert b.idx.tolist() == [0, 1] and b.n_loss_tokens.tolist() == [3.0, 3.0] and b.n_local == 2


def test_micro_batches_are_cut_to_their_longest_completion(monkeypatch):
    """Old / reference log-probs over micro-batches cut to their own longest completion (rounded up to
    WIDTH_ROUND) equal those over the rollout's full width: the padding after a row's last token changes
    nothing before it (causal attention)."""
    from types import SimpleNamespace

    from qerl.rollout import RolloutOutput

    torch.manual_seed(0)
    model = make_tiny_model("llama", dtype=torch.float32)
    B, P, C = 6, 5, 150
    lengths = torch.tensor([3, 140, 7, 9, 70, 1])
    cmask = (torch.arange(C)[None] < lengths[:, None]).long()
    ro = RolloutOutput(torch.randint(3, 60, (B, P)), torch.ones(B, P, dtype=torch.long),
                       torch.randint(3, 60, (B, C)) * cmask, cmask, torch.zeros(B, C), torch.zeros(B, C),
                       torch.ones(B, dtype=torch.bool))
    cfg = SimpleNamespace(micro_batch_size=2, beta=0.1, temperature=1.0, padding_free=False)
    seen = []
    real = qstep.sequence_logprobs
    monkeypatch.setattr(qstep, "sequence_logprobs", lambda m, *a, **k: seen.append(a[2].shape[1]) or real(m, *a, **k))
    cut_old, cut_ref = qstep.logprobs(cfg, model, ro, reuse=False)
    # micro-batches (3, 140): 140 rounds to 192, at most C = 150; (7, 9) -> 64; (70, 1) -> 128; old then reference
    assert seen == [150, 150, 64, 64, 128, 128]
    monkeypatch.setattr(qstep, "WIDTH_ROUND", 10 ** 6)  # no cut: every micro-batch at the full width
    full_old, full_ref = qstep.logprobs(cfg, model, ro, reuse=False)
    assert seen[6:] == [C] * 6
    real_tok = cmask == 1  # what the loss reads; the full-width forward also fills the padding
    torch.testing.assert_close(cut_old[real_tok], full_old[real_tok], atol=1e-5, rtol=0)
    torch.testing.assert_close(cut_ref[real_tok], full_ref[real_tok], atol=1e-5, rtol=0)
    assert (cut_old[real_tok] != 0).all()
