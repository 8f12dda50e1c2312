"""Host time of one kernel launch, split by layer (issue 18: eager calls at M = 1). GPU tool.

Times 2000 back-to-back eager calls (no synchronisation; best of 3 rounds) of: F.linear; QuantLinear
nvfp4 and its plan; a Triton launch of an empty kernel with 16 arguments through ``kernel[grid](...)``;
the same compiled kernel through its launcher directly (``CompiledKernel.run``, what ``JITFunction.run``
calls after binding and the cache lookup); torch.empty; the current-stream query. Prints a table and
writes <out>/launch_probe.json.

    python -m benchmarks.launch_probe --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qerl.kernels import fp4
from qerl.qlinear import QuantLinear


@triton.jit
def _noop16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n, k, s0, s1, A: tl.constexpr, B: tl.constexpr):
    pass


def per_call_us(f, calls: int = 2000, rounds: int = 3) -> float:
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    n, k = 1024, 4096
    q = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), "nvfp4")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    t = q.packed_tensors()
    plan = fp4.Plan(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], True)
    bufs = [torch.empty(16, device="cuda") for _ in range(12)]
    args16 = [*bufs, 7, 9, 3, 5]
    compiled = _noop16[(64, 2)](*args16, A=1, B=2, num_warps=4)
    stream = torch.cuda.current_stream().cuda_stream
    all_args = (*args16, 1, 2)

    def direct():
        compiled.run(64, 2, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *all_args)

    def direct_stream():
        s = torch.cuda.current_stream().cuda_stream
        compiled.run(64, 2, 1, s, compiled.function, compiled.packed_metadata, None, None, None, *all_args)

    fns = {"F.linear": lambda: F.linear(x, w), "QuantLinear nvfp4": lambda: q(x), "plan.linear": lambda: plan.linear(x),
           "triton kernel[grid] (16 args)": lambda: _noop16[(64, 2)](*args16, A=1, B=2, num_warps=4),
           "CompiledKernel.run (16 args)": direct, "CompiledKernel.run + stream query": direct_stream,
           "torch.empty": lambda: torch.empty((1, n), dtype=x.dtype, device=x.device),
           "current stream query": lambda: torch.cuda.current_stream().cuda_stream}
    res = {}
    for name, f in fns.items():
        try:
            res[name] = per_call_us(f)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            res[name] = None
        print(f"{name:36s} {res[name] if res[name] is None else round(res[name], 2)} us/call", flush=True)
    Path(a.out, "launch_probe.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), us_per_call=res,
                                                                triton=triton.__version__), indent=1))


if __name__ == "__main__":
    main()
