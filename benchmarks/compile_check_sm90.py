"""Compile qerl's tensor-core fp4 kernels for sm_90 on a machine without a GPU (one config per call).

Catches Triton compile failures (e.g. "PassManager::run failed" in TritonGPUOptimizeDotOperands)
before spending GPU time. Needs the Triton version of the GPU machine on sys.path (3.6 there):
  pip download --no-deps triton==3.6.0 ... ; unzip into /tmp/t36
  PYTHONPATH=/tmp/t36 python -m benchmarks.compile_check_sm90 bwd \\
      '{"BLOCK_M":128,"BLOCK_K":64,"BLOCK_R":64,"num_warps":4,"num_stages":4}' '*fp32'
Arguments: kind (dot | bwd), the launch config as JSON, the activation pointer type (*bf16 or *fp32).
Prints OK with the shared memory in bytes, or the compiler's error.
"""

import json
import sys

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qerl.kernels import fp4  # noqa: E402


def main() -> None:
    kind, cfg = sys.argv[1], json.loads(sys.argv[2])
    act = sys.argv[3] if len(sys.argv) > 3 else "*bf16"
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    if kind == "bwd":
        fn = fp4._bwd_dot_kernel
        sig = dict(dy_ptr=act, w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", dx_ptr=act, M="i32", N="i32", K="i32",
                   stride_dym="i32", stride_dxm="i32")
        consts = dict(IS_NV=True, GROUP_M=8, F32_DOT=False, **cfg)
    elif kind == "dot":
        fn = fp4._fwd_dot_kernel
        sig = dict(x_ptr=act, w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", out_ptr=act, ws_ptr="*fp32", cnt_ptr="*i32",
                   M="i32", N="i32", K="i32", stride_xm="i32", stride_om="i32", tiles_per_split="i32")
        consts = dict(IS_NV=True, EVEN_K=True, F32_DOT=False, **cfg)
    else:
        raise SystemExit(f"kind must be dot or bwd, got {kind!r}")
    sig.update({name: "constexpr" for name in consts})
    # pointers and the strides / sizes a real launch has as multiples of 16 (else nothing vectorises)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name.startswith("stride") or name in ("N", "K")}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    print("OK", kind, act, cfg, "shared", compiled.metadata.shared)


if __name__ == "__main__":
    main()
