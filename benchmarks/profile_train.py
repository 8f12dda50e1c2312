"""Where the training phases' time goes, 4-bit vs bf16 LoRA (issue 18): one micro-batch through
the trainer's step (qerl.step.step on a given rollout: its old-log-prob and update phases, as Table 3
runs them) on a random-weight model cut to a few decoder layers, timed (median of --reps) and profiled (CUDA time by kernel).

    python -m benchmarks.profile_train --out $OUT     # Qwen2.5-7B shapes, 4 layers, 256 + 2048 tokens

Prints, per method: the phase times and the top kernels by CUDA time; writes <out>/profile_train.json
(the numbers) and <out>/profile_train_<method>.txt (the profiler tables). A GPU tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from experiments.table3_speed_memory import bench_config, grpo_step, synthetic_rollout
from qerl.models import model_config
from qerl.policy import make_optimizer
from qerl.quantize import lora_parameters


def train_phases(cfg, model, ro, adv, opt, sched, timer) -> None:
    """The step's old-log-prob and update phases on the given rollout (no rollout)."""
    grpo_step(cfg, model, None, opt, sched, None, adv, False, timer, ro=ro)
    opt.zero_grad(set_to_none=True)
    model.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=list(sc.MODELS))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers kept (the rest is per layer anyway)")
    ap.add_argument("--methods", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--learning-rate", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grad-ckpt", choices=["on", "off"], default="on")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    config = model_config(sc.MODELS[args.model])
    config.num_hidden_layers = args.layers
    vocab = sc.vocab_size(args.model)
    res = dict(provenance=sc.provenance(), settings=vars(args), methods={})
    for method in args.methods:
        model = sc.build(args.model, method, args.lora_rank, device, seed=args.seed, config=config)
        cfg = bench_config(method, args, max(2, args.micro_batch), args.micro_batch, args.completion, device)
        opt, sched = make_optimizer(cfg, lora_parameters(model), total_updates=args.reps + 2)
        if args.grad_ckpt == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ro = synthetic_rollout(args.micro_batch, args.prompt, args.completion, vocab, device, seed=1)
        adv = torch.randn(args.micro_batch)
        run = (cfg, model, ro, adv, opt, sched)
        for _ in range(2):  # warm-up: compile, autotune, allocate
            train_phases(*run, sc.PhaseTimer())
        times = {"logprob": [], "update": []}
        for _ in range(args.reps):
            ph = sc.PhaseTimer()
            train_phases(*run, ph)
            for k in times:
                times[k].append(ph.seconds[k])
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            train_phases(*run, sc.PhaseTimer())
            sc.sync()
        ka = prof.key_averages()
        sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        table = ka.table(sort_by=sort, row_limit=30)
        Path(args.out, f"profile_train_{method}.txt").write_text(table)
        kern = sorted(((e.key, getattr(e, sort), e.count) for e in ka), key=lambda t: -t[1])
        top = [dict(name=k[:90], ms=t / 1e3, count=c) for k, t, c in kern[:25]]
        res["methods"][method] = dict(ms=med, top=top)
        print(f"== {method}: old log-probs {med['logprob']:.1f} ms, update {med['update']:.1f} ms "
              f"({args.layers} layers, {args.micro_batch} x {args.prompt + args.completion} tokens)")
        for row in top[:18]:
            print(f"   {row['ms']:9.2f} ms {row['count']:6d}  {row['name']}")
        del model, opt, sched, ro, run
        sc.free()
    Path(args.out, "profile_train.json").write_text(json.dumps(res, indent=1, default=str))
    print(time.strftime("%H:%M:%S"), "wrote", Path(args.out, "profile_train.json"))


if __name__ == "__main__":
    main()
