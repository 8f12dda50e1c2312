# ruff: noqa: B023  (the lambdas run within their loop iteration)
"""GPU probe of the compute-layout tensor-core kernel (qerl.kernels.fp4_mma, issue 14).

Checks: compute layout round trip (bit for bit) and the kernel against the fp32 reference on the
Qwen2.5-7B shapes, other families' shapes and ragged ones (N % 16, K % 64 != 0), M = 1-300 (mma.sync
up to 32, the warpgroup-MMA variant above on sm_90), NVFP4 and MXFP4; repeated calls bitwise equal.
Times: the 7B layer (sum of the seven linears) per M for bf16 cuBLAS, qerl's Triton kernels and
fp4_mma (default rule; the mma.sync variant alone up to M = 64), and a config sweep per shape.

    python -m benchmarks.mma_probe --out $OUT        (writes <out>/mma_probe.json)
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import n_copies, time_graph
from benchmarks.kernel_probe import OTHER_SHAPES, rel, run_steps
from qerl import formats
from qerl.arch import LINEAR_NAMES as PROJECTIONS
from qerl.arch import linear_shapes
from qerl.kernels import fp4, fp4_mma

MS = (1, 2, 4, 8, 16, 32, 48, 64, 100, 128, 256, 300)
LAYER_MS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


def check(res):
    bad, n_ok = [], 0
    shapes = sorted(set(linear_shapes("qwen2.5-7b").values())) + OTHER_SHAPES["llama-3-8b"] + [(200, 352), (1000, 4128)]
    for fmt in formats.with_kernel("triton"):
        nv = fmt == "nvfp4"
        for n, k in shapes:
            t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
            p, s, gs = t["weight_packed"], t["weight_scale"], t.get("weight_global_scale")
            why = fp4_mma.compute_layout_ok(p, s, nv)
            if why:
                bad.append(("layout_ok", fmt, n, k, why))
                continue
            pc, sc = fp4_mma.to_compute_layout(p, s, nv)
            p2, s2 = fp4_mma.from_compute_layout(pc, sc, n, k, nv)
            if not (torch.equal(p2, p) and torch.equal(s2, s.view(torch.uint8))):
                bad.append(("roundtrip", fmt, n, k))
            wd = formats.dequantize(t, fmt, dtype=torch.float32)
            for m in MS:
                if m > fp4_mma.MAX_M and not fp4_mma.has_wgmma(torch.device("cuda")):
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ wd.T
                try:
                    y = fp4_mma.linear(x, pc, sc, gs, n, k, nv)
                    e = rel(y, ref)
                    y2 = fp4_mma.linear(x, pc, sc, gs, n, k, nv)
                    if e > 1e-2 or not torch.equal(y, y2):
                        bad.append(("linear", fmt, n, k, m, e, bool(torch.equal(y, y2))))
                    else:
                        n_ok += 1
                except Exception as ex:  # noqa: BLE001
                    bad.append(("linear", fmt, n, k, m, f"{type(ex).__name__}: {str(ex)[:300]}"))
    # q/k/v of the 7B layer and gate/up as one launch (both formats)
    for fmt in formats.with_kernel("triton"):
        nv = fmt == "nvfp4"
        for group in ([(3584, 3584), (512, 3584), (512, 3584)], [(18944, 3584), (18944, 3584)], [(200, 352), (48, 352)]):
            k = group[0][1]
            ts = [formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt) for n, _ in group]
            ws = [(*fp4_mma.to_compute_layout(t["weight_packed"], t["weight_scale"], nv), t.get("weight_global_scale"), n)
                  for t, (n, _) in zip(ts, group)]
            for m in (1, 8, 16, 32) + ((64, 200) if fp4_mma.has_wgmma(torch.device("cuda")) else ()):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ys = fp4_mma.grouped_linear(x, ws, k, nv)
                ys2 = fp4_mma.grouped_linear(x, ws, k, nv)
                for t, y, y2 in zip(ts, ys, ys2):
                    e = rel(y, x.float() @ formats.dequantize(t, fmt, dtype=torch.float32).T)
                    if e > 1e-2 or not torch.equal(y, y2):
                        bad.append(("grouped", fmt, tuple(group), m, e))
                    else:
                        n_ok += 1
    res["check_bad"], res["check_ok"] = bad, n_ok
    print(f"check: {n_ok} ok, {len(bad)} bad", bad[:10], flush=True)


def _weight_copies(n, k, l2, bf16=False):
    """A random NVFP4 weight [n, k]: (tensors, copies of them, their compute layouts, global scale, bf16
    copies or []), as many copies as keep the timed calls out of L2 (n_copies)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    t = formats.quantize(w, "nvfp4")
    qc = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * 0.5625, l2))]
    cl = [fp4_mma.to_compute_layout(tt["weight_packed"], tt["weight_scale"], True) for tt in qc]
    wc = [w.bfloat16() for _ in range(n_copies(n * k * 2, l2))] if bf16 else []
    return t, qc, cl, t["weight_global_scale"], wc


