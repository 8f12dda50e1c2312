"""Which 4-bit kernel family wins at which M: every family the door can pick, timed on one model's
decoder layer at every M of a range, side by side in one run (GPU).

The door (``qerl.kernels.linear``) picks a family by M and GPU (its docstring). This tool times each
family on its own, so the thresholds can be re-derived on another GPU, model or Triton:

  - ``door``: what ``kernels.linear`` runs today (with a kernel cache, as a QuantLinear calls it);
  - ``mma``: the tensor-core kernel on the compute layout (mma.sync up to 32 rows, its warpgroup-MMA
    variant above on sm_90);
  - ``ws``: the warp-specialised kernel with its MMAs in flight where the installed Triton allows
    it (``qerl.kernels.MMA_IN_FLIGHT``), ``ws_waited`` the same kernel with each MMA waited at once;
    ``ws_bm64``: in flight with 64-row activation tiles above 64 rows (each weight tile decoded once a
    64-row tile, against 128-row tiles that hold twice the accumulators);
  - ``bf16``: cuBLAS on the bf16 weight.

Before timing, every family's output at every M is checked against the fp32 reference (relative
error < 2e-2, NVFP4 and MXFP4); a family that fails is reported and not timed. Timing as in
``benchmarks.bench_kernels`` (CUDA graphs over weight copies larger than 3x L2, median of replays).
Writes results/kernels/<gpu>_families.json (env: torch, Triton, GPU, git sha, date) with per-M layer
times and the winner at each M; the last stdout line is its summary.

Extra warp-specialised configs are families too: ``--ws rpw2:NWG=1,RPW=2,STAGES=6`` times the kernel with
those keys over its rule's config (``warpspec.pick_config``) as family ``ws:rpw2``; ``--mma direct:X_DIRECT=1,KB=1``
likewise the mma kernel over ``mma.pick_config`` as family ``mma:direct``.

Run:   python -m benchmarks.kernel_families                      (qwen2.5-7b, M = 9..256)
       python -m benchmarks.kernel_families --m 16 32 64 --families door ws bf16
       python -m benchmarks.kernel_families --m 64 128 --families ws bf16 --ws rpw2:NWG=1,RPW=2
       python -m benchmarks.kernel_families --m 1 8 16 --families mma bf16 --mma direct1:X_DIRECT=1,KB=1
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks import speed_common as sc
from benchmarks.bench_kernels import n_copies, time_graph
from qerl import formats, kernels
from qerl.arch import LAYER_CONFIGS, linear_shapes

FAMILIES = ("bf16", "door", "mma", "ws", "ws_waited", "ws_bm64")
TOL = 2e-2


EXTRA_WS: dict[str, dict] = {}  # "ws:<name>" -> config keys over warpspec.pick_config (--ws)
EXTRA_MMA: dict[str, dict] = {}  # "mma:<name>" -> config keys over mma.pick_config (--mma)


def _parse_extra(spec: str, kind: str) -> tuple[str, dict]:
    """"name:KEY=int,KEY=int" -> ("<kind>:name", {KEY: int})."""
    name, _, body = spec.partition(":")
    if not name or not body:
        raise argparse.ArgumentTypeError(f"--{kind} takes name:KEY=value,..., got {spec!r}")
    try:
        cfg = {k.strip(): int(v) for k, v in (kv.split("=") for kv in body.split(","))}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--{kind} {spec!r}: {e}") from None
    return f"{kind}:{name}", cfg


def parse_ws(spec: str) -> tuple[str, dict]:
    return _parse_extra(spec, "ws")


def parse_mma(spec: str) -> tuple[str, dict]:
    return _parse_extra(spec, "mma")


MMA_BOOL_KEYS = ("X_DIRECT", "PREFETCH", "WGMMA", "W_RING")


def _mma_config(x: torch.Tensor, n: int, k: int, keys: dict) -> dict:
    """The mma kernel's rule config at x's rows, with ``keys`` over it (1 / 0 for the boolean keys)."""
    return kernels.mma_config(x.shape[0], n, k, x.device,
                              **{kk: bool(v) if kk in MMA_BOOL_KEYS else v for kk, v in keys.items()})


def _family_fn(family: str, fmt: str, t: dict, cache: dict, w: torch.Tensor, n: int, k: int):
    """x -> y for one family on one weight copy (``cache`` keeps its compute layout, as a QuantLinear's)."""
    if family in EXTRA_MMA:
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="mma", cache=cache, config=_mma_config(x, n, k, EXTRA_MMA[family]))
    if family in EXTRA_WS:
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="warpspec", cache=cache, config=EXTRA_WS[family])
    if family == "bf16":
        return lambda x: F.linear(x, w)
    if family == "door":
        return lambda x: kernels.linear(x, fmt, t, n, k, backend="triton", cache=cache)
    if family == "mma":
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="mma", cache=cache)
    if family == "ws":
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="warpspec", cache=cache)
    if family == "ws_waited":
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="warpspec", cache=cache, config={"in_flight": False})
    if family == "ws_bm64":  # 64-row activation tiles at every M (two consumer warpgroups)
        return lambda x: kernels.linear_tuned(x, fmt, t, kind="warpspec", cache=cache,
                                              config={"BM": 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64,
                                                      "KB": 2, "NWG": 2, "STAGES": 4})
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def check(families, ms, n=1000, k=4096) -> dict:
    """{family: [M that failed]} against the fp32 reference, both Triton formats, fresh inputs per M."""
    bad = {f: [] for f in families}
    w = torch.randn(n, k, device="cuda") * 0.02
    for fmt in formats.with_kernel("triton"):
        t = formats.quantize(w, fmt)
        wd = formats.dequantize(t, fmt, dtype=torch.float32)
        cache = {}
        for f in families:
            if f == "bf16":  # cuBLAS on the dequantized weight: the timing baseline, not a 4-bit kernel
                continue
            fn = _family_fn(f, fmt, t, cache, wd.to(torch.bfloat16), n, k)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ wd.T
                try:
                    y = fn(x)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001 - a family that cannot run an M is reported, not timed
                    print(f"  {f} {fmt} M={m}: {type(e).__name__}: {str(e)[:100]}")
                    err = float("inf")
                if not err < TOL:
                    bad[f].append(m)
                    print(f"  {f} {fmt} M={m}: rel err {err:.3g}")
    return bad


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=list(LAYER_CONFIGS))
    ap.add_argument("--m", nargs="+", type=int, default=list(range(9, 257)), help="rows M (default 9..256)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--fmt", default="nvfp4", choices=formats.with_kernel("triton"))
    ap.add_argument("--ws", nargs="+", type=parse_ws, default=[], metavar="NAME:KEY=V,...",
                    help="extra warp-specialised configs timed as families ws:NAME (keys of warpspec.pick_config)")
    ap.add_argument("--mma", nargs="+", type=parse_mma, default=[], metavar="NAME:KEY=V,...",
                    help="extra mma-kernel configs timed as families mma:NAME (keys of mma.pick_config; 1/0 for booleans)")
    ap.add_argument("--out", default="results/kernels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: kernel_families needs a CUDA GPU")
    dev = torch.cuda.get_device_properties(0)
    EXTRA_WS.clear()
    EXTRA_WS.update(dict(args.ws))
    EXTRA_MMA.clear()
    EXTRA_MMA.update(dict(args.mma))
    families = list(args.families) + list(EXTRA_WS) + list(EXTRA_MMA)
    bad = check(families, args.m)
    timed = [f for f in families if not bad[f]]
    shapes: dict[tuple[int, int], list[str]] = {}
    for proj, nk in linear_shapes(args.model).items():
        shapes.setdefault(nk, []).append(proj)
    layer = {f: {m: 0.0 for m in args.m} for f in timed}
    for (n, k), projs in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        t = formats.quantize(w.float(), args.fmt)
        copies = {f: n_copies(n * k * (2.0 if f == "bf16" else formats.bits_per_weight(args.fmt) / 8), dev.L2_cache_size)
                  for f in timed}
        ws = [w.clone() for _ in range(copies["bf16"])] if "bf16" in timed else []
        tc = [{kk: v.clone() for kk, v in t.items()} for _ in range(max(copies.values()))]
        caches = [{} for _ in tc]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for f in timed:
                if f == "bf16":
                    fns = [lambda wi=wi, x=x: F.linear(x, wi) for wi in ws]
                else:
                    fns = [lambda fn=_family_fn(f, args.fmt, ti, ci, w, n, k), x=x: fn(x)
                           for ti, ci in zip(tc[:copies[f]], caches)]
                sec, _ = time_graph(fns)
                layer[f][m] += sec * 1e6 * len(projs)
        del ws, tc, caches
        torch.cuda.empty_cache()
    winners = {m: min((f for f in timed if f != "bf16"), key=lambda f: layer[f][m]) for m in args.m}
    summary = {f"{args.model}/layer/M{m}/{f}_over_bf16": round(layer["bf16"][m] / layer[f][m], 3)
               for m in args.m for f in timed if f != "bf16"} if "bf16" in timed else {}
    prov = sc.provenance()  # gpu, git_sha (QERL_GIT_SHA on a copy without .git), date, versions
    prov["env"]["mma_in_flight"] = kernels.MMA_IN_FLIGHT
    out = dict(
        what=f"{args.model} decoder layer (sum of its seven linears), {args.fmt}, microseconds a layer per family",
        command="python -m benchmarks.kernel_families " + " ".join(argv if argv is not None else sys.argv[1:]),
        **prov, ws_configs=EXTRA_WS, mma_configs=EXTRA_MMA, failed_check={f: v for f, v in bad.items() if v},
        layer_us={f: {str(m): round(v, 2) for m, v in layer[f].items()} for f in timed},
        winner={str(m): f for m, f in winners.items()}, summary=summary)
    path = sc.write_json(out, args.out, f"{prov['gpu']}_families")
    print(f"{'M':>4} " + " ".join(f"{f:>10}" for f in timed) + "  winner")
    for m in args.m:
        print(f"{m:>4} " + " ".join(f"{layer[f][m]:10.1f}" for f in timed) + f"  {winners[m]}")
    print(f"wrote {path}")
    print(json.dumps(dict(winner=out["winner"], failed_check=out["failed_check"], env=out["env"])))
    return out


if __name__ == "__main__":
    main()
