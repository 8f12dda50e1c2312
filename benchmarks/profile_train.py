"""Where the training phases' time goes: one policy update (qerl.step.update) under the profiler. GPU tool.

For each method and recomputation mode: a random-weight model (Qwen2.5-7B by default), a synthetic
rollout of --batch rows with the completion lengths of --lengths (prompt --prompt tokens), the update
run twice to warm up, then timed (--reps, median) and once under the profiler. Kernels are grouped:
  4-bit linear    qerl's fp4 kernels (decode into the scratch, grad-input)
  GEMM            cuBLAS / CUTLASS matmuls (the bf16 base linears, the decoded 4-bit ones, LoRA, lm_head)
  attention       flash / efficient attention, forward and backward
  elementwise     the rest: norms, rotary, SiLU, casts, adds, copies, the loss
Prints per group the ms in one update and its share, the top kernels, and the update's model TFLOP/s and
MFU (qerl.perf); writes <out>/profile_train.json (one row per method x mode).

    python -m benchmarks.profile_train --out $OUT                                  # 7B, nvfp4 and bf16, full
    python -m benchmarks.profile_train --methods nvfp4 --recompute full selective --token-budget 18432 6144
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from benchmarks.profile_decode import category
from qerl import formats, perf, recompute
from qerl import step as qstep
from qerl.config import TrainConfig

GROUPS = (  # first match wins
    ("4-bit linear", ("_mma_kernel", "_ws_kernel", "_fwd_gemv_kernel", "_fwd_dot_kernel", "_decode_kernel",
                      "_decode_pairs_kernel", "_bwd_dot_kernel", "kgemm_4bit", "gemv_4bit", *formats.names())),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "gemv")),
)
TOP = 15


def group(name: str) -> str:
    return category(name, GROUPS, "elementwise")


def _cfg(args, mode: str, budget: int) -> TrainConfig:
    """The update's settings: one pass, one optimizer step, GRPO, no KL, padding-free by ``budget`` tokens."""
    return TrainConfig(micro_batch_size=args.micro_batch, padding_free=True, forward_token_budget=budget,
                       num_iterations=1, mini_batch_size=0, seed=0, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                       beta=0.0, max_prompt_length=args.prompt, max_completion_length=args.completion, temperature=1.0,
                       max_grad_norm=1.0, gradient_checkpointing=mode, wandb_mode="disabled")


def profile_one(model, params, args, mode: str, budget: int, lengths: list[int], vocab: int) -> dict:
    from experiments.table3_speed_memory import synthetic_rollout

    recompute.enable(model, mode)
    ro = synthetic_rollout(len(lengths), args.prompt, max(lengths), vocab, "cuda", seed=1, lengths=lengths)
    cfg = _cfg(args, mode, budget)
    batch = qstep.Batch.given(ro, torch.randn(len(lengths)), [len(lengths)], 0)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def once():
        old = torch.zeros_like(ro.logprobs)
        qstep.update(cfg, model, ro, batch, old, None, opt, sched, params, 0, True)
        opt.zero_grad(set_to_none=True)

    once()
    once()
    sc.sync()
    torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        once()
        sc.sync()
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    peak = torch.cuda.max_memory_allocated() / 2**30
    counter = perf.FlopCounter(model)
    rows = [args.prompt + n for n in lengths]
    flops = counter.forward(rows, sum(lengths)) + counter.backward(rows, sum(lengths))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
        sc.sync()
    kern: dict[str, list] = {}
    for e in prof.key_averages():  # CUDA activity only: kernels, copies and sets, each with its own device time
        t = getattr(e, "self_device_time_total", None)
        t = t if t is not None else getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.key:
            kern.setdefault(e.key, [0.0, 0])
            kern[e.key][0] += t / 1e3
            kern[e.key][1] += e.count
    groups: dict[str, float] = {}
    for k, (ms, _) in kern.items():
        groups[group(k)] = groups.get(group(k), 0.0) + ms
    total = sum(groups.values())
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:TOP]
    return dict(recompute=mode, token_budget=budget, forwards=len(qstep.forwards(cfg, ro.prompt_mask, ro.completion_mask,
                                                                                  torch.arange(len(lengths)))),
                update_s=wall, update_walls=walls, peak_gib=peak, model_flops=flops, tflops=flops / wall / 1e12,
                mfu=perf.mfu(flops, wall, perf.peak_tflops()), kernel_ms=total,
                groups_ms={g: round(v, 2) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
                top=[dict(kernel=k[:160], ms=round(v[0], 2), calls=v[1], group=group(k)) for k, v in top])


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=list(sc.MODELS))
    ap.add_argument("--methods", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--recompute", nargs="+", default=["full"], choices=recompute.MODES)
    ap.add_argument("--token-budget", nargs="+", type=int, default=[18432],
                    help="tokens per forward, one per --recompute mode (or one for all)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--lengths", default="mix", type=sc.lengths_arg, help=sc.LENGTHS_HELP)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (0: all)")
    ap.add_argument("--out", default="results/train_profile")
    args = ap.parse_args(argv)
    budgets = args.token_budget * len(args.recompute) if len(args.token_budget) == 1 else args.token_budget
    if len(budgets) != len(args.recompute):
        ap.error("--token-budget: one value, or one per --recompute mode")
    prov = sc.provenance()
    print("env:", json.dumps(prov["env"]))
    lengths = sc.draw_lengths(args.lengths, args.batch, args.completion, seed=0)
    vocab = sc.vocab_size(args.model)
    result = {**prov, "settings": vars(args), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        model = sc.build(args.model, method, args.lora_rank, "cuda", seed=0)
        if args.layers:
            model.model.layers = model.model.layers[:args.layers]
            model.config.num_hidden_layers = args.layers
        from qerl.quantize import lora_parameters

        params = lora_parameters(model)
        for mode, budget in zip(args.recompute, budgets):
            try:
                row = dict(model=args.model, method=method, **profile_one(model, params, args, mode, budget, lengths, vocab))
            except Exception as e:  # noqa: BLE001 - an OOM is a result too
                row = dict(model=args.model, method=method, recompute=mode, token_budget=budget,
                           error=f"{type(e).__name__}: {str(e)[:300]}")
                sc.free()
            result["rows"].append(row)
            (out / "profile_train.json").write_text(json.dumps(result, indent=1))
            if "error" in row:
                print(f"{method} {mode} budget {budget}: {row['error'][:200]}")
                continue
            print(f"\n{method} recompute={mode} budget={budget} forwards={row['forwards']}: update {row['update_s']:.2f} s, "
                  f"{row['tflops']:.0f} TFLOP/s, MFU {row['mfu']}, peak {row['peak_gib']:.1f} GiB, kernels {row['kernel_ms']:.0f} ms")
            for g, ms in row["groups_ms"].items():
                print(f"  {g:14s} {ms:9.1f} ms  {100 * ms / row['kernel_ms']:5.1f}%")
            for t in row["top"]:
                print(f"    {t['ms']:8.1f} ms {t['calls']:6d}x  {t['group'][:5]}  {t['kernel'][:110]}")
        del model, params
        sc.free()


if __name__ == "__main__":
    main()
