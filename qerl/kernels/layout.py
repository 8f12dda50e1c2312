"""The compute layout of the tensor-core FP4 kernel (qerl.kernels.mma), its exact inverse and reference.

The compressed-tensors layout (``weight_packed`` [N, K/2], ``weight_scale`` [N, K/B]) keeps each
row's bytes in K order. A tensor-core kernel wants instead each lane's ``mma.m16n8k16`` fragment in
one vector load. ``to_compute_layout`` rewrites a weight (once: the first small-M call that needs it
makes it and ``cached_layout`` keeps it in the module's kernel cache, beside the on-disk buffers,
which stay the module's state for export, ``state_dict``, AQN and the training kernels) into:

  - packed: uint8 [Np/16, Kp/64, 8 (g), 4 (c), 16]: for each 16-row x 64-column block, lane
    (g, c) of a warp reads 16 contiguous bytes: exactly its A fragments of ``mma.m16n8k16`` (and of
    the warpgroup ``wgmma``, whose register A operand has the same per-warp fragments) for the four
    16-column steps t of the block, in natural column order. Word t holds rows g + 8 h (h = 0, 1),
    columns 64 kb + 16 t + 8 q + 2 c + e; its nibble i (i < 4) is (h = i & 1, q = i >> 1, e = 0)
    and nibble i + 4 the same with e = 1, so that ``(w << s) & mask`` turns it into one bf16x2
    register of the fragment.
  - scales: uint8 [Np/16, Kp/64, 8 (g), 4 (t), 2 (h)]: the scale of row g + 8 h's weights of step t
    (its E4M3 block of 16; an E8M0 block covers two steps and is stored twice). The four lanes c of
    a row read the same 8 bytes. E4M3 scales are stored as t = ((F - 236) << 3) | mmm, F and mmm the
    exponent field and mantissa of the bf16 equal to the E4M3 scale times 2^119 (exact, every E4M3
    value), t = 0 for a zero scale; the kernel makes the bf16 with one multiply-add. E8M0 scales
    keep their byte.

K keeps its natural order: the activations are read as they are. Padding rows / columns are zero.
``from_compute_layout`` is the exact inverse (tests: bit for bit). ``decode_reference`` is the
weight the kernel multiplies by, computed the kernel's way in torch.
"""

from __future__ import annotations

import torch

KBLOCK = 64  # columns of a compute-layout block
RBLOCK = 16  # rows of a compute-layout block
T_OFFSET = 236  # bf16 exponent field of the NVFP4 scale byte's zero point (see the module docstring)
LAYOUT_CHUNK_ROWS = 1024  # rows to_compute_layout converts at a time (a multiple of RBLOCK)


def _pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


def e4m3_scale_code(scale_u8: torch.Tensor) -> torch.Tensor:
    """E4M3 scale bytes -> the compute layout's byte t (see the module docstring); uint8."""
    s = scale_u8.to(torch.int32)
    e, m = (s >> 3) & 0xF, s & 0x7
    # bf16 of E4M3 * 2^119: normal E4M3 (e >= 1): exponent e - 7 + 119 -> field e + 239, mantissa m;
    # subnormal (e == 0): m * 2^-9 * 2^119 = m * 2^110 -> normalise m (1..7)
    top = torch.where(m >= 4, 2, torch.where(m >= 2, 1, 0))  # floor(log2(m)) for m >= 1
    F = torch.where(e > 0, e + 239, 237 + top)
    mant = torch.where(e > 0, m, (m << (3 - top)) & 0x7)
    t = ((F - T_OFFSET) << 3) | mant
    zero = (s & 0x7F) == 0
    return torch.where(zero, 0, t).to(torch.uint8)


