"""Benchmark the W4A16 kernels: nvfp4 and mxfp4 (qerl Triton) against bf16 cuBLAS
(torch.nn.functional.linear) and bitsandbytes NF4, side by side in one run.

Per model linear shape and M: milliseconds, achieved TB/s (bytes of weights + activations in +
out, over time) and TFLOP/s; grad-input (dx = dy W) against bf16 at the larger M. Writes
results/kernels/<gpu>.json with gpu, git_sha, date, rows, summary and prints a table; the last
stdout line is the summary as one JSON object. Summary (Qwen2.5-7B decoder layer, sum of its seven
linears, bf16 time / nvfp4 time): `qwen2.5-7b/layer/M<m>/nvfp4_over_bf16` for every forward M,
`.../grad_input_nvfp4_over_bf16` for every grad-input M, M1 hbm_fraction and nvfp4_over_nf4;
`qwen2.5-7b/decode_tbps/<fmt>` (the decode kernel of the decode + cuBLAS path, bytes read + written);
`eager_call_us/nvfp4`, `eager_call_us/bf16`, `eager_call/nvfp4_over_bf16` (host time of one eager
QuantLinear / F.linear call at M = 1 on a [1024, 4096] layer: mean over 1000 back-to-back calls,
no synchronisation, median of 5 alternating rounds); `qwen2.5-7b/layer_grouped/M<m>/nvfp4_over_bf16`
(the layer as the fused decode step groups it). Where humming-kernels is installed (optional: pip
install "qerl[bench]"), it is an anchor column on the qwen2.5-7b shapes, in its default (stream-K)
and batch-invariant modes, each (M, mode) checked against the fp32 reference first:
`qwen2.5-7b/layer/M<m>/nvfp4_over_humming` and `.../nvfp4_over_humming_batch_invariant` (humming
time / qerl time). Without it the column is skipped and the JSON's `humming.not_measured` says why.

Timing: each measurement captures a CUDA graph of R calls rotating over C copies of the weights
(C * bytes > 3 x L2, so the weights come from HBM, not L2), replays it after warm-up, and takes
the median over many replays, timed with CUDA events; the graph removes Python launch overhead
for every method alike. Copy bandwidth (bytes read + written by a 1 GiB device-to-device copy) is
measured in the same run.

Run:   python -m benchmarks.bench_kernels                   (all models, about 2 min on an H200)
       python -m benchmarks.bench_kernels --models qwen2.5-7b --m 1 8 2048
       python -m benchmarks.bench_kernels --sweep           (also try launch configs, 7B layer)
       python -m benchmarks.bench_kernels --humming-check   (only the humming column's path, one layer)
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.humming import HUMMING_MAX_REL_ERR, HUMMING_METHODS, Humming, load_humming  # noqa: E402, F401
from benchmarks.speed_common import copy_bandwidth_tbps  # noqa: E402
from qerl import formats, kernels  # noqa: E402
from qerl.arch import LAYER_CONFIGS, LINEAR_NAMES, linear_shapes  # noqa: E402

M_VALUES = (1, 2, 3, 4, 8, 16, 64, 256, 1024, 2048)
GRAD_M_VALUES = (256, 1024, 2048)
# Bytes per weight moved: the registry's storage bits (scales included) / 8; bf16 2.
BYTES_PER_WEIGHT = {**{f: formats.bits_per_weight(f) / 8 for f in formats.names()}, "bf16": 2.0}
TRITON = formats.with_kernel("triton")  # the formats the Triton kernels run (nvfp4, mxfp4)
COLUMNS = TRITON + ("bf16",) + tuple(f for f in formats.names() if f not in TRITON)  # printed table order
# (direction, value): small and mid M, nf4, large M, grad-input, eager host time
TARGETS = {  # the rollout's targets on an H200 (bf16 / NVFP4 at M 1-256, HBM at M 1, humming at every M), then older ones
    "qwen2.5-7b/layer/M1/nvfp4_over_bf16": (">=", 2.6),
    "qwen2.5-7b/layer/M1/hbm_fraction": (">=", 0.65),
    "qwen2.5-7b/layer/M16/nvfp4_over_bf16": (">=", 2.0),
    "qwen2.5-7b/layer/M32/nvfp4_over_bf16": (">=", 1.6),
    "qwen2.5-7b/layer/M64/nvfp4_over_bf16": (">=", 1.4),
    "qwen2.5-7b/layer/M128/nvfp4_over_bf16": (">=", 1.1),
    "qwen2.5-7b/layer/M256/nvfp4_over_bf16": (">=", 1.0),
    **{f"qwen2.5-7b/layer/M{m}/nvfp4_over_humming": (">=", 1.0)
       for m in (1, 8, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 1024, 2048)},
    "qwen2.5-7b/layer/M1024/nvfp4_over_bf16": (">=", 0.95),
    "qwen2.5-7b/layer/M2048/nvfp4_over_bf16": (">=", 0.95),
    "qwen2.5-7b/layer/min_M1-64/nvfp4_over_bf16": (">=", 1.8),
    "qwen2.5-7b/layer/M256/grad_input_nvfp4_over_bf16": (">=", 0.9),
    "qwen2.5-7b/layer/M2048/grad_input_nvfp4_over_bf16": (">=", 0.95),
    "qwen2.5-7b/layer/M1/nvfp4_over_nf4": (">=", 1.8),
    "qwen2.5-7b/decode_tbps/nvfp4": (">=", 2.5),
    "qwen2.5-7b/decode_tbps/mxfp4": (">=", 2.5),
    "eager_call/nvfp4_over_bf16": ("<=", 1.5),
}
EAGER_SHAPE = (1024, 4096)  # [out, in] of the layer whose eager host time is measured
EAGER_CALLS = 1000

# ----------------------------------------------------------------------------------------------
# timing


def time_graph(fns, min_reps=8, target_s=0.15):
    """Median seconds per call of fns (rotated), from CUDA-graph replays timed with events.

    Falls back to timing an eager loop (still events, median of many) if capture fails.
    """
    for f in fns:  # warm-up: compile, autotune, allocate workspaces
        f()
    torch.cuda.synchronize()
    reps = max(min_reps, len(fns))
    mode = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fns[i % len(fns)]()
        run = g.replay
    except Exception as e:  # noqa: BLE001 - any capture failure: measure eagerly, say so
        print(f"  graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing eagerly")
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for i in range(reps):
                fns[i % len(fns)]()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(200, max(10, target_s / one)))
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times), mode


def copy_bandwidth():
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    return copy_bandwidth_tbps(reps=30)


# ----------------------------------------------------------------------------------------------
# methods


def n_copies(nbytes, l2):
    return int(min(64, max(1, math.ceil(3 * l2 / max(nbytes, 1)))))


def make_bnb(w, copies):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    out = []
    for _ in range(copies):
        packed, state = bf.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True)
        out.append((packed, state))
    return lambda x, pq: bnb.matmul_4bit(x, pq[0].t(), quant_state=pq[1]), out


def bench_shape(model, proj_names, n, k, ms, grad_ms, l2, bnb_ok, rows):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q = {fmt: formats.quantize(w.float(), fmt) for fmt in TRITON}
    c = {m: n_copies(n * k * BYTES_PER_WEIGHT[m], l2) for m in BYTES_PER_WEIGHT}
    qc = {fmt: [{kk: v.clone() for kk, v in q[fmt].items()} for _ in range(c[fmt])] for fmt in q}
    wc = [w.clone() for _ in range(c["bf16"])]
    nf4 = make_bnb(w, c["nf4"]) if bnb_ok else None
    # one kernel cache per copy, as a QuantLinear keeps one (the small-M kernel's compute layout lives there)
    caches = {fmt: [{} for _ in qc[fmt]] for fmt in qc}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        res = {}
        for fmt in TRITON:
            res[fmt] = time_graph([lambda t=t, x=x, fmt=fmt, c=c: kernels.linear(x, fmt, t, n, k, backend="triton", cache=c)
                                   for t, c in zip(qc[fmt], caches[fmt])])
        res["bf16"] = time_graph([lambda wi=wi, x=x: F.linear(x, wi) for wi in wc])
        if nf4 is not None:
            f, packs = nf4
            res["nf4"] = time_graph([lambda p=p, f=f, x=x: f(x, p) for p in packs])
        kind = kernels.kernel_name("linear", x, k)  # with a cache, as timed above
        for meth, (sec, mode) in res.items():
            moved = n * k * BYTES_PER_WEIGHT[meth] + 2 * m * (n + k)
            rows.append(dict(model=model, proj="/".join(proj_names), N=n, K=k, M=m, op="linear",
                             method=meth, ms=sec * 1e3, tbps=moved / sec / 1e12,
                             tflops=2 * m * n * k / sec / 1e12, timing=mode,
                             kernel=kind if meth in TRITON else None))
    for m in grad_ms:
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        res = {}
        for fmt in TRITON:
            res[fmt] = time_graph([lambda t=t, dy=dy, fmt=fmt: kernels.grad_input(dy, fmt, t, n, k, backend="triton") for t in qc[fmt]])
        res["bf16"] = time_graph([lambda wi=wi, dy=dy: torch.matmul(dy, wi) for wi in wc])
        for meth, (sec, mode) in res.items():
            moved = n * k * BYTES_PER_WEIGHT[meth] + 2 * m * (n + k)
            rows.append(dict(model=model, proj="/".join(proj_names), N=n, K=k, M=m, op="grad_input",
                             method=meth, ms=sec * 1e3, tbps=moved / sec / 1e12,
                             tflops=2 * m * n * k / sec / 1e12, timing=mode,
                             kernel=kernels.kernel_name("grad_input", dy, k) if meth in TRITON else None))
    del qc, wc, nf4, caches
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# config sweep (optional): which launch config wins per 7B shape and M


GEMV_SWEEP = [(128, 8, 4, 2), (64, 8, 4, 2), (64, 4, 4, 2), (32, 8, 4, 2)]  # M = 1: (BLOCK_N, GROUPS, warps, stages)
DOT16_SWEEP = [(128, 64, 4, 4, True), (64, 128, 4, 4, True), (64, 64, 4, 4, True), (128, 128, 4, 3, True),
               (128, 64, 4, 4, False), (256, 64, 8, 3, True)]  # M <= 16: (BLOCK_N, BLOCK_K, warps, stages, SWAP_AB)
DOT_SWEEP = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SWAP_AB)
    "mid": [(64, 128, 64, 4, 4, True), (64, 128, 128, 4, 3, True), (64, 64, 64, 4, 4, True)],
    "big": [(128, 128, 64, 4, 4, True), (256, 128, 64, 8, 3, True), (128, 256, 64, 8, 3, True),
            (128, 128, 64, 4, 4, False), (128, 256, 64, 8, 3, False), (128, 128, 128, 8, 3, True)],
}
BWD_SWEEP = [(128, 64, 64, 4, 4), (256, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4)]  # (BLOCK_M, BLOCK_K, BLOCK_R, warps, stages)


def sweep_candidates(m):
    """(kind, config) pairs to time at M = m (kind bf16 / bf16-grad: the cuBLAS baselines)."""
    cands = [("bf16", None)]
    if m == 1:
        cands += [("gemv", dict(BLOCK_M=1, BLOCK_N=bn, GROUPS=g, ACC_F32=False, num_warps=w, num_stages=st))
                  for bn, g, w, st in GEMV_SWEEP]
    if 4 < m <= 16:
        cands += [("dot", dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SWAP_AB=sw, num_warps=w,
                                num_stages=st)) for bn, bk, w, st, sw in DOT16_SWEEP]
    if m > 16:
        cands += [("dot", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SWAP_AB=sw, num_warps=w,
                                num_stages=st)) for bm, bn, bk, w, st, sw in DOT_SWEEP["mid" if m <= 64 else "big"]]
    if m >= 256:
        cands += [("bf16-grad", None)]
        cands += [("bwd", dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, GROUP_M=8, num_warps=w, num_stages=st))
                  for bm, bk, br, w, st in BWD_SWEEP]
    return cands


def sweep(l2, out_rows, ms=(1, 8, 16, 64, 2048)):
    """Time launch configs per 7B shape and M, each checked against the fp32 reference."""
    shapes = linear_shapes("qwen2.5-7b")
    uniq = {}
    for p, s in shapes.items():
        uniq.setdefault(s, []).append(p)
    for (n, k), names in uniq.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        t = formats.quantize(w, "nvfp4")
        wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)
        copies = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * 0.5625, l2))]
        wc = [w.bfloat16() for _ in range(n_copies(n * k * 2, l2))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.T
            ref_g = dy.float() @ wd
            for kind, cfg in sweep_candidates(m):
                try:
                    err = None
                    if kind == "bf16":
                        fns = [lambda wi=wi, x=x: F.linear(x, wi) for wi in wc]
                    elif kind == "bf16-grad":
                        fns = [lambda wi=wi, dy=dy: torch.matmul(dy, wi) for wi in wc]
                    elif kind == "bwd":
                        fns = [lambda tt=tt, dy=dy, cfg=cfg: kernels.grad_input_tuned(dy, "nvfp4", tt, config=cfg) for tt in copies]
                        out = fns[0]()
                        err = float((out.float() - ref_g).norm() / ref_g.norm())
                    else:
                        fns = [lambda tt=tt, x=x, kind=kind, cfg=cfg: kernels.linear_tuned(x, "nvfp4", tt, kind=kind, config=cfg) for tt in copies]
                        out = fns[0]()
                        err = float((out.float() - ref).norm() / ref.norm())
                    sec, _ = time_graph(fns)
                except Exception as e:  # noqa: BLE001 - a config may not compile; record it
                    print(f"  sweep {kind} {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                out_rows.append(dict(proj="/".join(names), N=n, K=k, M=m, kind=kind, config=cfg,
                                     us=sec * 1e6, tbps=n * k * 0.5625 / sec / 1e12, rel_err=err,
                                     tflops=2 * m * n * k / sec / 1e12))
                print(f"  sweep {'/'.join(names):18s} M={m:5d} {kind:9s} {sec * 1e6:9.1f} us "
                      f"{2 * m * n * k / sec / 1e12:6.1f} TF err={err if err is None else f'{err:.1e}'} {cfg}", flush=True)
        del copies, wc
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# humming-kernels: an optional anchor column (its set-up: benchmarks/humming.py)

HUMMING_CHECK_MS = (1, 16, 256)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in fp32 (inf where out is not finite or has the wrong shape)."""
    if tuple(out.shape) != tuple(ref.shape) or not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm())


