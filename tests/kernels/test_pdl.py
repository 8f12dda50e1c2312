"""Programmatic dependent launch (qerl.kernels.common.pdl_args): a kernel launched with ``launch_pdl=True`` may
start before the kernel ahead of it has finished, so its first statement must be the grid-dependency wait.

CPU: every kernel that takes the PDL constexpr waits first, in its source and in the PTX the installed Triton
makes for sm_90 (qerl.kernels.compile_check, which also catches a Gluon API that moved), and PDL is off without
an sm_90 GPU. GPU: a decode that runs every such kernel (norms, LoRA, rotary, split attention, the 4-bit kernels
at 1-40 rows, the sampler) gives the same bits with PDL on and off (tests/test_fused.py::test_pdl_gives_the_same_bits).
"""

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from qerl.kernels import attention, common, fused, mma, sampling, warpspec


def _kernels_with_pdl():
    found = {}
    for mod in (fused, attention, sampling, mma, warpspec):
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if callable(fn) and "PDL" in getattr(obj, "arg_names", ()) and fn.__name__ != "pdl_enter":
                found[f"{mod.__name__}.{name}"] = fn
    return found


def _first_statement(fn):
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    return body[0]


def test_every_pdl_kernel_waits_first():
    found = _kernels_with_pdl()
    names = {n.rsplit(".", 1)[1] for n in found}
    expected = {"_add_rmsnorm_kernel", "_rope_cache_kernel", "_silu_mul_kernel", "_lora_a_kernel",
                "_lora_a_tiled_kernel", "_lora_out_kernel", "_decode_attn_kernel", "_gumbel_argmax_kernel"}
    if mma.HAVE_GLUON:
        expected.add("_mma_kernel")
    if getattr(warpspec, "HAVE_WS", False):
        expected.add("_ws_kernel")
    assert expected <= names, expected - names
    for name, fn in found.items():
        st = _first_statement(fn)
        call = st.value if isinstance(st, ast.Expr) else None
        assert isinstance(call, ast.Call), f"{name}: the first statement is not pdl_enter(PDL)"
        callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
        assert callee in ("pdl_enter", "_pdl_enter") and [a.id for a in call.args] == ["PDL"], \
            f"{name}: the first statement is {ast.unparse(st)!r}, not pdl_enter(PDL)"
        assert inspect.signature(fn).parameters["PDL"].default is False, f"{name}: PDL must default to False"


def test_every_pdl_launch_names_a_waiting_kernel():
    """Each launch that passes pdl_args launches a kernel of _kernels_with_pdl (read from the source)."""
    waiting = {n.rsplit(".", 1)[1] for n in _kernels_with_pdl()}
    sites = 0
    for mod in (fused, attention, sampling, mma, warpspec):
        tree = ast.parse(inspect.getsource(mod))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            kws = [k for k in node.keywords if k.arg is None and isinstance(k.value, ast.Call)
                   and getattr(k.value.func, "attr", getattr(k.value.func, "id", None)) == "pdl_args"]
            if not kws:
                continue
            sites += 1
            f = node.func
            if isinstance(f, ast.Subscript):  # kernel[grid](...)
                name = f.value.id if isinstance(f.value, ast.Name) else f.value.attr
            else:  # dict(..., **pdl_args(...)): kwargs for a described launch of the module's kernel
                name = {"mma": "_mma_kernel"}.get(mod.__name__.rsplit(".", 1)[1])
            assert name in waiting, f"{mod.__name__}: a launch with pdl_args of {name}, which does not wait first"
    assert sites >= 10


def test_pdl_off_without_an_sm90_gpu():
    assert common.pdl_args(torch.device("cpu")) == {}
    if common.INTERPRETED:
        assert not common.PDL
    if torch.cuda.is_available():
        on = common.PDL and torch.cuda.get_device_capability(0)[0] >= 9
        assert common.pdl_args(torch.device("cuda", 0)) == ({"PDL": True, "launch_pdl": True} if on else {})


def _ptxas_available() -> bool:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or bool(os.environ.get("TRITON_PTXAS_PATH"))


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's NVIDIA backend with ptxas is not installed")
def test_kernels_compile_for_sm90_with_the_wait_first():
    """Every decode-step kernel (the 4-bit mma and warp-specialised ones included) compiles for sm_90 with the
    installed Triton, launched with PDL, and waits before its first global access in the PTX."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "qerl.kernels.compile_check"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr[-4000:]
    assert r.returncode == 0, out
    assert " 0 failed" in r.stdout and "_mma_kernel" in r.stdout and "_decode_attn_kernel" in r.stdout, out


def test_sass_loop_counts_read_the_innermost_decode_loop():
    """compile_check.loop_counts on a hand-written listing: the outer loop's extra instructions and the
    code outside any loop are not counted; 2 bf16x2 multiplies are 4 weights, so per 8 weights x2."""
    from qerl.kernels.compile_check import loop_counts

    lines = ["/*0000*/ MOV R1, c[0x0][0x28] ;", "/*0010*/ IMAD R2, R1, 0x4, RZ ;"]
    body = ["SHF.L.W.U32 R4, R3, 0x3, R3", "LOP3.LUT R4, R4, 0x81c081c0, RZ, 0xc0, !PT",
            "HMUL2.BF16_V2 R5, R4, R6.H0_H0", "HMUL2.BF16_V2 R7, R4, R6.H1_H1", "HGMMA.64x64x16.F32.BF16 R8, R4, gdesc[UR4]",
            "ISETP.NE.AND P0, PT, R9, RZ, PT"]
    addr = 0x20
    for op in body:
        lines.append(f"/*{addr:04x}*/ {op} ;")
        addr += 0x10
    lines.append(f"/*{addr:04x}*/ @P0 BRA 0x20 ;")  # the inner loop: 7 instructions
    lines.append(f"/*{addr + 0x10:04x}*/ IADD3 R10, R10, 0x1, RZ ;")
    lines.append(f"/*{addr + 0x20:04x}*/ @P1 BRA 0x10 ;")  # an outer loop around it
    c = loop_counts("\n".join(lines))
    assert c["loop"] == 14 and c["decode"] == 8  # (SHF + LOP3 + 2 HMUL2) x 2
    assert c["ops"]["HGMMA"] == 2 and c["ops"]["BRA"] == 2
    assert loop_counts("/*0000*/ MOV R1, R2 ;") is None