def _time_config(x, cl, gs, n, k, cfg, split, what):
    """us of one fp4_mma config / split over the weight copies cl, or None (printed) if it fails."""
    try:
        f = [lambda c=c: fp4_mma.linear(x, c[0], c[1], gs, n, k, True, config=cfg, split_k=split) for c in cl]
        return time_graph(f, target_s=0.02)[0] * 1e6
    except Exception as e:  # noqa: BLE001
        print(what, "fail", n, k, x.shape[0], cfg, split, type(e).__name__, str(e)[:200])
        return None


def layer(res, l2, model="qwen2.5-7b", ms=LAYER_MS):
    shapes = linear_shapes(model)
    tot = {}
    for p in PROJECTIONS:
        n, k = shapes[p]
        t, qc, cl, gs, wc = _weight_copies(n, k, l2, bf16=True)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = {"bf16": [lambda wi=wi: F.linear(x, wi) for wi in wc],
                   "nvfp4": [lambda tt=tt: fp4.launch_linear(x, tt["weight_packed"], tt["weight_scale"],
                                                             tt["weight_global_scale"], True) for tt in qc],
                   "mma": [lambda c=c: fp4_mma.linear(x, c[0], c[1], gs, n, k, True) for c in cl]}
            if m <= fp4_mma.MAX_M:  # the mma.sync variant alone
                fns["mma_sync"] = [lambda c=c: fp4_mma.linear(x, c[0], c[1], gs, n, k, True,
                                                              config=fp4_mma.pick_config(m, n, k)) for c in cl]
            for name, f in fns.items():
                sec = time_graph(f, target_s=0.03)[0]
                tot[(name, m)] = tot.get((name, m), 0.0) + sec * 1e6
        del qc, cl, wc
    out = {}
    for m in ms:
        b, q, mm, ms_ = tot[("bf16", m)], tot[("nvfp4", m)], tot[("mma", m)], tot.get(("mma_sync", m))
        out[m] = dict(bf16_us=b, nvfp4_us=q, mma_us=mm, mma_sync_us=ms_, nvfp4_over_bf16=b / q,
                      mma_over_bf16=b / mm,
                      hbm_tbps_mma=sum(n * k * 0.5625 for n, k in shapes.values()) / (mm * 1e-6) / 1e12)
        print(f"{model} layer M={m:3d}: bf16 {b:7.1f} us, nvfp4 now {q:7.1f} ({b / q:.2f}x), mma {mm:7.1f} "
              f"({b / mm:.2f}x, {out[m]['hbm_tbps_mma']:.2f} TB/s), mma.sync alone {ms_ or float('nan'):7.1f}", flush=True)
    res.setdefault("layer", {})[model] = out


