"""The grouped q/k/v and gate/up launches of the fused decode step, side by side in one run (GPU, sm_90,
Triton >= 3.7): one grouped launch of the mma kernel, one warp-specialised launch over the group, and one
warp-specialised launch a weight (the form before the grouped one).

Times the 7B layer as the decode step runs it (``bench_kernels.grouped_layer``: q/k/v, o, gate/up, down)
at each M under each setting of ``qerl.kernels.GROUPED_WARPSPEC_MIN_M``, with bf16 cuBLAS in the same run.
Writes results/kernels/<gpu>_grouped_rule.json (env: torch, Triton, GPU, git sha, date).

Run:   python -m benchmarks.grouped_rule --m 64 96 128 192 256
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import speed_common as sc
from benchmarks.bench_kernels import grouped_layer
from qerl import kernels


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--m", nargs="+", type=int, default=[32, 64, 96, 128, 192, 256])
    ap.add_argument("--out", default="results/kernels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: grouped_rule needs a CUDA GPU")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rule, door = kernels.GROUPED_WARPSPEC_MIN_M, kernels.grouped_linear

    def per_weight(x, weights):  # the form before the group launch: the door once a weight
        return [door(x, [w])[0] for w in weights]

    layer_us = {}
    try:
        for name, from_m, form in (("grouped_mma", 1 << 30, door), ("warpspec_group", 0, door),
                                   ("warpspec_per_weight", 0, per_weight)):
            kernels.GROUPED_WARPSPEC_MIN_M, kernels.grouped_linear = from_m, form
            layer_us[name] = {str(m): [round(v, 2) for v in t] for m, t in grouped_layer(l2, tuple(args.m)).items()}
    finally:
        kernels.GROUPED_WARPSPEC_MIN_M, kernels.grouped_linear = rule, door
    prov = sc.provenance()
    prov["env"]["mma_in_flight"] = kernels.MMA_IN_FLIGHT
    out = dict(what="qwen2.5-7b layer as the fused decode step runs it, us: [bf16 cuBLAS, nvfp4] per M",
               command="python -m benchmarks.grouped_rule " + " ".join(argv if argv is not None else sys.argv[1:]),
               **prov, rule_from_m=rule, layer_us=layer_us)
    path = sc.write_json(out, args.out, f"{prov['gpu']}_grouped_rule")
    for m in args.m:
        row = {k: v.get(str(m)) for k, v in layer_us.items()}
        print(f"M {m:>4}: " + ", ".join(f"{k} {v[1]:.1f} us (bf16 {v[0]:.1f})" for k, v in row.items() if v))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
