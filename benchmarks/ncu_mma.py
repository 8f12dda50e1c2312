"""One fp4_mma launch (or bf16 cuBLAS) for Nsight Compute to profile (issue 14: what bounds a shape).

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats -k regex:_mma_kernel --launch-skip 8 --launch-count 1 \\
        python -m benchmarks.ncu_mma --n 18944 --k 3584 --m 64 [--cfg '{"BM": 64, ...}'] [--split 2]

Runs the call ten times; the kernel's self-tests launch it up to four times before, so ``--launch-skip 8``
catches a warm call of this shape. ``--bf16``
runs ``F.linear`` on a bf16 weight instead (profile with ``-k regex:gemm|gemv``).
"""

import argparse
import json

import torch
import torch.nn.functional as F

from qerl import formats
from qerl.kernels import fp4_mma


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--cfg", default=None, help="launch config as JSON (default: the rule's)")
    ap.add_argument("--split", type=int, default=None)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(a.n, a.k, device="cuda") * 0.02
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    if a.bf16:
        wb = w.bfloat16()
        for _ in range(10):
            F.linear(x, wb)
    else:
        t = formats.quantize(w, "nvfp4")
        pc, sc = fp4_mma.to_compute_layout(t["weight_packed"], t["weight_scale"], True)
        cfg = json.loads(a.cfg) if a.cfg else None
        for _ in range(10):
            y = fp4_mma.linear(x, pc, sc, t["weight_global_scale"], a.n, a.k, True, config=cfg, split_k=a.split)
        ref = x.float() @ formats.dequantize(t, "nvfp4", dtype=torch.float32).T
        err = float((y.float() - ref).norm() / ref.norm())
        print(f"ncu_mma N={a.n} K={a.k} M={a.m} cfg={cfg} split={a.split}: relative error {err:.2e}", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
