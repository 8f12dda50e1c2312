"""The decode step's LoRA kernels (qerl.kernels.fused lora_a / lora_out / lora_silu_mul) at a model's
shapes: the rule's time at each batch, and with --sweep every launch config, each checked against an
fp64 reference before it is timed. GPU.

A layer's four LoRA groups as the fused decode step runs them (q/k/v with their biases, o, gate/up with
SiLU * up, down), rank 32, over all layers of the model with distinct adapters per layer (so that the
A / B weights come from memory, as in a decode step; the activations are one layer's, as hot in L2 as
the step leaves them). Times: CUDA-graph replay of the whole model's launches of one op, per launch.

    python -m benchmarks.bench_lora --out $OUT/lora                     # Qwen2.5-7B, M 16 32 64 128 256
    python -m benchmarks.bench_lora --sweep --out $OUT/lora             # + every config (a few minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from benchmarks.bench_kernels import time_graph
from qerl import kernels
from qerl.models import model_config

LORA_A_SWEEP = dict(BLOCK_M=(16, 32, 64), BLOCK_K=(64, 128), programs=(64, 128, 256), num_warps=(4, 8), num_stages=(2, 3))
LORA_OUT_SWEEP = dict(BLOCK_N=(32, 64), ROWS=(16, 32, 64), num_warps=(4,))


def groups(cfg, rank: int, layers: int, device) -> list[dict]:
    """Per LoRA group: K, the output widths, and per layer the A's, B's and biases."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (H // cfg.num_attention_heads)
    spec = [("qkv", H, [H, kv, kv], True), ("o", H, [H], False), ("gate_up", H, [inter, inter], False),
            ("down", inter, [H], False)]
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, K, Ns, bias in spec:
        per_layer = []
        for _ in range(layers):
            As = [torch.randn(rank, K, device=device, generator=g) / K ** 0.5 for _ in Ns]
            Bs = [torch.randn(N, rank, device=device, generator=g) / rank ** 0.5 for N in Ns]
            bs = [torch.randn(N, device=device, generator=g).to(torch.bfloat16) for N in Ns] if bias else []
            per_layer.append((As, Bs, bs))
        out.append(dict(name=name, K=K, Ns=Ns, layers=per_layer))
    return out


def check_a(h, x, As) -> bool:
    ref = torch.cat([(x.double() @ a.double().t()) for a in As], 1)
    return bool(torch.allclose(h.sum(0).double(), ref, rtol=1e-4, atol=1e-4))


def check_out(ys_after, ys_before, h, Bs, bs, scaling, silu_out=None) -> bool:
    hh = h.sum(0).double()
    R = Bs[0].shape[1]
    want = [(y.double() + (bs[i].double() if bs else 0) + scaling * (hh[:, i * R:(i + 1) * R] @ Bs[i].double().t()))
            for i, y in enumerate(ys_before)]
    if silu_out is not None:
        g, u = (w.to(torch.bfloat16).double() for w in want)
        return bool(torch.allclose(silu_out.double(), torch.nn.functional.silu(g) * u, rtol=2e-2, atol=2e-2))
    return all(torch.allclose(y.double(), w, rtol=1e-2, atol=2e-2) for y, w in zip(ys_after, want))


def graph_us(fn, calls: int) -> float:
    """Median us a launch of ``fn`` (``calls`` launches), from CUDA-graph replays (bench_kernels.time_graph)."""
    return time_graph([fn], min_reps=1)[0] * 1e6 / calls