def sweep(res, l2):
    rows = []
    shapes = sorted(set(linear_shapes("qwen2.5-7b").values())) + OTHER_SHAPES["llama-3-8b"]
    cands = {1: [(8, 4, 1), (8, 8, 1), (8, 2, 1), (8, 4, 2)], 8: [(8, 4, 1), (8, 8, 1), (8, 2, 1), (8, 4, 2)],
             16: [(16, 2, 1), (16, 4, 1), (16, 1, 1), (16, 2, 2)], 32: [(32, 1, 1), (32, 2, 1)],
             64: [(64, 1, 1), (64, 1, 2)]}
    for n, k in shapes:
        t, qc, cl, gs, _ = _weight_copies(n, k, l2)
        for m, cc in cands.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for bm, kb, reps in cc:
                for split in (None, 1, 2, 4, 8, 16, 32):
                    cfg = dict(BM=bm, KB=kb, REPS=reps, num_warps=4)
                    us = _time_config(x, cl, gs, n, k, cfg, split, "sweep")
                    if us is None:
                        continue
                    rows.append(dict(N=n, K=k, M=m, BM=bm, KB=kb, REPS=reps, split=split, us=us))
            best = min((r for r in rows if r["N"] == n and r["K"] == k and r["M"] == m), key=lambda r: r["us"])
            auto = [r["us"] for r in rows if r["N"] == n and r["K"] == k and r["M"] == m and r["split"] is None
                    and (r["BM"], r["KB"], r["REPS"]) == cc[0]]
            print(f"sweep N={n:6d} K={k:6d} M={m:3d}: rule {auto[0] if auto else float('nan'):7.1f} us; best {best['us']:7.1f} "
                  f"BM={best['BM']} KB={best['KB']} REPS={best['REPS']} split={best['split']}", flush=True)
        del qc, cl
    res["sweep"] = rows


def _v(BM, REPS=1, STAGES=4, WGMMA=True, W_RING=True, PREFETCH=False, KB=1, num_warps=4, maxnreg=None, **extra):
    return dict(BM=BM, KB=KB, REPS=REPS, STAGES=STAGES, WGMMA=WGMMA, W_RING=W_RING, PREFETCH=PREFETCH,
                num_warps=num_warps, maxnreg=maxnreg, **extra)


_W = [_v(64), _v(64, maxnreg=96), _v(64, maxnreg=80, STAGES=3), _v(64, KB=2, STAGES=3), _v(64, KB=2, STAGES=2)]
_S16 = dict(KB=2, REPS=2, STAGES=2, WGMMA=False, W_RING=False)
_S8 = dict(KB=4, STAGES=2, WGMMA=False, W_RING=False)
_R8 = dict(WGMMA=False, W_RING=True)
_N8 = dict(STAGES=2, WGMMA=False, W_RING=False)
# BM = 8 (M <= 8, or M = 16 / 32 as 2 / 4 row tiles of x): register loads (_N8) and the ring (_R8) at
# 1-8 warps a program, KB 1-8 (registers at KB 4: 61 a thread; REPS 2 doubles them: compile_check_sm90)
_SMALL = [_v(8, **_S8), _v(8, KB=4, STAGES=3, **_R8), _v(8, KB=4, STAGES=4, **_R8), _v(8, KB=2, STAGES=4, **_R8),
          _v(8, KB=2, STAGES=6, **_R8), _v(8, KB=1, STAGES=8, **_R8), _v(8, KB=4, num_warps=8, **_N8),
          _v(8, KB=4, num_warps=2, **_N8), _v(8, KB=2, STAGES=4, num_warps=2, **_R8),
          _v(8, KB=4, STAGES=4, num_warps=1, **_R8), _v(8, KB=8, **_N8), _v(8, KB=2, **_N8)]
