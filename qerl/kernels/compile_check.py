"""Compile the decode step's kernels for sm_90 with the installed Triton, on a machine without a GPU.

Each launch helper (the fused norms, rotary, SiLU, LoRA A / B, split attention, the sampler, the mma kernel
in its mma.sync and warpgroup-MMA forms, the warp-specialised kernel) is called on CPU tensors with
programmatic dependent launch on; the launch is compiled for sm_90 instead of run. Checks, per kernel:
- it compiles (a Triton whose Gluon API moved fails here, before any GPU time);
- it was launched with PDL, and in its PTX ``griddepcontrol.wait`` comes before the first global load,
  store, atomic and asynchronous copy (qerl.kernels.common: a PDL launch must wait before it reads);
- for the 4-bit kernels, the SASS of the main loop (the innermost loop that holds the decode's bf16x2
  multiplies), counted per 8 weights: all of it, and the decode's instructions (LOP3, SHF, IMAD.SHL,
  PRMT, LEA and the multiplies). Each multiply scales 2 weights, so the counts need no shape.

    python -m qerl.kernels.compile_check      # exit 1 if a kernel fails; needs Triton with its bundled ptxas
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

from qerl.kernels import attention, common, fused, mma, sampling, warpspec

OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")
# global memory touched: loads, stores, atomics, cp.async / TMA copies
GLOBAL_ACCESS = re.compile(r"\b(ld\.global|st\.global|atom\.global|red\.global|cp\.async)")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
DECODE_OPS = ("LOP3", "SHF", "IMAD.SHL", "PRMT", "LEA", "HMUL2", "HFMA2")


def _cuobjdump() -> str | None:
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for tool in (here, shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if tool and os.path.exists(tool):
            return tool
    return None


def loop_counts(sass: str) -> dict | None:
    """Instructions per 8 weights in the innermost SASS loop that holds bf16x2 multiplies (the decode's):
    {"loop": all of them, "decode": LOP3 + SHF + IMAD.SHL + PRMT + LEA + the multiplies, "ops": by opcode,
    "bars": the loop's CTA barriers (BAR instructions, not per 8 weights)};
    None if no loop holds any."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in SASS_LINE.finditer(sass)]
    best = None
    for a, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target is None or int(target.group(1), 16) > a:
            continue  # not a backward branch
        body = [o for b, o, _ in ins if int(target.group(1), 16) <= b <= a]
        muls = sum(1 for o in body if o.startswith(("HMUL2", "HFMA2")) and "BF16" in o)
        if muls and (best is None or len(body) < len(best[0])):
            best = (body, muls)
    if best is None:
        return None
    body, muls = best
    per = 8 / (2 * muls)
    ops = collections.Counter("IMAD.SHL" if o.startswith("IMAD.SHL") else o.split(".")[0] for o in body)
    return {"loop": len(body) * per, "decode": sum(ops[k] for k in DECODE_OPS) * per,
            "ops": {k: v * per for k, v in ops.most_common()}, "bars": ops["BAR"]}


def sass_counts(cubin: bytes) -> dict | None:
    """``loop_counts`` of a compiled kernel (its cubin through cuobjdump) and its registers a thread ("regs");
    None without cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    counts = loop_counts(sass)
    regs = re.search(r"REG:(\d+)", usage)
    if counts is not None:
        counts["regs"] = int(regs.group(1)) if regs else None
    return counts


def _compile(fn, args, kw) -> tuple[str, bool, dict | None]:
    """Compile one captured launch for sm_90; (name, whether PDL is on and its wait comes first, the SASS
    loop counts of a 4-bit kernel or None)."""
    params = fn.params
    given = dict(zip([p.name for p in params], args))
    given.update({k: v for k, v in kw.items() if k not in OPTIONS})
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = given.get(p.name, kw.get(p.name, p.default))
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
            continue
        sig[p.name] = "i1" if isinstance(v, bool) else mangle_type(v)
        if isinstance(v, torch.Tensor) or (type(v) is int and v and v % 16 == 0):  # as the JIT specialises
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {k: kw[k] for k in OPTIONS if k in kw}
    source = ASTSource
    if mma.HAVE_GLUON:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

        if isinstance(fn, GluonJITFunction):
            source = GluonASTSource
            opts["num_warps"] = const.get("num_warps", opts.get("num_warps", 4))
    k = triton.compile(source(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    ptx = k.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    wait = body.find("griddepcontrol.wait")
    first = GLOBAL_ACCESS.search(body)
    ok = bool(const.get("PDL")) and bool(k.metadata.launch_pdl) and wait >= 0 and (first is None or wait < first.start())
    counts = sass_counts(k.asm["cubin"]) if "ASM" in const else None
    label = fn.fn.__name__ + (f" BM={const['BM']}" if "BM" in const else "") + (" X_DIRECT" if const.get("X_DIRECT") else "")
    return label, ok, counts


@contextlib.contextmanager
def _compiling(results: list):
    """kernel[grid](...) compiles for sm_90 (appending (name, ok) to results) instead of launching."""
    classes = [JITFunction]
    if mma.HAVE_GLUON:
        from triton.experimental.gluon._runtime import GluonJITFunction

        classes.append(GluonJITFunction)
    saved = [(c, c.__dict__.get("__getitem__")) for c in classes]

    def getitem(self, grid):
        return lambda *args, **kw: results.append(_compile(self, args, kw))

    pdl = common.pdl
    common.pdl = lambda device: True
    try:
        for c in classes:
            c.__getitem__ = getitem
        yield
    finally:
        common.pdl = pdl
        for c, f in saved:
            if f is None:
                del c.__getitem__
            else:
                c.__getitem__ = f


def launches() -> None:
    """Every decode-step kernel once, on CPU tensors of small shapes (the 4-bit ones at a 7B layer's)."""
    bf = torch.bfloat16
    M, K, N, R = 4, 256, 384, 32
    x = torch.randn(M, K, dtype=bf)
    w = torch.ones(K, dtype=bf)
    As = [torch.randn(R, K) for _ in range(3)]
    fused._norm_launch(x, x, w, 1e-6, torch.empty_like(x), torch.empty_like(x))
    fused._norm_launch(x, x, w, 1e-6, torch.empty_like(x), torch.empty_like(x), As, torch.empty(M, 3 * R))
    fused.lora_a(x, As)
    fused.lora_a(torch.randn(64, K, dtype=bf), As)
    ys = [torch.randn(M, N, dtype=bf) for _ in range(3)]
    Bs = [torch.randn(N, R) for _ in range(3)]
    h = torch.randn(1, M, 3 * R)
    fused.lora_out(ys, h, Bs, [], 2.0)
    fused.lora_silu_mul(ys[0], ys[1], h, Bs[:2], [], 2.0)
    fused.lora_silu_mul_lora_a(ys[0], ys[1], h, Bs[:2], [], 2.0, torch.randn(R, N))
    fused.silu_mul(ys[0], ys[1])
    D, NH, NKV, L = 64, 8, 2, 512
    q, kv = torch.randn(M, NH * D, dtype=bf), torch.randn(M, NKV * D, dtype=bf)
    cache, cpos = torch.empty(M, NKV, L, D, dtype=bf), torch.zeros(1, dtype=torch.long)
    cs = torch.randn(M, D, dtype=bf)
    fused.rope_cache_write(q, kv, kv, cs, cs, cache, cache.clone(), cpos, None, None, 1e-6)
    fused.lora_rope_cache_write(q, kv, kv, torch.randn(1, M, 3 * R), [torch.randn(n * D, R) for n in (NH, NKV, NKV)],
                                [], 2.0, cs, cs, cache, cache.clone(), cpos, None, None, 1e-6)
    attention.decode_attention(q.view(M, NH, D), cache, cache, torch.ones(M, L, dtype=torch.bool), cpos, 0.125)
    attention.decode_attention_lora_a(q.view(M, NH, D), cache, cache, torch.ones(M, L, dtype=torch.bool), cpos, 0.125,
                                      torch.randn(R, NH * D))
    sampling.gumbel_argmax(torch.randn(M, 1000), torch.zeros(M, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    if not mma.HAVE_GLUON:
        return
    Nw = Kw = 3584  # the compute layout of a 7B q/o weight
    pc = torch.empty(Nw // 16, Kw // 64, 512, dtype=torch.uint8)
    sc = torch.empty(Nw // 16, Kw // 64, 128, dtype=torch.uint8)
    gs = torch.ones(1)
    for m, wgmma, extra in ((4, False, {}), (4, False, {"X_DIRECT": True, "KB": 1, "REPS": 2}),
                            (16, False, {"X_DIRECT": True, "KB": 1}),
                            (32, False, {}), (96, True, {})):
        xm = torch.randn(m, Kw, dtype=bf)
        mma.grouped_linear(xm, [(pc, sc, gs, Nw)], Kw, True, [torch.empty(m, Nw, dtype=bf)],
                           config={**mma.pick_config(m, Nw, Kw, wgmma), **extra})
    if getattr(warpspec, "HAVE_WS", False):
        for m in (24, 48, 128):
            xm = torch.randn(m, Kw, dtype=bf)
            warpspec.linear(xm, pc, sc, gs, Nw, Kw, True, out=torch.empty(m, Nw, dtype=bf))
        # one launch over a group (q/k/v: a wide weight and two narrow ones)
        kv_pc, kv_sc = pc[: 512 // 16], sc[: 512 // 16]
        for m in (48, 128):
            xm = torch.randn(m, Kw, dtype=bf)
            warpspec.grouped_linear(xm, [(pc, sc, gs, Nw), (kv_pc, kv_sc, gs, 512), (kv_pc, kv_sc, gs, 512)], Kw,
                                    True, [torch.empty(m, n, dtype=bf) for n in (Nw, 512, 512)])


def main() -> int:
    if common.INTERPRETED:
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    results: list = []
    with _compiling(results):
        launches()
    for name, ok, counts in results:
        sass = "" if counts is None else (f"   SASS per 8 weights: loop {counts['loop']:.1f}, decode {counts['decode']:.1f}"
                                          f"; {counts['regs']} registers, {counts['bars']} CTA barriers in the loop")
        print(f"{name:24s} {'ok' if ok else 'PDL launch without its wait first'}{sass}")
    bad = [n for n, ok, _ in results if not ok]
    print(f"Triton {triton.__version__}: {len(results)} launches compiled for sm_90, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
