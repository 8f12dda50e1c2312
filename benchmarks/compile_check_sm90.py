"""Compile qerl's tensor-core fp4 kernels for sm_90 on a machine without a GPU (one config per call).

Catches Triton compile failures (e.g. "PassManager::run failed" in TritonGPUOptimizeDotOperands)
before spending GPU time. Needs the Triton version of the GPU machine on sys.path (3.6 there):
  pip download --no-deps triton==3.6.0 ... ; unzip into /tmp/t36
  PYTHONPATH=/tmp/t36 python -m benchmarks.compile_check_sm90 bwd \\
      '{"BLOCK_M":128,"BLOCK_K":64,"BLOCK_R":64,"num_warps":4,"num_stages":4}' '*fp32'
Arguments: kind (dot | bwd | mma), the launch config as JSON, the activation pointer type (*bf16 or *fp32).
Prints OK with the shared memory in bytes, or the compiler's error. ``mma`` compiles the Gluon kernel of
qerl.kernels.mma (config keys BM, KB, REPS, NM, PREFETCH, IS_NV, num_warps) and also prints its
registers a thread, its global loads (128-bit ones), mma instructions and shared-memory accesses,
which show whether a layout conversion went through shared memory:
  PYTHONPATH=/tmp/t36 python -m benchmarks.compile_check_sm90 mma '{"BM":8,"KB":4,"REPS":1}'
"""

import json
import sys

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qerl.kernels import dot  # noqa: E402


def main() -> None:
    kind, cfg = sys.argv[1], json.loads(sys.argv[2])
    act = sys.argv[3] if len(sys.argv) > 3 else "*bf16"
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 1)
    if kind == "bwd":
        fn = dot._bwd_dot_kernel
        sig = dict(dy_ptr=act, w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", dx_ptr=act, M="i32", N="i32", K="i32",
                   stride_dym="i32", stride_dxm="i32")
        consts = dict(IS_NV=True, GROUP_M=8, F32_DOT=False, **cfg)
    elif kind == "dot":
        fn = dot._fwd_dot_kernel
        sig = dict(x_ptr=act, w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", out_ptr=act, ws_ptr="*fp32", cnt_ptr="*i32",
                   M="i32", N="i32", K="i32", stride_xm="i32", stride_om="i32", tiles_per_split="i32")
        consts = dict(IS_NV=True, EVEN_K=True, F32_DOT=False, **cfg)
    elif kind == "mma":
        return check_mma(cfg, warps)
    else:
        raise SystemExit(f"kind must be dot, bwd or mma, got {kind!r}")
    sig.update({name: "constexpr" for name in consts})
    # pointers and the strides / sizes a real launch has as multiples of 16 (else nothing vectorises)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name.startswith("stride") or name in ("N", "K")}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    print("OK", kind, act, cfg, "shared", compiled.metadata.shared)


def check_mma(cfg: dict, warps: int) -> None:
    import re

    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl.kernels import mma

    sig = dict(x_ptr="*bf16")
    for i in range(3):
        sig.update({f"w{i}": "*u8", f"s{i}": "*u8", f"g{i}": "*fp32", f"o{i}": "*bf16"})
    sig.update(ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N0="i32", N1="i32", N2="i32", T0="i32", T1="i32", K="i32",
               NB_K="i32", stride_xm="i32", iters_per_split="i32", MT="i32")
    nv = cfg.pop("IS_NV", True)
    consts = dict(IS_NV=nv, NM=cfg.pop("NM", 1), BM=cfg.pop("BM", 8), REPS=cfg.pop("REPS", 1), KB=cfg.pop("KB", 4),
                  ASM=mma._ASM_NV if nv else mma._ASM_MX, PREFETCH=cfg.pop("PREFETCH", False),
                  STAGES=cfg.pop("STAGES", 2), WGMMA=cfg.pop("WGMMA", False), W_RING=cfg.pop("W_RING", False),
                  num_warps=warps)
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name in ("stride_xm", "K")}
    c = triton.compile(GluonASTSource(mma._mma_kernel, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = c.asm["ptx"]
    regs = "?"
    try:  # registers a thread, from the cubin (the cuobjdump that ships with Triton)
        import os
        import subprocess
        import tempfile

        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+)", res)
            regs = m.group(1) if m else "?"
            m = re.search(r"STACK:(\d+)", res)
            regs += f" (stack {m.group(1)} bytes)" if m else ""
            if os.environ.get("SASS_OUT"):  # the machine code, for instruction counts of the loop
                dis = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
                with open(os.environ["SASS_OUT"], "w") as fo:
                    fo.write(dis)
                with open(os.environ["SASS_OUT"] + ".ptx", "w") as fo:
                    fo.write(ptx)
    except (OSError, KeyError):
        pass
    print("OK mma", {k: v for k, v in consts.items() if k != "ASM"}, "shared", c.metadata.shared,
          "registers", regs,
          "| ld.global", len(re.findall(r"ld\.global", ptx)), "(v4:", len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
          ") mma.sync", ptx.count("mma.sync"), "wgmma", ptx.count("wgmma.mma_async"), "cp.async",
          ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "ldmatrix", ptx.count("ldmatrix"), "st.shared",
          ptx.count("st.shared"), "ld.shared", ptx.count("ld.shared"), "shfl", ptx.count("shfl"))


if __name__ == "__main__":
    main()
