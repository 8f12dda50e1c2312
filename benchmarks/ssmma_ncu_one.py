"""One launch of qerl.kernels.ssmma's kernel (CFG, JSON) on the Qwen2.5-7B gate shape at M = 2048, for Nsight
Compute (benchmarks/ssmma_ncu.sh)."""

import json
import os

import torch

from qerl import formats
from qerl.kernels import layout, ssmma


def main():
    cfg = json.loads(os.environ.get("CFG", '{"SP": 1, "BN": 256, "STAGES": 4}'))
    n, k, m = 18944, 3584, 2048
    dev = torch.device("cuda")
    t = formats.quantize(torch.randn(n, k, device=dev) * 0.02, "nvfp4")
    pc, sc = layout.to_compute_layout(t["weight_packed"], t["weight_scale"], True)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        ssmma.linear(x, pc, sc, t["weight_global_scale"], n, k, True, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
