"""Probe: the decoded-tile-in-shared-memory kernels of qerl.kernels.ssmma against bf16 cuBLAS and the
production dispatch on a Qwen2.5-7B decoder layer (its seven linears, random weights), after a check of
every config against the fp32 reference (both formats, ragged shapes, bitwise repeat).

    CFGS='[{"SP": 1, "BN": 256, "STAGES": 4}]' python -m benchmarks.ssmma_probe 128 256 512 1024 2048

Prints one line per M (us a layer, and bf16 time / each) and writes $OUT/ss_dev.json.
"""

import json
import os
import sys
import time

import torch

from benchmarks.bench_kernels import time_graph
from qerl import formats, kernels
from qerl.kernels import layout, ssmma

SHAPES = {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "o": (3584, 3584), "gate": (18944, 3584),
          "up": (18944, 3584), "down": (3584, 18944)}


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    cfgs = json.loads(os.environ.get("CFGS", '[{"BN": 128}, {"BN": 256}]'))

    def mk(n, k, fmt="nvfp4"):
        t = formats.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, fmt)
        pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], fmt == "nvfp4")
        return t, pc, sc

    bad, t0 = 0, time.time()
    for cfg in cfgs:
        for fmt in ("nvfp4", "mxfp4"):
            for n, k in [(200, 320), (3584, 3584), (512, 3584), (3584, 18944), (1000, 1088)]:
                t, pc, sc = mk(n, k, fmt)
                w = formats.dequantize(t, fmt, dtype=torch.float32)
                for m in [1, 64, 128, 200, 1024]:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
                    y, y2 = (ssmma.linear(x, pc, sc, t.get("weight_global_scale"), n, k, fmt == "nvfp4",
                                          config=cfg).float() for _ in range(2))
                    ref = x.float() @ w.T
                    err = float((y - ref).norm() / ref.norm())
                    if not (err < 5e-3 and torch.equal(y, y2)):
                        bad += 1
                        print(f"{cfg} {fmt} N{n} K{k} M{m} err {err:.2e} repeat {torch.equal(y, y2)} BAD", flush=True)
    print("correctness failures:", bad, "in", round(time.time() - t0), "s", flush=True)

    copies = 2
    wq = {n: [mk(*s) for _ in range(copies)] for n, s in SHAPES.items()}
    wb = {n: [torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)] for n, s in SHAPES.items()}
    res = {}
    for m in [int(a) for a in sys.argv[1:]] or [128, 256, 512, 1024, 2048]:
        xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (3584, 18944)}
        caches = {n: [dict() for _ in range(copies)] for n in SHAPES}
        def layer(one, xs=xs, caches=caches):
            return lambda: [one(xs[s[1]], n, c, s, caches[n][c]) for n, s in SHAPES.items() for c in range(copies)]

        fns = {"bf16": layer(lambda x, n, c, s, cache: torch.matmul(x, wb[n][c].T)),
               "qerl": layer(lambda x, n, c, s, cache: kernels.linear(x, "nvfp4", wq[n][c][0], s[0], s[1], cache=cache))}
        for i, cfg in enumerate(cfgs):
            fns[f"ss{i}"] = layer(lambda x, n, c, s, cache, cfg=cfg: ssmma.linear(
                x, wq[n][c][1], wq[n][c][2], wq[n][c][0]["weight_global_scale"], s[0], s[1], True, config=cfg,
                cache=cache))
        row = {key: time_graph([fn])[0] * 1e6 / copies for key, fn in fns.items()}
        res[m] = row
        print(f"M{m}", {k: round(v, 1) for k, v in row.items()}, {k: round(row["bf16"] / v, 3) for k, v in row.items()},
              flush=True)
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(cfgs=cfgs, res=res, gpu=torch.cuda.get_device_name()), open(os.path.join(out, "ss_dev.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