def e4m3_scale_from_code(t: torch.Tensor, sign: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``e4m3_scale_code`` (uint8 E4M3 bytes; sign: the original sign bits, 0 or 0x80)."""
    t = t.to(torch.int32)
    F, mant = (t >> 3) + T_OFFSET, t & 0x7
    e = torch.where(F >= 240, F - 239, 0)
    # subnormal: m * 2^(F - 237 ... ) -> m = (1.mant) >> (3 - (F - 237))
    sub = ((8 | mant) >> (3 - (F - 237).clamp(0, 3))) & 0x7
    m = torch.where(F >= 240, mant, sub)
    out = torch.where(t == 0, 0, (e << 3) | m)
    if sign is not None:
        out = out | sign.to(torch.int32)
    return out.to(torch.uint8)


def compute_layout_ok(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> str | None:
    """None if the weight has an exact compute layout, else why not (NaN scales; a zero scale with
    non-zero codes, which the kernel's t = 0 could not keep at zero)."""
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if is_nv:
        if bool(((s & 0x7F) == 0x7F).any()):
            return "NaN block scales"
        zero = (s & 0x7F) == 0
    else:
        if bool((s == 0xFF).any()):
            return "NaN block scales"
        zero = s == 0
        if bool((s > 190).any()):
            return "MXFP4 block scales above 2^63"
    if bool(zero.any()):
        B = 16 if is_nv else 32
        N, KH = packed.shape
        codes = packed.view(N, KH * 2 // B, B // 2)
        if bool(((codes != 0).any(-1) & zero).any()):
            return "zero block scales with non-zero codes"
    return None


def to_compute_layout(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) in the compute layout (see the module docstring), on packed's device."""
    N, KH = packed.shape
    K = 2 * KH
    Np, Kp = _pad_to(N, RBLOCK), _pad_to(K, KBLOCK)
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    B = 16 if is_nv else 32
    out = torch.empty(Np // 16, Kp // 64, 8, 4, 16, dtype=torch.uint8, device=packed.device)
    step = LAYOUT_CHUNK_ROWS  # rows at a time: the int32 codes are 8 bytes a weight while they exist
    for r0 in range(0, Np, step):
        r1 = min(r0 + step, Np)
        # codes [rows, Kp]: one uint8 per weight (padding: code 0)
        codes = torch.zeros(r1 - r0, Kp, dtype=torch.uint8, device=packed.device)
        src = packed[r0:min(r1, N)]
        codes[:src.shape[0], :K:2] = src & 0xF
        codes[:src.shape[0], 1:K:2] = src >> 4
        # [nb, h, g, kb, t, q, c, e] -> [nb, kb, g, c, t, nibble = (e, q, h)]
        nb = (r1 - r0) // 16
        c8 = codes.view(nb, 2, 8, Kp // 64, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 7, 5, 1)
        c8 = c8.reshape(nb, Kp // 64, 8, 4, 4, 8).to(torch.int32)  # nibble index i = 4 e + 2 q + h
        words = torch.zeros(c8.shape[:-1], dtype=torch.int32, device=packed.device)
        for i in range(8):
            words |= c8[..., i] << (4 * i)
        out[r0 // 16:r1 // 16] = words.view(torch.uint8).view(nb, Kp // 64, 8, 4, 16)
    # scales: block of columns 64 kb + 16 t ..
    code = e4m3_scale_code(s) if is_nv else s
    sp = torch.zeros(Np, Kp // B, dtype=torch.uint8, device=packed.device)
    sp[:N, :K // B] = code
    cols = (torch.arange(Kp // 64, device=packed.device)[:, None] * 64
            + torch.arange(4, device=packed.device)[None, :] * 16) // B  # [kb, c]
    st = sp[:, cols]  # [Np, kb, t]
    st = st.view(Np // 16, 2, 8, Kp // 64, 4).permute(0, 3, 2, 4, 1).contiguous()  # [nb, kb, g, t, h]
    return out, st


def from_compute_layout(packed_c: torch.Tensor, scales_c: torch.Tensor, N: int, K: int, is_nv: bool,
                        scale_sign: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact inverse of ``to_compute_layout``: (weight_packed uint8 [N, K/2], scale bytes uint8
    [N, K/B]). ``scale_sign``: NVFP4 scale sign bits to restore (the layout drops them; the
    quantizer writes none)."""
    nb, kb = packed_c.shape[:2]
    Np, Kp = nb * 16, kb * 64
    words = packed_c.contiguous().view(torch.int32).view(nb, kb, 8, 4, 4)
    c8 = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1)  # [nb, kb, g, c, t, i]
    c8 = c8.view(nb, kb, 8, 4, 4, 2, 2, 2)  # [nb, kb, g, c, t, e, q, h]
    codes = c8.permute(0, 7, 2, 1, 4, 6, 3, 5).reshape(Np, Kp)  # [nb, h, g, kb, t, q, c, e]
    packed = (codes[:N, :K:2] | (codes[:N, 1:K:2] << 4)).to(torch.uint8)
    B = 16 if is_nv else 32
    st = scales_c.permute(0, 4, 2, 1, 3).reshape(Np, kb * 4)  # [nb, h, g, kb, t] -> [Np, kb * 4]
    st = st[:, ::B // 16] if B > 16 else st
    st = st[:N, :K // B]
    if is_nv:
        st = e4m3_scale_from_code(st, scale_sign)
    return packed.contiguous(), st.contiguous()



def decode_reference(packed_c: torch.Tensor, scales_c: torch.Tensor, N: int, K: int, is_nv: bool,
                     gs: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] weight the kernel multiplies by, computed the kernel's way in torch (bf16 code *
    2^-126 times the scale's bf16, then the epilogue factor): for tests on any device."""
    nb, kb = packed_c.shape[:2]
    words = packed_c.contiguous().view(torch.int32).view(nb, kb, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF
    c8 = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1)  # [nb, kb, g, c, t, i = (e, q, h)]
    mag, neg = c8 & 0x7, (c8 & 0x8) != 0
    code = torch.where(mag >= 2, torch.exp2((mag >> 1).double() - 1) * (1 + (mag & 1) / 2), (mag & 1) * 0.5)
    code = torch.where(neg, -code, code)
    t = scales_c.to(torch.int64)  # [nb, kb, g, t, h]
    if is_nv:
        F, mant = (t >> 3) + T_OFFSET, t & 0x7
        sbf = torch.exp2(F.double() - 127) * (1 + mant / 8)  # the bf16 the kernel makes (t = 0 too)
        scale = sbf * 2.0 ** -119
    else:
        scale = torch.exp2(t.double() - 127)
    # weight (h, t, q, c, e) of lane (g, c): scale of (g, t, h)
    c8 = code.view(nb, kb, 8, 4, 4, 2, 2, 2)  # [nb, kb, g, c, t, e, q, h]
    w = c8 * scale[:, :, :, None, :, None, None, :]
    w = w.permute(0, 7, 2, 1, 4, 6, 3, 5).reshape(nb * 16, kb * 64)[:N, :K]
    if is_nv and gs is not None:
        w = w / float(gs)
    return w.float()



_CACHE_KEY = "compute_layout"


def weight_args(cache: dict, tensors: dict, is_nv: bool, out_features: int) -> tuple | None:
    """(packed_c, scales_c, global scale or None, N) of one weight for ``mma.linear`` / ``mma.grouped_linear``,
    from its packed tensors (by their on-disk names) and its kernel cache; None without a layout."""
    cl = cached_layout(cache, tensors["weight_packed"], tensors["weight_scale"], is_nv)
    return None if cl is None else (cl[0], cl[1], tensors.get("weight_global_scale"), out_features)


def cached_layout(cache: dict, packed: torch.Tensor, scale: torch.Tensor, is_nv: bool):
    """(packed_c, scales_c) for this weight, made once and kept in ``cache`` (a module's kernel
    cache), remade if the tensors are replaced or changed in place (into the same storage when the
    shape holds); None if the weight has no exact compute layout (see ``compute_layout_ok``).
    The check runs on eager calls: a CUDA graph replays the layout as of its last eager call, so after
    changing base weights in place make one eager call (or recapture) before replaying."""
    ver = (packed.data_ptr(), packed._version, scale.data_ptr(), scale._version)
    ent = cache.get(_CACHE_KEY)
    if ent is None or ent[0] != ver:
        why = compute_layout_ok(packed, scale, is_nv)
        new = None if why else to_compute_layout(packed, scale, is_nv)
        old = ent[1] if ent is not None else None
        if new is not None and old is not None and all(a.shape == b.shape for a, b in zip(old, new)):
            for a, b in zip(old, new):  # same storage: a CUDA graph that captured it sees the new weight
                a.copy_(b)
            new = old
        ent = (ver, new)
        cache[_CACHE_KEY] = ent
    return ent[1]
