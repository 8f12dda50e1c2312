"""Where a rollout decode step's time goes, by kernel category. GPU tool.

For each method and batch: the fast engine (static KV cache, CUDA graphs, fused decode step) on a
random-weight model; wall time per decode step from two rollouts of the same prompts, one of 1 token
(prefill) and one of 1 + T tokens (median of --reps each: (long - short) / T); then both under the
profiler, so that the kernels of T decode steps are the difference of the two profiles, grouped:
  4-bit linear    qerl's fp4 kernels (GEMV / tensor-core / decode)
  cuBLAS GEMM     the bf16 base linears, the LoRA GEMMs and the logits
  attention       scaled-dot-product / flash kernels
  qerl fused      qerl.kernels.fused (RMSNorm, rotary + KV write, SiLU*up, LoRA A / B)
  sampling        softmax, top-k / top-p, the Gumbel sampler, argmax
  other           the rest (copies, casts, bookkeeping)
Prints per category: ms and kernels per decode step, and the TOP kernels by time; writes <out>/profile_decode.json
after each row. ``--pdl on off`` times each row with programmatic dependent launch of qerl's kernels on and off
(a fresh model for each: the kernel launches are kept per weight; without it, as QERL_PDL set it);
``--no-profile`` times the walls only.

    python -m benchmarks.profile_decode --out $OUT                      # Qwen2.5-7B, nvfp4 and bf16, bs 1 / 8 / 64
    python -m benchmarks.profile_decode --model qwen2.5-14b --batch 8 --layers 8
    python -m benchmarks.profile_decode --batch 4 16 64 --prompt 1792 --attention qerl sdpa   # long cache, both kernels
    python -m benchmarks.profile_decode --batch 1 4 16 64 --pdl on off --no-profile            # PDL A/B, walls
    python -m benchmarks.profile_decode --batch 16 64 --lora-a-beside on off                  # lora_a beside the matmuls, A/B
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from qerl import formats, kernels
from qerl.models import model_config
from qerl.rollout import fused_linear

CATEGORIES = (  # first match wins; names as the profiler reports the kernels
    # qerl's Triton fp4 kernels, bitsandbytes' 4-bit kernels, and any kernel named after a registered format
    ("4-bit linear", ("_mma_kernel", "_ws_kernel", "_fwd_gemv_kernel", "_fwd_dot_kernel", "_decode_kernel", "_decode_pairs_kernel",
                      "_bwd_dot_kernel", "kgemm_4bit", "gemv_4bit", *formats.names())),
    ("attention", ("_decode_attn", "flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("qerl fused", ("_add_rmsnorm", "_rmsnorm", "_rope", "_silu", "_lora", "fused")),
    ("sampling", ("softmax", "topk", "sort", "gumbel", "argmax", "cumsum", "exponential", "_sample", "murmur")),
    ("cuBLAS GEMM", ("nvjet", "gemm", "cutlass", "xmma", "gemv", "sm90_", "sm80_", "cublas", "aten::mm",
                     "aten::addmm", "aten::bmm", "aten::linear")),
)


TOP = 12  # kernels listed per row, by time


def category(name: str, table=CATEGORIES, default: str = "other") -> str:
    """The first category of ``table`` ((name, substrings) pairs) whose substring the kernel name holds."""
    low = name.lower()
    for cat, keys in table:
        if any(k.lower() in low for k in keys):
            return cat
    return default


def kernel_times(prof, device_type: str) -> dict[str, tuple[float, int]]:
    """{kernel name: (ms, count)}: device kernels on CUDA, top-level CPU ops otherwise."""
    out = {}
    for e in prof.key_averages():
        if device_type == "cuda":
            t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            if not t or e.key.startswith("aten::") or e.key.startswith("cuda"):
                continue
        else:
            t = e.self_cpu_time_total
        out[e.key] = (t / 1e3, e.count)
    return out


def profile(fn, device_type: str) -> dict[str, tuple[float, int]]:
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sc.sync()
    return kernel_times(prof, device_type)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=list(sc.MODELS))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    ap.add_argument("--methods", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps measured (T)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", nargs="+", choices=("qerl", "sdpa"), default=["qerl"],
                    help="the fused step's attention kernel(s), each profiled in turn (qerl: the engine's default)")
    ap.add_argument("--pdl", nargs="+", choices=("on", "off"), default=None,
                    help="programmatic dependent launch of qerl's kernels, each in turn (sm_90; default: as set)")
    ap.add_argument("--lora-a-beside", nargs="+", choices=("on", "off"), default=None,
                    help="time each row with the group's lora_a beside the base matmuls (a side stream) and in line")
    ap.add_argument("--no-profile", action="store_true", help="wall times only (no profiler pass)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the run, not after it
    device = torch.device(args.device)
    config = model_config(sc.MODELS[args.model])
    if args.layers:
        config.num_hidden_layers = args.layers
    vocab = sc.vocab_size(args.model)
    res = dict(provenance=sc.provenance(), settings=vars(args), rows=[])
    pdl_before = kernels.set_pdl(args.pdl[0] == "on") if args.pdl else None
    beside_before = fused_linear.LORA_A_BESIDE
    try:
        _rows(args, device, config, vocab, res)
    finally:
        if pdl_before is not None:
            kernels.set_pdl(pdl_before)
        fused_linear.LORA_A_BESIDE = beside_before
    Path(args.out, "profile_decode.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def _rows(args, device, config, vocab, res) -> None:
    for method, pdl in [(m, p) for m in args.methods for p in args.pdl or [None]]:
        if pdl is not None:
            kernels.set_pdl(pdl == "on")  # restored by main
        model = sc.build(args.model, method, args.lora_rank, device, seed=args.seed, config=config)
        for batch, attention, beside in [(b, a, s) for b in args.batch for a in args.attention
                                         for s in args.lora_a_beside or [None]]:
            sc.ENGINE_OPTIONS["attention"] = attention
            if beside is not None:
                fused_linear.LORA_A_BESIDE = beside == "on"  # read at capture: a new engine each setting
            engine = sc.make_fast_engine(model, batch, args.prompt + args.tokens + 16)
            prompts = sc.random_prompts(batch, args.prompt, vocab, args.seed)

            def run(n, engine=engine, prompts=prompts):
                return engine.generate(prompts, n, seed=args.seed, **sc.SAMPLING)

            run(1 + args.tokens)  # warm-up: compile, capture every graph the timed calls replay
            walls = {}
            for n in (1, 1 + args.tokens):
                ts = []
                for _ in range(args.reps):
                    sc.sync()
                    t0 = time.perf_counter()
                    run(n)
                    sc.sync()
                    ts.append(time.perf_counter() - t0)
                walls[n] = statistics.median(ts)
            short, long = ({}, {}) if args.no_profile else (profile(lambda: run(1), device.type),
                                                            profile(lambda: run(1 + args.tokens), device.type))
            per_step, per_kernel = {}, {}
            for name, (ms, count) in long.items():
                ms0, c0 = short.get(name, (0.0, 0))
                if ms - ms0 <= 0 and count - c0 <= 0:
                    continue
                per_kernel[name] = ((ms - ms0) / args.tokens, (count - c0) / args.tokens)
                cat = category(name)
                t, c = per_step.get(cat, (0.0, 0.0))
                per_step[cat] = (t + (ms - ms0) / args.tokens, c + (count - c0) / args.tokens)
            step_ms = (walls[1 + args.tokens] - walls[1]) / args.tokens * 1e3
            row = dict(method=method, batch=batch, attention=getattr(engine, "attention", "sdpa"),
                       pdl=kernels.pdl(device), lora_a_beside=fused_linear.LORA_A_BESIDE, step_ms=step_ms,
                       kernel_ms=sum(t for t, _ in per_step.values()),
                       kernels_per_step=sum(c for _, c in per_step.values()),
                       categories={k: dict(ms=t, kernels=c) for k, (t, c) in sorted(per_step.items())},
                       top_kernels=[dict(name=k[:160], category=category(k), ms=t, kernels=c) for k, (t, c)
                                    in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP]])
            res["rows"].append(row)
            Path(args.out, "profile_decode.json").write_text(json.dumps(res, indent=1, default=str))
            print(f"== {method} bs{batch} {row['attention']} pdl={row['pdl']} lora_a_beside={row['lora_a_beside']}: {step_ms:.2f} ms per decode step (wall), {row['kernel_ms']:.2f} ms in "
                  f"{row['kernels_per_step']:.0f} kernels")
            for cat, d in sorted(row["categories"].items(), key=lambda kv: -kv[1]["ms"]):
                print(f"   {cat:14s} {d['ms']:8.3f} ms {d['kernels']:7.1f} kernels")
            for d in row["top_kernels"]:
                print(f"      {d['ms']:8.3f} ms {d['kernels']:6.1f} x  {d['name'][:100]}")
            del engine
            sc.free()
        del model
        sc.free()


if __name__ == "__main__":
    main()
