# ruff: noqa: B023  (the lambdas run within their loop iteration)
"""One GPU call that checks the decode + cuBLAS path and times its variants (issue 18 / 14).

Checks: decode bit-exact against qerl.formats.dequantize (7B shapes and odd ones, both formats,
bf16 and fp32), the scratch path and the plan path against the reference, deterministic split-K
(20 repeats bitwise equal). Times: decode TB/s per 7B shape and config; the 7B layer (sum of the
seven linears) forward and grad-input per M for the fused kernels, decode + cuBLAS with several
scratch chunk sizes with and without the side-stream overlap, and bf16 cuBLAS; deterministic vs atomic split-K at small M; host time of
eager calls. Prints a table; writes <out>/probe.json.

Run: python -m benchmarks.kernel_probe --out $OUT      (about 3 min on an H100)
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import n_copies, time_graph
from qerl import formats, kernels
from qerl.arch import LINEAR_NAMES as PROJECTIONS
from qerl.arch import linear_shapes
from qerl.kernels import fp4
from qerl.qlinear import QuantLinear

MB = 1 << 20


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def check(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    bad = []
    for fmt in formats.with_kernel("triton"):
        for n, k in [(18944, 3584), (3584, 18944), (512, 3584), (200, 352), (1000, 4128)]:
            w = torch.randn(n, k, device="cuda") * 0.02
            t = formats.quantize(w, fmt)
            args = (t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), fmt == "nvfp4")
            for dt in (torch.bfloat16, torch.float32):
                ref = formats.dequantize(t, fmt, dtype=dt)
                out = fp4.decode(*args, dtype=dt)
                iv = torch.int16 if dt == torch.bfloat16 else torch.int32
                if not torch.equal(out.view(iv), ref.view(iv)):
                    bad.append(("decode", fmt, n, k, str(dt), int((out.view(iv) != ref.view(iv)).sum())))
            wd = formats.dequantize(t, fmt, dtype=torch.float32)
            for m in (1, 8, 64, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                for chunk, ov in ((None, False), (4 * MB, False), (None, True), (4 * MB, True)):
                    fp4.SCRATCH_CHUNK_BYTES, fp4.SCRATCH_OVERLAP = chunk, ov
                    e1 = rel(fp4.launch_linear(x, *args, kind="scratch"), x.float() @ wd.T)
                    e2 = rel(fp4.launch_grad_input(dy, *args, kind="scratch"), dy.float() @ wd)
                    if not (e1 < 1e-2 and e2 < 1e-2):
                        bad.append(("scratch", fmt, n, k, m, chunk, ov, e1, e2))
                fp4.SCRATCH_CHUNK_BYTES, fp4.SCRATCH_OVERLAP = None, False
                plan = fp4.Plan(*args)
                y1 = plan.linear(x)
                e3 = rel(y1, x.float() @ wd.T)
                if not e3 < 1e-2:
                    bad.append(("plan", fmt, n, k, m, e3))
                if m <= 64:
                    ys = [plan.linear(x) for _ in range(20)]
                    if not all(torch.equal(ys[0], y) for y in ys):
                        bad.append(("nondeterministic", fmt, n, k, m))
    res["check_failures"] = [list(map(str, b)) for b in bad]
    print("CHECK", "OK" if not bad else f"FAILED {bad[:10]}", flush=True)


def decode_speed(res, l2):
    rows = []
    cfgs = [dict(BLOCK_N=16, NBK=8, num_warps=4), dict(BLOCK_N=32, NBK=8, num_warps=4),
            dict(BLOCK_N=32, NBK=16, num_warps=8), dict(BLOCK_N=64, NBK=8, num_warps=8),
            dict(BLOCK_N=8, NBK=16, num_warps=4), dict(BLOCK_N=16, NBK=16, num_warps=4),
            dict(BLOCK_N=4, NBK=32, num_warps=4)]
    # the int32 pair-store kernel (PAIRS) on the same tiles and a few wider ones
    cfgs = [dict(c, PAIRS=False) for c in cfgs] + [dict(c, PAIRS=True) for c in cfgs] + [
        dict(BLOCK_N=16, NBK=32, num_warps=8, PAIRS=True), dict(BLOCK_N=32, NBK=32, num_warps=8, PAIRS=True)]
    for fmt in formats.with_kernel("triton"):
        bpw = formats.bits_per_weight(fmt) / 8
        for n, k in [(18944, 3584), (3584, 18944), (3584, 3584)]:
            t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
            copies = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * bpw, l2))]
            out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
            for cfg in cfgs:
                fns = [lambda tt=tt, cfg=cfg: fp4.decode(tt["weight_packed"], tt["weight_scale"],
                                                         tt.get("weight_global_scale"), fmt == "nvfp4", out=out,
                                                         config=cfg) for tt in copies]
                try:
                    sec, _ = time_graph(fns)
                except Exception as e:  # noqa: BLE001
                    print("decode cfg failed", cfg, e)
                    continue
                tb = n * k * (bpw + 2) / sec / 1e12
                rows.append(dict(fmt=fmt, N=n, K=k, cfg=cfg, us=sec * 1e6, tbps=tb))
                print(f"decode {fmt} {n}x{k} {cfg} {sec * 1e6:8.1f} us {tb:5.2f} TB/s", flush=True)
    res["decode"] = rows


def layer_times(res, l2, fmts=("nvfp4",), ms=(64, 128, 256, 512, 1024, 2048), grad_ms=(16, 64, 256, 1024, 2048),
                chunks=(None, 32 * MB), overlap=(False, True)):
    shapes = linear_shapes("qwen2.5-7b")
    uniq = {}
    for p in PROJECTIONS:
        uniq.setdefault(shapes[p], []).append(p)
    tot = {}
    for (n, k), names in uniq.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wc = [w.clone() for _ in range(n_copies(n * k * 2, l2))]
        for fmt in fmts:
            bpw = formats.bits_per_weight(fmt) / 8
            t = formats.quantize(w.float(), fmt)
            qc = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * bpw, l2))]
            A = lambda tt: (tt["weight_packed"], tt["weight_scale"], tt.get("weight_global_scale"), fmt == "nvfp4")  # noqa: E731
            for op, mlist in (("linear", ms), ("grad", grad_ms)):
                for m in mlist:
                    x = torch.randn(m, k if op == "linear" else n, device="cuda", dtype=torch.bfloat16)
                    variants = {}
                    if op == "linear":
                        variants["fused"] = [lambda tt=tt, x=x: fp4.launch_linear(x, *A(tt), kind="dot") for tt in qc]
                        if fmt == fmts[0]:
                            variants["bf16"] = [lambda wi=wi, x=x: F.linear(x, wi) for wi in wc]
                    else:
                        variants["fused"] = [lambda tt=tt, x=x: fp4.launch_grad_input(x, *A(tt), kind="fused") for tt in qc]
                        if fmt == fmts[0]:
                            variants["bf16"] = [lambda wi=wi, x=x: torch.matmul(x, wi) for wi in wc]
                    for ch in chunks:
                        for ov in overlap:
                            if op == "linear":
                                f = [lambda tt=tt, x=x: fp4.launch_linear(x, *A(tt), kind="scratch") for tt in qc]
                            else:
                                f = [lambda tt=tt, x=x: fp4.launch_grad_input(x, *A(tt), kind="scratch") for tt in qc]
                            name = f"scratch{'' if ch is None else ch // MB}{'_overlap' if ov else ''}"
                            variants[name] = (ch, ov, f)
                    for name, fns in variants.items():
                        ch, ov = None, False
                        if isinstance(fns, tuple):
                            ch, ov, fns = fns
                        fp4.SCRATCH_CHUNK_BYTES, fp4.SCRATCH_OVERLAP = ch, ov
                        try:
                            sec, _ = time_graph(fns, target_s=0.08)
                        except Exception as e:  # noqa: BLE001
                            print("FAILED", op, fmt, m, name, type(e).__name__, str(e)[:200], flush=True)
                            sec = float("nan")
                        fp4.SCRATCH_CHUNK_BYTES, fp4.SCRATCH_OVERLAP = None, False
                        meth = name if name == "bf16" else f"{fmt}/{name}"
                        key = (op, meth, m)
                        tot[key] = tot.get(key, 0.0) + sec * len(names)
            del qc
        del wc
        torch.cuda.empty_cache()
        print(f"  layer shape {n}x{k} done", flush=True)
    out = []
    print(f"{'op':6s} {'M':>5s} {'method':22s} {'layer us':>10s} {'bf16/x':>7s}")
    for (op, meth, m), sec in sorted(tot.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        b = tot.get((op, "bf16", m))
        r = b / sec if b else None
        out.append(dict(op=op, method=meth, M=m, us=sec * 1e6, bf16_over=r))
        print(f"{op:6s} {m:5d} {meth:22s} {sec * 1e6:10.1f} {r if r is None else f'{r:7.3f}'}")
    res["layer"] = out


def splitk_cost(res, l2):
    shapes = linear_shapes("qwen2.5-7b")
    out = []
    for m in (1, 8, 16):
        tot = {True: 0.0, False: 0.0}
        for p in PROJECTIONS:
            n, k = shapes[p]
            t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
            qc = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * 0.5625, l2))]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for atomic in (False, True):
                fp4.SPLITK_ATOMIC = atomic
                fns = [lambda tt=tt: kernels.linear(x, "nvfp4", tt, n, k, backend="triton") for tt in qc]
                tot[atomic] += time_graph(fns, target_s=0.05)[0]
            fp4.SPLITK_ATOMIC = False
        out.append(dict(M=m, deterministic_us=tot[False] * 1e6, atomic_us=tot[True] * 1e6))
        print(f"splitk M={m}: deterministic {tot[False] * 1e6:.1f} us, atomic {tot[True] * 1e6:.1f} us (7B layer)")
    res["splitk"] = out

# Linear shapes of other families than the paper's Qwen2.5 (checked for generality, issue 14).
OTHER_SHAPES = {"llama-3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
                "phi-3-mini": [(9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]}


def split_sweep(res, l2, ms=(1, 8, 16, 32, 64), splits=(1, 2, 4, 8, 16, 32, 64)):
    """Fused-kernel time per split-K count (default kind and tiles), per shape and M, against the
    split the heuristic picks: the data behind the split rule (fp4._split)."""
    shapes = sorted(set(linear_shapes("qwen2.5-7b").values())) + [s for v in OTHER_SHAPES.values() for s in v]
    out = []
    for n, k in shapes:
        t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
        wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)
        qc = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * 0.5625, l2))]
        args = lambda tt: (tt["weight_packed"], tt["weight_scale"], tt["weight_global_scale"], True)  # noqa: E731
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.T
            launch = fp4._linear_launch(m, n, k, True, x.device, None, None, None, True)
            row = dict(N=n, K=k, M=m, kind=launch[0], auto_split=launch[1][1], us={})
            for sp in (None, *splits):
                try:
                    out_t = fp4.launch_linear(x, *args(qc[0]), split_k=sp)
                    err = rel(out_t, ref)
                    if err > 2e-2:
                        print(f"split {sp} N={n} K={k} M={m}: rel err {err:.2e}")
                        continue
                    fns = [lambda tt=tt, sp=sp: fp4.launch_linear(x, *args(tt), split_k=sp) for tt in qc]
                    row["us"]["auto" if sp is None else sp] = time_graph(fns, target_s=0.03)[0] * 1e6
                except Exception as e:  # noqa: BLE001 - record and go on
                    print(f"split {sp} N={n} K={k} M={m} failed: {type(e).__name__}: {str(e)[:200]}")
            best = min((v, s) for s, v in row["us"].items() if s != "auto") if len(row["us"]) > 1 else (None, None)
            row["best_split"], row["best_us"] = best[1], best[0]
            print(f"split N={n:6d} K={k:6d} M={m:3d} {row['kind']:4s} auto={row['auto_split']:3d} "
                  f"{row['us'].get('auto', float('nan')):7.1f} us; best {best[1]} {best[0] or float('nan'):.1f} us; "
                  + " ".join(f"{s}:{v:.1f}" for s, v in row["us"].items() if s != "auto"), flush=True)
            out.append(row)
        del qc
    res["split_sweep"] = out


def eager_calls(res):
    n, k, calls = 1024, 4096, 1000
    q = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), "nvfp4")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    t = q.packed_tensors()
    plan = fp4.Plan(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], True)
    fns = {"bf16": lambda: F.linear(x, w), "nvfp4": lambda: q(x),
           "nvfp4_dispatch": lambda: kernels.linear(x, "nvfp4", t, n, k, backend="triton"),
           "nvfp4_plan": lambda: plan.linear(x),
           # floor: the allocation every call makes (the launch split: benchmarks/launch_probe.py)
           "torch_empty": lambda: torch.empty((1, n), dtype=x.dtype, device=x.device)}
    ref = F.linear(x, q.dequantized_weight())
    out = {}
    for rep in range(3):
        for name, f in fns.items():
            try:
                for _ in range(50):
                    f()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                dt = (time.perf_counter() - t0) / calls * 1e6
                torch.cuda.synchronize()
                if rep == 0 and name != "bf16":
                    print(f"eager {name}: rel err {rel(f(), ref):.2e}")
            except Exception as e:  # noqa: BLE001
                print("eager", name, "FAILED", type(e).__name__, str(e)[:300])
                dt = float("nan")
            out[name] = dt if rep == 0 else min(out[name], dt)
    for name, v in out.items():
        print(f"eager {name:16s} {v:7.2f} us/call")
    res["eager_call_us"] = out
    # the GPU time of the same calls (graph replays): a back-to-back loop is host-bound only if this is smaller
    gpu = {name: time_graph([fns[name]], target_s=0.05)[0] * 1e6 for name in ("bf16", "nvfp4_plan")}
    print("gpu time per call (us):", {k: round(v, 2) for k, v in gpu.items()})
    res["eager_gpu_us"] = gpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    res = dict(gpu=props.name, git_sha=os.environ.get("QERL_GIT_SHA"), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               command="python -m benchmarks.kernel_probe " + " ".join(sys.argv[1:]))
    t0 = time.time()
    def mx(r):
        sub = {}
        layer_times(sub, l2, fmts=("mxfp4",), ms=(64, 128, 256), grad_ms=(16, 64), chunks=(None,), overlap=(False,))
        r["layer_mxfp4"] = sub["layer"]

    steps = [("eager", eager_calls), ("check", check), ("layer", lambda r: layer_times(r, l2)),
             ("decode", lambda r: decode_speed(r, l2)), ("splitk", lambda r: splitk_cost(r, l2)),
             ("layer_mxfp4", mx), ("split_sweep", lambda r: split_sweep(r, l2))]
    run_steps(steps, res, os.path.join(a.out, "probe.json"), a.only, a.skip, t0)


def run_steps(steps, res, path, only=None, skip=(), t0=None):
    """Run the named probe steps in order (``only`` / ``skip`` select), recording a failing step's
    error instead of stopping, and rewrite ``path`` after each step (a cut call keeps what it had)."""
    t0 = time.time() if t0 is None else t0
    for name, fn in steps:
        if name in skip or (only is not None and name not in only):
            continue
        try:
            fn(res)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = repr(e)
        print(f"[{name} done at {time.time() - t0:.0f} s]", flush=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