VARIANTS = {  # kernel configs per M (wgmma ones on sm_90 only): the rule's first, then what else was measured
    1: _SMALL,
    8: _SMALL,
    16: [_v(16, **_S16), _v(16, KB=2, REPS=1, **_N8), _v(16, KB=2, REPS=1, STAGES=4, **_R8),
         _v(16, KB=1, REPS=1, STAGES=6, **_R8), _v(8, **_S8), _v(8, KB=2, STAGES=4, **_R8),
         _v(8, KB=4, STAGES=4, **_R8), _v(16, maxnreg=80, **_S16)],
    32: [_v(32, REPS=2, WGMMA=False), _v(16, **_S16), _v(16, KB=2, REPS=1, STAGES=4, **_R8), _v(8, **_S8),
         _v(8, KB=2, STAGES=4, **_R8)],
    64: _W, 128: _W, 256: _W,
}


def variants(res, l2, model="qwen2.5-7b"):
    """The 7B layer (sum of the seven linears) per M for each kernel variant in VARIANTS (wgmma ones
    on sm_90 only), next to bf16 cuBLAS: which variant the rule should pick."""
    shapes = linear_shapes(model)
    wg = fp4_mma.has_wgmma(torch.device("cuda"))
    tot, bad, per = {}, [], {}
    for p in PROJECTIONS:
        n, k = shapes[p]
        t, qc, cl, gs, wc = _weight_copies(n, k, l2, bf16=True)
        only = os.environ.get("QERL_PROBE_MS")  # e.g. "1,8,16": those M of VARIANTS only
        for m, cands in VARIANTS.items():
            if only and str(m) not in only.split(","):
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = {"bf16": [lambda wi=wi: F.linear(x, wi) for wi in wc]}
            ref = None
            for cfg in cands:
                if cfg["WGMMA"] and not wg:
                    continue
                try:  # each variant checked against the fp32 reference on this shape first
                    if ref is None:
                        ref = x.float() @ formats.dequantize(t, "nvfp4", dtype=torch.float32).T
                    e = rel(fp4_mma.linear(x, cl[0][0], cl[0][1], gs, n, k, True, config=cfg), ref)
                    if not e < 1e-2:
                        bad.append((n, k, m, str(cfg), e))
                except Exception as ex:  # noqa: BLE001
                    bad.append((n, k, m, str(cfg), f"{type(ex).__name__}: {str(ex)[:200]}"))
                fns[str({k: v for k, v in cfg.items() if v is not None})] = [lambda c=c, cfg=cfg: fp4_mma.linear(x, c[0], c[1], gs, n, k, True, config=cfg) for c in cl]
            for name, f in fns.items():
                try:
                    sec = time_graph(f, target_s=0.02)[0]
                except Exception as e:  # noqa: BLE001
                    print("variant fail", m, name, type(e).__name__, str(e)[:300], flush=True)
                    sec = float("nan")
                tot[(m, name)] = tot.get((m, name), 0.0) + sec * 1e6
                per[(m, name, p)] = sec * 1e6
        del qc, cl, wc
    out = {}
    for (m, name), us in tot.items():
        out.setdefault(str(m), {})[name] = us
    for m, d in out.items():
        b = d["bf16"]
        print(f"M={m}: bf16 {b:.1f} us; " + "; ".join(f"{k} {v:.1f} ({b / v:.2f}x)" for k, v in d.items() if k != "bf16"),
              flush=True)
    res["variants"] = out
    res["variants_bad"] = bad
    res["variants_per_proj"] = [dict(M=m, variant=name, proj=p, us=us) for (m, name, p), us in per.items()]
    print(f"variants: {len(bad)} wrong", bad[:5], flush=True)


