"""Data-parallel training (qerl.distributed) on the CPU: 2 gloo ranks under torchrun vs 1 process.

The 2-rank run and the single-process run of the same config (same global batch, fp32) must log the
same metrics at every step (loss, grad norm before clipping, rewards, entropies, token counts: so
the metrics are reduced over ranks), end with the same LoRA weights (identical on both ranks), and
only rank 0 writes files. Four loss types, uneven prompt shares (3 prompts on 2 ranks), micro-
batches that mix the ranks' completions, several optimizer steps per rollout, AQN noise at step 2.

Run: OMP_NUM_THREADS=1 python -m pytest tests/test_distributed.py -q      (~30 s on 2 cores)
This file is also the worker that torchrun starts (``python tests/test_distributed.py OUT``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

VARIANTS = {  # name -> config overrides; every run: 3 prompts x 4 samples, mini-batch 8, micro-batch 4
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="batch"),
    "dapo": dict(loss_type="dapo", dynamic_sampling=True, beta=0.04),
    # the default runs above are padding-free with the default budget (each forward a micro-batch or more);
    # a budget of ~2 rows cuts micro-batches across forwards; the padded path stays covered
    "packed_bnpo_small_budget": dict(loss_type="bnpo", forward_token_budget=40),
    "padding_free_off_grpo": dict(loss_type="grpo", padding_free=False),
}
COMPARED = ["loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "entropy", "sampling/entropy",
            "sampling/logprob_gap", "clip_ratio/region_mean", "completions/mean_length", "num_tokens",
            "rewards/accuracy/mean", "aqn/sigma", "kl", "learning_rate"]


def _builders():
    spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tiny_model, mod.make_tiny_tokenizer


def _hash_rewards(completions, golds, **kw):
    """A random tiny model never solves arithmetic: a hash of the text gives non-zero advantages."""
    from qerl import rewards as qrewards

    r = [float(zlib.crc32(c.encode()) % 2) for c in completions]
    return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))


def _cfg(out, **kw):
    from qerl.config import make_config

    base = dict(output_dir=str(out), method="nvfp4_lora_aqn", dtype="float32", eval_datasets=(), max_steps=2,
                save_every=0, max_completion_length=8, prompts_per_step=3, num_generations=4, mini_batch_size=8,
                micro_batch_size=4, num_iterations=2, lora_rank=4, lora_alpha=8, num_stages=3, sigma_start=0.05,
                sigma_end=0.01, max_prompt_length=512, wandb_mode="disabled", learning_rate=1e-3)
    return make_config("smoke", **{**base, **kw})


def _run(out, variant):
    """One training run of ``variant`` (fp32 tiny Llama); returns (final trainable weights [P], the
    gradient of every optimizer step after the all-reduce, before clipping [updates, P])."""
    from qerl import distributed as qdist
    from qerl.train import train

    make_tiny_model, make_tiny_tokenizer = _builders()
    model = make_tiny_model("llama", dtype=torch.float32)
    grads, reduce = [], qdist.all_reduce_grads

    def recording(params, **kw):
        params = list(params)
        reduce(params, **kw)
        grads.append(torch.cat([p.grad.detach().flatten() for p in params]))

    qdist.all_reduce_grads = recording
    try:
        train(_cfg(out, **VARIANTS[variant]), model=model, tokenizer=make_tiny_tokenizer())
    finally:
        qdist.all_reduce_grads = reduce
    return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if p.requires_grad]), torch.stack(grads)


# ----------------------------------------------------------------------------- the torchrun worker
def _worker(base: Path):
    from qerl import distributed as qdist
    from qerl import rewards as qrewards

    qrewards.score_batch = _hash_rewards  # this process runs nothing else
    assert qdist.init(), "expected torchrun's environment (WORLD_SIZE > 1)"
    rank, world = qdist.world()
    # helpers, with values that differ per rank
    helpers = {
        "sum": qdist.all_reduce([1.0, rank + 1.0], "sum"),
        "max": qdist.all_reduce(float(rank), "max"),
        "min": qdist.all_reduce(float(rank), "min"),
        "weighted_mean": qdist.weighted_mean(value_sum=[2.0, 12.0][rank], weight=[1.0, 3.0][rank]),
        "any": [qdist.any_true(rank == 1), qdist.any_true(False)],
        "gather": qdist.gather_shards(torch.arange(2 - rank, dtype=torch.float32) + 10 * rank, [2, 1]).tolist(),
    }
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    p[0].grad = torch.full((3,), rank + 1.0)
    if rank == 1:  # p[1] has a gradient on rank 1 only, p[2] on no rank
        p[1].grad = torch.ones(2)
    qdist.all_reduce_grads(p, bucket_numel=4)  # 2 buckets
    helpers["grads"] = [None if q.grad is None else q.grad.tolist() for q in p]
    (base / f"helpers_rank{rank}.json").write_text(json.dumps(helpers))
    for variant in VARIANTS:
        weights, grads = _run(base / variant / f"rank{rank}", variant)  # per-rank folders: rank 1's must stay empty
        torch.save({"weights": weights, "grads": grads}, base / f"{variant}_rank{rank}.pt")
    qdist.barrier()
    qdist.cleanup()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    raise SystemExit(0)


# ----------------------------------------------------------------------------- tests
def _close(a, b, rel=1e-4, abs_=1e-6):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= abs_ + rel * abs(b)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, str(base)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return base


def test_helpers_reduce_over_ranks(two_ranks):
    for rank in (0, 1):
        h = json.loads((two_ranks / f"helpers_rank{rank}.json").read_text())
        assert h["sum"] == [2.0, 3.0] and h["max"] == 1.0 and h["min"] == 0.0
        assert h["weighted_mean"] == pytest.approx(14.0 / 4.0)  # (2 + 12) / (1 + 3), not the mean of 2 and 4
        assert h["any"] == [True, False]
        assert h["gather"] == [0.0, 1.0, 10.0]  # rank 0 holds 2 rows, rank 1 one row
        assert h["grads"] == [[3.0, 3.0, 3.0], [1.0, 1.0], None]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_match_one_process(two_ranks, tmp_path, monkeypatch, variant):
    from qerl import rewards as qrewards
    from qerl.logging import read_metrics

    monkeypatch.setattr(qrewards, "score_batch", _hash_rewards)
    ref_dir = tmp_path / "one"
    ref_w, ref_g = _run(ref_dir, variant)
    ref = read_metrics(ref_dir)
    run0 = two_ranks / variant / "rank0"
    got = read_metrics(run0)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2]
    assert ref[0]["aqn/sigma"] == 0 and ref[1]["aqn/sigma"] > 0  # step 2 samples with AQN noise
    assert ref[0]["loss"] != 0 and ref[0]["grad_norm"] > 0  # a real update, not an all-zero advantage
    bad = [(r["step"], k, a[k], r[k]) for a, r in zip(got, ref) for k in COMPARED if not _close(a[k], r[k])]
    assert not bad, bad
    assert got[0]["num_tokens"] > 0 and json.loads((run0 / "config.json").read_text())["world_size"] == 2
    # every optimizer step's summed gradient is the single-process gradient; the ranks stay in sync
    r0, r1 = (torch.load(two_ranks / f"{variant}_rank{r}.pt") for r in (0, 1))
    assert torch.equal(r0["weights"], r1["weights"]) and torch.equal(r0["grads"], r1["grads"])
    # 2 steps x 2 iterations x 2 mini-batches (1 where dynamic sampling leaves <= 8 completions)
    assert r0["grads"].shape == ref_g.shape and ref_g.shape[0] >= 6
    rel = ((r0["grads"] - ref_g).norm(dim=1) / ref_g.norm(dim=1)).max()
    assert rel < 1e-4, float(rel)
    # (not the weights elementwise: AdamW turns a rounding-level sign change of a ~0 gradient element
    # into a full lr step of that element; the rest agree)
    assert ((r0["weights"] - ref_w).abs() > 1e-5).float().mean() < 0.01
    # files on rank 0 only
    assert (run0 / "summary.json").exists() and (run0 / "checkpoints" / "step-2" / "trainable.safetensors").exists()
    assert not (two_ranks / variant / "rank1").exists()


def test_single_process_helpers_are_identity(monkeypatch):
    from qerl import distributed as qdist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert qdist.init() is False and qdist.world() == (0, 1) and qdist.is_main()
    assert qdist.all_reduce([1.5, 2.0], "max") == [1.5, 2.0] and qdist.weighted_mean(3.0, 2.0) == 1.5
    x = torch.arange(3.0)
    assert qdist.gather_shards(x, [3]) is x
    with pytest.raises(ValueError, match="op must be"):
        qdist.all_reduce(1.0, "mean")


@pytest.mark.parametrize("n,world", [(3, 2), (8, 3), (2, 2), (16, 8)])
def test_shard_is_a_contiguous_balanced_partition(n, world):
    from qerl.distributed import shard

    parts = [shard(n, r, world) for r in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batch_packing():
    """Each rank gets its members of every micro-batch, in order, packed into forwards of at most
    ``capacity`` rows; over the ranks every completion is run exactly once."""
    from qerl.distributed import pack_micro_batches, shard

    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    micro = [order[i:i + 4] for i in range(0, 12, 4)]
    seen = []
    for rank in range(2):
        lo, hi = shard(3, rank, 2)
        first, n_local = lo * 4, (hi - lo) * 4  # 3 prompts x 4 samples on 2 ranks: 8 and 4 completions
        packs = list(pack_micro_batches(micro, first, n_local, capacity=4))
        assert all(sum(own.numel() for _, own in p) <= 4 for p in packs)
        members = [(j, own) for p in packs for j, own in p]
        assert [j for j, _ in members] == sorted(j for j, _ in members)  # micro-batch order kept
        for j, own in members:
            assert own.min() >= 0 and own.max() < n_local
            assert torch.equal(own + first, micro[j][(micro[j] >= first) & (micro[j] < first + n_local)])
        seen += [int(i) for _, own in members for i in own + first]
    assert sorted(seen) == list(range(12))
    # one process: each pack is one micro-batch, as it was cut
    packs = list(pack_micro_batches(micro, 0, 12, capacity=4))
    assert [[(j, own.tolist()) for j, own in p] for p in packs] == [[(j, m.tolist())] for j, m in enumerate(micro)]
    # a rank with a few rows of each micro-batch fills its forwards with several micro-batches
    packs = list(pack_micro_batches(micro, 0, 6, capacity=4))
    assert len(packs) < sum(1 for m in micro if ((m >= 0) & (m < 6)).any())
    assert list(pack_micro_batches(micro, 12, 0, capacity=4)) == []


def test_too_few_prompts_for_the_world(tmp_path, monkeypatch):
    from qerl import distributed as qdist
    from qerl.train import train

    monkeypatch.setattr(qdist, "init", lambda *a, **k: False)
    monkeypatch.setattr(qdist, "world", lambda: (0, 4))
    make_tiny_model, make_tiny_tokenizer = _builders()
    with pytest.raises(ValueError, match="every rank needs a prompt"):
        train(_cfg(tmp_path, prompts_per_step=3), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())


def test_balance_splits_packed_rows_by_tokens():
    """qerl.distributed.balance: every row once, the same split for the same rows in any order, loads within
    the longest row of each other (longest first, to the least-loaded rank)."""
    from qerl.distributed import balance

    tokens = torch.tensor([900, 40, 300, 300, 120, 0, 2048, 75, 600, 610])
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    for world in (1, 2, 3, 4):
        parts = balance(rows, tokens, world)
        assert sorted(torch.cat(parts).tolist()) == rows.tolist()
        assert [p.tolist() for p in parts] == [p.tolist() for p in balance(rows.flip(0), tokens, world)]
        loads = [int(tokens[p].sum()) for p in parts]
        assert max(loads) - min(loads) <= int(tokens.max())
    two = balance(rows, tokens, 2)
    assert abs(int(tokens[two[0]].sum()) - int(tokens[two[1]].sum())) <= 300  # 2508 / 2485 here