def bench_humming_shape(hum, model, proj_names, n, k, ms, l2, rows, verbose=False):
    """Time humming on one linear shape at every M in both modes, as bench_shape times qerl (CUDA
    graph replay over copies of the weights that together exceed 3 x L2), each (M, mode) first
    checked against the fp32 reference. Appends rows (method humming / humming_batch_invariant);
    returns notes on whatever failed, naming the call (`verbose`: with its traceback printed)."""
    import traceback

    notes = []
    where = f"{model} {'/'.join(proj_names)} [{n}x{k}]"
    steps = []
    try:
        w = torch.randn(n, k, device="cuda") * 0.02
        t = formats.quantize(w, "nvfp4")
        wd = formats.dequantize(t, "nvfp4", dtype=torch.float32)
        layers = [hum.make_layer(t, n, k, steps) for _ in range(n_copies(n * k * BYTES_PER_WEIGHT["nvfp4"], l2))]
    except Exception as e:  # noqa: BLE001 - record and go on without this shape
        notes.append(f"humming {where}: {steps[-1] if steps else 'setup'} failed: {type(e).__name__}: {str(e)[:300]}")
        print("  " + notes[-1], flush=True)
        if verbose:
            traceback.print_exc()
        return notes
    t0 = time.time()
    try:
        count = hum.precompile(layers[0], ms)
        print(f"  humming {where}: {count} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - each first call compiles its own kernel instead
        notes.append(f"humming {where}: warning: precompile failed ({type(e).__name__}: {str(e)[:200]}); "
                     "kernels compile at their first call")
        print("  " + notes[-1], flush=True)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ wd.T
        for meth, bi in HUMMING_METHODS.items():
            step = "get_heuristics_config"
            try:
                cc, tuning = hum.configs(layers[0], m, bi)
                step = "forward (first call compiles)"
                out = layers[0](x, compute_config=cc, tuning_config=tuning)
                step = "check against the fp32 reference"
                err = rel_err(out, ref)
                if not err <= HUMMING_MAX_REL_ERR:
                    raise ValueError(f"relative error {err:.3g} against the fp32 reference > {HUMMING_MAX_REL_ERR}")
                step = "timing"
                sec, mode = time_graph([lambda L=L, x=x, cc=cc, tuning=tuning: L(x, compute_config=cc, tuning_config=tuning)
                                        for L in layers])
            except Exception as e:  # noqa: BLE001 - a failed (M, mode) is a note, never a crash
                notes.append(f"{meth} {where} M={m}: {step} failed: {type(e).__name__}: {str(e)[:300]}")
                print("  " + notes[-1], flush=True)
                if verbose:
                    traceback.print_exc()
                continue
            moved = n * k * BYTES_PER_WEIGHT["nvfp4"] + 2 * m * (n + k)
            rows.append(dict(model=model, proj="/".join(proj_names), N=n, K=k, M=m, op="linear", method=meth,
                             ms=sec * 1e3, tbps=moved / sec / 1e12, tflops=2 * m * n * k / sec / 1e12, timing=mode,
                             kernel=hum.describe(tuning), rel_err=err))
    del layers
    torch.cuda.empty_cache()
    return notes


def humming_check(l2, ms=HUMMING_CHECK_MS, model="qwen2.5-7b", proj="q_proj"):
    """--humming-check: the humming path alone, on one `proj` layer of `model`. Prints where humming
    finds CUDA and NVRTC, builds the layer call by call, checks each M and mode against the fp32
    reference and times it (with qerl's nvfp4 and bf16 on the same layer for scale). Returns the
    exit code: 0 if every check passed, 1 otherwise."""
    hum, why = load_humming()
    if hum is None:
        print(f"FAIL import: {why}")
        return 1
    print(f"humming {hum.info['version']}; NVRTC {hum.info['nvrtc']}; LD_LIBRARY_PATH += {hum.info['ld_library_path_added']}")
    try:
        from humming.utils.cuda import filter_cuda_paths

        env = filter_cuda_paths(required_headers=["nvrtc.h"])
        print(f"CUDA environment humming compiles with: {env['source']} {env['path']}; includes {env['include_paths']}")
    except Exception as e:  # noqa: BLE001 - report and go on: the compile will say the same
        print(f"FAIL humming.utils.cuda.filter_cuda_paths(nvrtc.h): {type(e).__name__}: {e}")
    try:
        from humming.utils.nvrtc import may_build_nvrtc_compile_binary

        print(f"compile helper: {may_build_nvrtc_compile_binary()}")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL humming.utils.nvrtc.may_build_nvrtc_compile_binary: {type(e).__name__}: {e}")
    n, k = linear_shapes(model)[proj]
    print(f"{model} {proj} [{n}x{k}], M = {list(ms)}")
    rows = []
    t0 = time.time()
    notes = bench_humming_shape(hum, model, [proj], n, k, ms, l2, rows, verbose=True)
    print(f"humming built, checked and timed in {time.time() - t0:.0f} s (compiles included)")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    t = formats.quantize(w.float(), "nvfp4")
    qc = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * BYTES_PER_WEIGHT["nvfp4"], l2))]
    caches = [{} for _ in qc]
    wc = [w.clone() for _ in range(n_copies(n * k * 2, l2))]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        line = [f"M={m:5d}"]
        for meth in HUMMING_METHODS:
            r = [r for r in rows if r["M"] == m and r["method"] == meth]
            line.append(f"{meth} {r[0]['ms'] * 1e3:8.1f} us (err {r[0]['rel_err']:.1e}, {r[0]['kernel']})" if r
                        else f"{meth} FAILED")
        try:
            q_us = time_graph([lambda tt=tt, c=c, x=x: kernels.linear(x, "nvfp4", tt, n, k, backend="triton", cache=c)
                               for tt, c in zip(qc, caches)])[0] * 1e6
            b_us = time_graph([lambda wi=wi, x=x: F.linear(x, wi) for wi in wc])[0] * 1e6
            line.append(f"qerl nvfp4 {q_us:8.1f} us, bf16 {b_us:8.1f} us")
        except Exception as e:  # noqa: BLE001 - only context for the humming numbers
            line.append(f"qerl/bf16 timing failed: {type(e).__name__}: {str(e)[:200]}")
        print("  ".join(line), flush=True)
    for note in notes:
        print(("" if ": warning:" in note else "FAIL ") + note)
    ok = len(rows) == len(ms) * len(HUMMING_METHODS)  # every (M, mode) checked and timed
    print("humming check: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------
# main


def git_sha():
    """The commit benchmarked: qerl.logging.git_info (QERL_GIT_SHA on a copy without .git)."""
    from qerl.logging import git_info

    return git_info()["git_sha"]


def decode_speed(l2, model="qwen2.5-7b"):
    """TB/s (packed bytes read + bf16 bytes written, over time) of decoding the layer's seven
    weights into a bf16 buffer, per format: the first half of the decode + cuBLAS path."""
    out = {}
    for fmt in TRITON:
        moved, sec = 0.0, 0.0
        for n, k in linear_shapes(model).values():
            t = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
            copies = [{kk: v.clone() for kk, v in t.items()} for _ in range(n_copies(n * k * BYTES_PER_WEIGHT[fmt], l2))]
            buf = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
            fns = [lambda tt=tt, buf=buf, fmt=fmt: kernels.decode(fmt, tt, out=buf) for tt in copies]
            sec += time_graph(fns)[0]
            moved += n * k * (BYTES_PER_WEIGHT[fmt] + 2)
        out[fmt] = moved / sec / 1e12
        print(f"decode {fmt}: {out[fmt]:.2f} TB/s over the {model} layer ({sec * 1e6:.1f} us)", flush=True)
    return out


def eager_calls(rounds=5):
    """Host time per eager call at M = 1 on an EAGER_SHAPE layer: mean wall time of EAGER_CALLS
    back-to-back calls with no synchronisation between them (the GPU work is far shorter), for a
    QuantLinear (nvfp4, no adapter) and F.linear (bf16), alternating; the median over rounds."""
    from qerl.qlinear import QuantLinear

    n, k = EAGER_SHAPE
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nvfp4")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    fns = {"nvfp4": lambda: q(x), "bf16": lambda: F.linear(x, w)}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(EAGER_CALLS):
                f()
            times[name].append((time.perf_counter() - t0) / EAGER_CALLS * 1e6)
            torch.cuda.synchronize()
    res = {name: statistics.median(v) for name, v in times.items()}
    print(f"eager call at M = 1 on [{n}, {k}]: nvfp4 {res['nvfp4']:.1f} us, bf16 {res['bf16']:.1f} us", flush=True)
    return res


def grouped_layer(l2, ms=(1, 2, 4, 8, 16, 32), model="qwen2.5-7b"):
    """{M: (bf16 us, grouped nvfp4 us)}: the 7B layer as the fused decode step runs it on 4-bit
    weights (q/k/v one kernels.grouped_linear launch, o, gate/up one launch, down) against the seven
    cuBLAS calls the bf16 step makes (HF's separate Linears). Empty where the grouped kernel does not
    apply."""
    shapes = linear_shapes(model)
    groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
    res = {}
    for m in ms:
        tb = tq = 0.0
        for g in groups:
            k = shapes[g[0]][1]
            ws = []
            for p in g:
                n = shapes[p][0]
                w = torch.randn(n, k, device="cuda") * 0.02
                t = formats.quantize(w, "nvfp4")
                ws.append((t, n, w.bfloat16()))
            per = sum(n * k * 0.5625 for _, n, _ in ws)
            copies = []
            for _ in range(n_copies(per, l2)):  # each copy with its own kernel cache (its compute layout)
                copies.append([kernels.Weight("nvfp4", {kk: v.clone() for kk, v in t.items()}, n, k, "triton", {})
                               for t, n, _ in ws])
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if kernels.grouped_linear(x, copies[0]) is None:
                return {}
            tq += time_graph([lambda c=c, x=x: kernels.grouped_linear(x, c) for c in copies], target_s=0.03)[0]
            wcs = [[wb.clone() for _, _, wb in ws] for _ in range(n_copies(per / 0.5625 * 2, l2))]
            tb += time_graph([lambda c=c, x=x: [F.linear(x, wi) for wi in c] for c in wcs], target_s=0.03)[0]
            del copies, wcs
        res[m] = (tb * 1e6, tq * 1e6)
        print(f"grouped {model} layer M = {m}: bf16 {tb * 1e6:.1f} us, nvfp4 (4 launches) {tq * 1e6:.1f} us "
              f"({tb / tq:.2f}x)", flush=True)
    return res


def summarize(rows, copy_tbps, extra=None):
    def layer(op, meth, m):
        shapes = linear_shapes("qwen2.5-7b")
        total = 0.0
        for p in LINEAR_NAMES:
            n, k = shapes[p]
            hit = [r["ms"] for r in rows if r["model"] == "qwen2.5-7b" and r["op"] == op
                   and r["method"] == meth and r["M"] == m and r["N"] == n and r["K"] == k]
            if not hit:
                return None
            total += hit[0]
        return total

    def ratio(a, b):
        return None if a is None or b is None else a / b

    extra = extra or {}
    s = {}
    ms = sorted({r["M"] for r in rows if r["model"] == "qwen2.5-7b" and r["op"] == "linear"})
    for m in ms:
        s[f"qwen2.5-7b/layer/M{m}/nvfp4_over_bf16"] = ratio(layer("linear", "bf16", m), layer("linear", "nvfp4", m))
    ratios = [s.get(f"qwen2.5-7b/layer/M{m}/nvfp4_over_bf16") for m in range(1, 65)]
    if all(r is not None for r in ratios):  # every M from 1 to 64 timed (--every-m 64)
        worst = min(range(64), key=lambda i: ratios[i])
        s["qwen2.5-7b/layer/min_M1-64/nvfp4_over_bf16"] = ratios[worst]
        s["qwen2.5-7b/layer/min_M1-64/at_M"] = worst + 1
    t1 = layer("linear", "nvfp4", 1)
    nbytes = sum(n * k * 0.5625 for n, k in linear_shapes("qwen2.5-7b").values())
    s["qwen2.5-7b/layer/M1/hbm_fraction"] = None if t1 is None else nbytes / (t1 / 1e3) / 1e12 / copy_tbps
    gms = sorted({r["M"] for r in rows if r["model"] == "qwen2.5-7b" and r["op"] == "grad_input"})
    for m in gms:
        s[f"qwen2.5-7b/layer/M{m}/grad_input_nvfp4_over_bf16"] = ratio(
            layer("grad_input", "bf16", m), layer("grad_input", "nvfp4", m))
    s["qwen2.5-7b/layer/M1/nvfp4_over_nf4"] = ratio(layer("linear", "nf4", 1), layer("linear", "nvfp4", 1))
    for meth in HUMMING_METHODS:  # only where humming was measured on every linear of the layer
        for m in ms:
            r = ratio(layer("linear", meth, m), layer("linear", "nvfp4", m))
            if r is not None:
                s[f"qwen2.5-7b/layer/M{m}/nvfp4_over_{meth}"] = r
    for fmt, tb in extra.get("decode", {}).items():
        s[f"qwen2.5-7b/decode_tbps/{fmt}"] = tb
    eager = extra.get("eager")
    if eager:
        s["eager_call_us/nvfp4"] = eager["nvfp4"]
        s["eager_call_us/bf16"] = eager["bf16"]
        s["eager_call/nvfp4_over_bf16"] = eager["nvfp4"] / eager["bf16"]
    for m, (b, q) in extra.get("grouped", {}).items():
        s[f"qwen2.5-7b/layer_grouped/M{m}/nvfp4_over_bf16"] = b / q
    return s


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(LAYER_CONFIGS), choices=list(LAYER_CONFIGS),
                    help="models whose linear shapes to time")
    ap.add_argument("--m", nargs="+", type=int, default=list(M_VALUES), help="rows M of the forward")
    ap.add_argument("--grad-m", nargs="+", type=int, default=list(GRAD_M_VALUES), help="rows M of grad-input")
    ap.add_argument("--out", default="results/kernels", help="folder for <gpu>.json")
    ap.add_argument("--git-sha", default=None, help="commit benchmarked (when the machine has no git)")
    ap.add_argument("--every-m", type=int, default=0, metavar="E",
                    help="also time the forward at every M from 1 to E (no humming there): E = 64 gives the "
                         "min_M1-64 key")
    ap.add_argument("--sweep", action="store_true", help="also time launch configs on the 7B shapes")
    ap.add_argument("--sweep-only", action="store_true", help="only the config sweep (writes <gpu>_sweep.json)")
    ap.add_argument("--sweep-m", nargs="+", type=int, default=[1, 8, 16, 64, 2048], help="M of the sweep")
    ap.add_argument("--no-nf4", action="store_true", help="skip bitsandbytes NF4")
    ap.add_argument("--no-humming", action="store_true", help="skip the humming-kernels anchor column")
    ap.add_argument("--humming-models", nargs="+", default=["qwen2.5-7b"], choices=list(LAYER_CONFIGS),
                    help="models whose shapes humming is timed on (each (shape, M, mode) compiles a kernel)")
    ap.add_argument("--humming-check", action="store_true",
                    help="only check and time humming on one 7B q_proj layer at M = 1, 16, 256, then exit")
    args = ap.parse_args()

    import triton

    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    name = props.name
    gpu = "h100" if "H100" in name else "h200" if "H200" in name else name.lower().replace(" ", "_")
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bnb_version, bnb_why = None, None
    if args.no_nf4:
        bnb_why = "--no-nf4"
    else:
        try:
            import bitsandbytes

            bnb_version = bitsandbytes.__version__
        except Exception as e:  # noqa: BLE001 - record why NF4 is not measured
            bnb_why = f"bitsandbytes not importable: {type(e).__name__}: {e}"
    env = dict(gpu_name=name, sms=props.multi_processor_count, l2_bytes=l2, torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda, bitsandbytes=bnb_version,
               python=platform.python_version())
    print("env:", json.dumps(env))
    if bnb_why:
        print("NF4 not measured:", bnb_why)

    if args.humming_check:
        sys.exit(humming_check(l2))
    hum, hum_why = (None, "--no-humming") if args.no_humming else load_humming()
    env["humming"] = None if hum is None else hum.info["version"]
    if hum is None:
        print("humming not measured:", hum_why)
    else:
        print("humming:", json.dumps(hum.info))
    hum_notes = []

    copy_tbps = copy_bandwidth()
    print(f"copy bandwidth (read + write): {copy_tbps:.3f} TB/s")

    sweep_rows = []
    if args.sweep or args.sweep_only:
        sweep(l2, sweep_rows, ms=args.sweep_m)
    if args.sweep_only:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{gpu}_sweep.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, git_sha=args.git_sha or git_sha(), env=env, copy_bandwidth_tbps=copy_tbps,
                           sweep=sweep_rows), f, indent=1)
        print(f"wrote {path}")
        return

    rows = []
    t_start = time.time()
    ms = sorted(set(args.m) | set(range(1, args.every_m + 1)))  # humming is timed at args.m only
    for model in args.models:
        uniq = {}
        for p, s in linear_shapes(model).items():
            uniq.setdefault(s, []).append(p)
        for (n, k), names in uniq.items():
            bench_shape(model, names, n, k, ms, args.grad_m, l2, bnb_version is not None, rows)
            if hum is not None and model in args.humming_models:
                hum_notes += bench_humming_shape(hum, model, names, n, k, args.m, l2, rows)
            print(f"  {model} {'/'.join(names)} [{n}x{k}] done ({time.time() - t_start:.0f} s)")

    extra = {}
    if "qwen2.5-7b" in args.models:
        extra = dict(decode=decode_speed(l2), eager=eager_calls(), grouped=grouped_layer(l2))
    summary = summarize(rows, copy_tbps, extra)
    result = dict(gpu=gpu, git_sha=args.git_sha or git_sha(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  env=env, copy_bandwidth_tbps=copy_tbps, nf4_not_measured=bnb_why,
                  humming=dict(not_measured=hum_why, notes=hum_notes, **(hum.info if hum is not None else {})),
                  targets=TARGETS, summary=summary, rows=rows)
    if sweep_rows:
        result["sweep"] = sweep_rows
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{gpu}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

    columns = COLUMNS + tuple(m for m in HUMMING_METHODS if any(r["method"] == m for r in rows))
    print(f"\n{'model':13s} {'proj':18s} {'N':>6s} {'K':>6s} {'M':>5s} {'op':10s} "
          + " ".join(f"{m + ' ms TB/s':>17s}" for m in columns))
    keyed = {}
    for r in rows:
        keyed.setdefault((r["model"], r["proj"], r["N"], r["K"], r["M"], r["op"]), {})[r["method"]] = r
    for (model, proj, n, k, m, op), d in keyed.items():
        cells = []
        for meth in columns:
            r = d.get(meth)
            cells.append(f"{r['ms']:9.4f} {r['tbps']:6.2f}" if r else f"{'-':>16s}")
        print(f"{model:13s} {proj:18s} {n:6d} {k:6d} {m:5d} {op:10s} " + " ".join(cells))
    print(f"\nwrote {path}")
    for note in hum_notes:
        print("humming note:", note)
    for key, val in summary.items():
        if key not in TARGETS:
            print(f"{key:52s} {'-' if val is None else f'{val:.3f}':>8s}")
            continue
        op, tgt = TARGETS[key]
        met = val is not None and (val >= tgt if op == ">=" else val <= tgt)
        status = "n/a" if val is None else ("ok" if met else "MISSED")
        print(f"{key:52s} {'-' if val is None else f'{val:.3f}':>8s}  target {op} {tgt}  {status}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