def _split_sweep(l2, ms, splits, wgmma, label):
    """The rule's config of each M at each split (None: the rule's split) on the 7B and Llama-3-8B shapes;
    prints the rule, split 1 and the best per shape and M; returns the rows."""
    rows = []
    shapes = sorted(set(linear_shapes("qwen2.5-7b").values())) + OTHER_SHAPES["llama-3-8b"]
    for n, k in shapes:
        t, qc, cl, gs, _ = _weight_copies(n, k, l2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = fp4_mma.pick_config(m, n, k, wgmma=wgmma)
            for split in splits:
                us = _time_config(x, cl, gs, n, k, cfg, split, label)
                if us is not None:
                    rows.append(dict(N=n, K=k, M=m, split=split, us=us))
            sel = [r for r in rows if r["N"] == n and r["K"] == k and r["M"] == m]
            if sel:
                best = min(sel, key=lambda r: r["us"])
                at = {r["split"]: r["us"] for r in sel}
                print(f"{label} N={n:6d} K={k:6d} M={m:3d}: rule {at.get(None, float('nan')):6.1f} us, split 1 "
                      f"{at.get(1, float('nan')):6.1f}; best {best['us']:6.1f} split={best['split']}", flush=True)
        del qc, cl
    return rows


def sweep_wgmma(res, l2):
    """The warpgroup-MMA variant's rule config at splits 1-8 against the rule's split."""
    res["sweep_wgmma"] = _split_sweep(l2, (64, 128, 256), (None, 1, 2, 4, 8), True, "wgmma split")


def sweep_tiles(res, l2):
    """Split-K at M = 1 / 8 (the rule's config), and at M = 64-256 the warpgroup variant with 128 weight
    rows a program (REPS 2, or 8 warps) at splits that keep the grid full, against the rule."""
    rows = []
    shapes = [(18944, 3584), (3584, 18944), (3584, 3584), (512, 3584), (14336, 4096)]
    big = [_v(64), _v(64, REPS=2), _v(64, num_warps=8)]
    for n, k in shapes:
        t, qc, cl, gs, _ = _weight_copies(n, k, l2)
        for m in (1, 8, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfgs = [fp4_mma.pick_config(m, n, k)] if m <= 8 else big
            for ci, cfg in enumerate(cfgs):
                for split in ((None, 2, 4, 8, 16) if m <= 8 else (None, 1, 2, 4, 8)):
                    us = _time_config(x, cl, gs, n, k, {kk: v for kk, v in cfg.items() if v is not None}, split, "tiles")
                    if us is not None:
                        rows.append(dict(N=n, K=k, M=m, cfg=ci, split=split, us=us))
            sel = [r for r in rows if r["N"] == n and r["K"] == k and r["M"] == m]
            rule = [r["us"] for r in sel if r["cfg"] == 0 and r["split"] is None]
            best = min(sel, key=lambda r: r["us"])
            print(f"tiles N={n:6d} K={k:6d} M={m:3d}: rule {rule[0] if rule else float('nan'):7.1f} us; best {best['us']:7.1f} "
                  f"cfg {best['cfg']} split {best['split']}", flush=True)
        del qc, cl
    res["sweep_tiles"] = rows


def sweep_small_split(res, l2):
    """Split-K of the mma.sync rule's config at M = 1 / 8 / 16, split 1 (no reduction tail) to 6: whether
    the fixed-order reduction's extra round trip or the grid size bounds the small-M calls."""
    res["sweep_small_split"] = _split_sweep(l2, (1, 8, 16), (None, 1, 2, 3, 4, 6), False, "small split")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    res = dict(gpu=props.name, git_sha=os.environ.get("QERL_GIT_SHA"), date=time.strftime("%Y-%m-%d"))
    steps = [("check", check), ("layer", lambda r: layer(r, l2)), ("variants", lambda r: variants(r, l2)),
             ("sweep_wgmma", lambda r: sweep_wgmma(r, l2)),
             ("sweep_tiles", lambda r: sweep_tiles(r, l2)), ("sweep", lambda r: sweep(r, l2)),
             ("sweep_small_split", lambda r: sweep_small_split(r, l2))]
    run_steps(steps, res, os.path.join(a.out, "mma_probe.json"), a.only)

if __name__ == "__main__":
    main()