def time_group(M: int, g: dict, args, rows: list, summary: dict, scaling: float = 2.0) -> None:
    """The rule's (and with --sweep every config's) us a launch of lora_a and lora_out for group g at M rows."""
    device = torch.device("cuda")
    x = torch.randn(M, g["K"], device=device, dtype=torch.bfloat16)
    ys = [torch.randn(M, N, device=device, dtype=torch.bfloat16) for N in g["Ns"]]
    silu = g["name"] == "gate_up"
    layers = g["layers"]
    hs = [kernels.lora_a(x, As) for As, _, _ in layers]

    def a_fn(conf=None):
        for As, _, _ in layers:
            kernels.lora_a(x, As) if conf is None else kernels.lora_a_tuned(x, As, conf)

    def out_fn(conf=None):
        for (_, Bs, bs), h in zip(layers, hs):
            kernels.lora_out_tuned(ys, h, Bs, bs, scaling, out=torch.empty_like(ys[0]) if silu else None,
                                   config=conf)

    base = dict(model=args.model, M=M, group=g["name"], K=g["K"], Ns=g["Ns"], rank=args.rank)
    rule_a, rule_out = graph_us(a_fn, len(layers)), graph_us(out_fn, len(layers))
    rows.append(dict(base, op="lora_a", config="rule", us=rule_a,
                     rule_config=kernels.lora_a_config(M, g["K"], len(g["Ns"]), x.device, args.rank)))
    rows.append(dict(base, op="lora_out", config="rule", us=rule_out))
    summary[f"{args.model}/M{M}/{g['name']}/lora_a_us"] = rule_a
    summary[f"{args.model}/M{M}/{g['name']}/lora_out_us"] = rule_out
    if not args.sweep:
        return
    As, Bs, bs = layers[0]
    for vals in itertools.product(*LORA_A_SWEEP.values()):
        c = dict(zip(LORA_A_SWEEP, vals))
        conf = dict(kernels.lora_a_config(M, g["K"], len(As), x.device, args.rank, BLOCK_M=c["BLOCK_M"],
                                          BLOCK_K=c["BLOCK_K"], programs=c["programs"]),
                    num_warps=c["num_warps"], num_stages=c["num_stages"])
        ok = check_a(kernels.lora_a_tuned(x, As, conf), x, As)
        rows.append(dict(base, op="lora_a", config=dict(c, K_CHUNK=conf["K_CHUNK"]), ok=ok,
                         us=graph_us(lambda conf=conf: a_fn(conf), len(layers)) if ok else None))
    for vals in itertools.product(*LORA_OUT_SWEEP.values()):
        conf = dict(zip(LORA_OUT_SWEEP, vals))
        before = [y.clone() for y in ys]
        h = kernels.lora_a(x, As)
        o = torch.empty_like(ys[0]) if silu else None
        kernels.lora_out_tuned(ys, h, Bs, bs, scaling, out=o, config=conf)
        ok = check_out(ys, before, h, Bs, bs, scaling, silu_out=o)
        for y, b in zip(ys, before):
            y.copy_(b)
        rows.append(dict(base, op="lora_out", config=conf, ok=ok,
                         us=graph_us(lambda conf=conf: out_fn(conf), len(layers)) if ok else None))


def run(args) -> dict:
    device = torch.device("cuda")
    cfg = model_config(sc.MODELS[args.model])
    layers = args.layers or cfg.num_hidden_layers
    gs = groups(cfg, args.rank, layers, device)
    rows, summary = [], {}
    for M in args.batch:
        for g in gs:
            time_group(M, g, args, rows, summary)
            print(json.dumps({k: v for k, v in summary.items() if f"/M{M}/{g['name']}/" in k}), flush=True)
    for M in args.batch:  # a decode step's LoRA kernels: every group's two launches, all layers
        summary[f"{args.model}/M{M}/step_lora_ms"] = layers * sum(
            summary[f"{args.model}/M{M}/{g['name']}/{op}_us"] for g in gs for op in ("lora_a", "lora_out")) / 1e3
    return dict(provenance=sc.provenance(args.git_sha), settings=dict(model=args.model, rank=args.rank, layers=layers,
                                                                      batch=args.batch, sweep=args.sweep),
                summary=summary, rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b", choices=sorted(sc.MODELS))
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="layers of adapters to rotate through (default: the model's)")
    ap.add_argument("--sweep", action="store_true", help="also time every launch config of the tiled kernels")
    sc.add_run_args(ap, "results/decode_profile/lora")
    args = ap.parse_args(argv)
    if args.merge:
        raise SystemExit("bench_lora writes one file a run; nothing to merge")
    result = sc.main_run_or_merge(args, run, None, "bench_lora")
    path = Path(args.out) / f"{sc.gpu_tag()}_lora{'_sweep' if args.sweep else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
