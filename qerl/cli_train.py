"""`python -m qerl train` and `python -m qerl eval`: flags are TrainConfig's field names.

    python -m qerl train --profile smoke --output-dir runs/smoke
    python -m qerl train --profile small --method nvfp4_lora_aqn --seed 1 --output-dir runs/aqn-s1
    python -m qerl eval --model smollm2-135m-instruct --method nvfp4_lora --adapter runs/x/checkpoints/step-60 \
        --datasets gsm8k arith --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from qerl.config import PROFILES, TrainConfig, make_config, method_name, methods, table_bases


def _field_type(f: dataclasses.Field):
    t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing), {})  # noqa: S307 - our own annotations
    return t


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="small", choices=tuple(PROFILES), help="base settings; flags override")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "profile":
            continue
        flag = "--" + f.name.replace("_", "-")
        t = hints[f.name]
        origin = typing.get_origin(t)
        if t is bool:
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None, metavar="BOOL")
        elif origin is tuple:
            inner = typing.get_args(t)[0]
            p.add_argument(flag, type=inner, nargs="+", default=None)
        elif t in (int, float, str):
            kw = {"choices": methods()} if f.name == "method" else {}
            p.add_argument(flag, type=t, default=None, **kw)
        else:  # Optional[str] and friends
            p.add_argument(flag, type=str, default=None)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"profile"}
    return make_config(args.profile, **{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})


def run_train(args: argparse.Namespace) -> int:
    from qerl.train import train

    summary = train(config_from_args(args))
    print(json.dumps(summary, default=str))
    return 0 if summary.get("status") == "ok" else 1


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local folder, .gguf, or the embedded default")
    p.add_argument("--method", default="bf16_lora", choices=methods() + table_bases(),
                   help="base format (a method name, or a bare format for the untrained rows)")
    p.add_argument("--adapter", default=None, help="a qerl checkpoint folder (trainable.safetensors) to load")
    p.add_argument("--datasets", nargs="+", default=["gsm8k"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--limit", type=int, default=0, help="problems per dataset (0 = all)")
    p.add_argument("--samples", type=int, default=1, help="n samples per problem; pass@1 is their mean accuracy")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--engine", default="auto", choices=("auto", "fast", "hf"),
                   help="rollout engine: fast (static cache + CUDA graphs; Llama/Qwen) or hf (reference)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arith-levels", type=int, nargs="+", default=None, help="levels of the built-in arith set")
    p.add_argument("--out", default=None, help="write results JSON here")


def run_eval(args: argparse.Namespace) -> int:
    from qerl.evaluate import evaluate_datasets, write_results
    from qerl.logging import environment
    from qerl.train import build_policy, load_trainable

    method = args.method
    bare = method in table_bases()
    cfg = TrainConfig(model=args.model, method=method_name(method) if bare else method,
                      lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    model, tok, _, info = build_policy(cfg, lora=not bare)
    if args.adapter:
        load_trainable(args.adapter, model)
    res = evaluate_datasets(model, tok, args.datasets, limit=args.limit, data_dir=args.data_dir, seed=args.seed,
                            samples=args.samples, temperature=args.temperature, top_p=args.top_p, greedy=args.greedy,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            arith_levels=args.arith_levels, engine=args.engine)
    for d, r in res.items():
        print(f"{d}: accuracy {r['accuracy']:.4f} over {r['num_problems']} problems x {r['samples']} samples")
    if args.out:
        write_results(res, args.out, {"args": vars(args), "policy": info, "provenance": environment()})
    print(json.dumps(res))
    return 0
