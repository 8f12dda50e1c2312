"""The compute layout of the tensor-core FP4 kernels (qerl.kernels.mma, qerl.kernels.warpspec), its exact
inverse and reference.

The compressed-tensors layout (``weight_packed`` [N, K/2], ``weight_scale`` [N, K/B]) keeps each
row's bytes in K order. A tensor-core kernel wants instead each lane's ``mma.m16n8k16`` fragment in
one vector load, in bits that decode cheaply. ``to_compute_layout`` rewrites a weight (once: the first
small-M call that needs it makes it and ``cached_layout`` keeps it in the module's kernel cache, beside
the on-disk buffers, which stay the module's state for export, ``state_dict``, AQN and the training
kernels) into:

  - packed: uint8 [Np/16, Kp/64, 8 (g), 4 (c), 16]: for each 16-row x 64-column block, lane
    (g, c) of a warp reads 16 contiguous bytes: exactly its A fragments of ``mma.m16n8k16`` (and of
    the warpgroup ``wgmma``, whose register A operand has the same per-warp fragments) for the four
    16-column steps t of the block, in natural column order. Word t (32 bits) holds the 8 codes of
    rows g + 8 h (h = 0, 1), columns 64 kb + 16 t + 8 q + 2 c + e: the fragment's register
    r = h + 2 q, half e. Its bits are placed so that ONE left rotation of the word puts a register's
    two 3-bit magnitudes at bf16 bits 6-8 of each half and a second (or the same) one its two signs
    at bit 15 (``ROT_MAG``, ``ROT_SIGN``): magnitude of (r, e) at word bit (6 + 16 e - ROT_MAG[r]) mod
    32, sign at (15 + 16 e - ROT_SIGN[r]) mod 32; every bit of the word is used once. The decode of 8
    weights is then 5 rotations (shf.l.wrap), 6 LOP3 and 4 bf16x2 multiplies. The rotated bits read
    as a bf16 equal to the E2M1 value times 2^-126 (exponent 0 gives the bf16 subnormal for 0.5).
  - scales: uint8 [Np/16, Kp/64, 8 (g), 4 (t), 4]: per step t the bf16 pair (s(g), s(g + 8)) of its
    rows' block scales (little-endian bytes): the E4M3 scale times 2^119 (exact for every E4M3 value,
    sign and zero included), or for an E8M0 exponent e the bf16 2^(e - 63) (an E8M0 block covers two
    steps and is stored twice). A pair is one 32-bit word: the multiply takes its halves as
    broadcast operands (.H0_H0 / .H1_H1), so scaling costs no extra instruction. The four lanes c of
    a row read the same 16 bytes. The products are exact (at most 6 significant bits): the weight
    times 2^-7 (NVFP4) or 2^-62 (MXFP4); the power of two and the global divisor come off in the
    epilogue.

K keeps its natural order: the activations are read as they are. Padding rows / columns are zero.
``from_compute_layout`` is the exact inverse (tests: bit for bit). ``decode_reference`` is the
weight the kernel multiplies by, computed the kernel's way in torch.
"""

from __future__ import annotations

import torch

KBLOCK = 64  # columns of a compute-layout block
RBLOCK = 16  # rows of a compute-layout block
LAYOUT_CHUNK_ROWS = 1024  # rows to_compute_layout converts at a time (a multiple of RBLOCK)
# Left rotations of a code word that bring register r's magnitudes (ROT_MAG) and signs (ROT_SIGN) into place
ROT_MAG = (0, 3, 6, 9)
ROT_SIGN = (4, 3, 6, 5)
NV_SCALE_EXP = 119  # E4M3 scale * 2^119 in the layout's bf16: the epilogue multiplies by 2^7 / global scale
MX_SCALE_BIAS = 64  # E8M0 exponent e -> bf16 exponent field e + 64 (= 2^(e - 63)): the epilogue takes 2^62


def mag_bit(r: int, e: int) -> int:
    """Lowest word bit of the 3-bit magnitude of fragment register r, half e."""
    return (6 + 16 * e - ROT_MAG[r]) % 32


def sign_bit(r: int, e: int) -> int:
    """Word bit of the sign of fragment register r, half e."""
    return (15 + 16 * e - ROT_SIGN[r]) % 32


def _pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


def scale_bf16(scale_u8: torch.Tensor, is_nv: bool) -> torch.Tensor:
    """Block scale bytes -> the layout's bf16 (E4M3 * 2^119, or 2^(e - 63) for an E8M0 exponent e); exact."""
    if is_nv:
        return (scale_u8.view(torch.float8_e4m3fn).double() * 2.0 ** NV_SCALE_EXP).to(torch.bfloat16)
    return ((scale_u8.to(torch.int32) + MX_SCALE_BIAS) << 7).to(torch.int16).view(torch.bfloat16)


def scale_bytes_from_bf16(sbf: torch.Tensor, is_nv: bool) -> torch.Tensor:
    """Inverse of ``scale_bf16``: uint8 E4M3 / E8M0 bytes."""
    if is_nv:
        return (sbf.double() * 2.0 ** -NV_SCALE_EXP).to(torch.float8_e4m3fn).view(torch.uint8)
    return ((sbf.view(torch.int16).to(torch.int32) >> 7) - MX_SCALE_BIAS).to(torch.uint8)


def compute_layout_ok(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> str | None:
    """None if the weight has an exact compute layout, else why not (NaN scales; E8M0 scales above 2^63,
    or below 2^-63 over non-zero codes, where the offset bf16 scale or its products leave bf16's normal range)."""
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if is_nv:
        if bool(((s & 0x7F) == 0x7F).any()):
            return "NaN block scales"
    else:
        if bool((s == 0xFF).any()):
            return "NaN block scales"
        if bool((s > 190).any()):
            return "MXFP4 block scales above 2^63"
        small = s < 64  # fine where the block's codes are all zero (the quantizer's all-zero blocks)
        if bool(small.any()):
            N, KH = packed.shape
            codes = packed.view(N, KH // 16, 16)
            if bool((((codes & 0x77) != 0).any(-1) & small).any()):
                return "MXFP4 block scales below 2^-63 with non-zero codes"
    return None


def _place(c8: torch.Tensor) -> torch.Tensor:
    """Codes [..., 8 (i = 4 e + 2 q + h)] -> int32 words in the rotation layout."""
    w = torch.zeros(c8.shape[:-1], dtype=torch.int64, device=c8.device)
    c8 = c8.to(torch.int64)
    for e in range(2):
        for q in range(2):
            for h in range(2):
                r, code = h + 2 * q, c8[..., 4 * e + 2 * q + h]
                w |= ((code & 0x7) << mag_bit(r, e)) | ((code >> 3) << sign_bit(r, e))
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def _unplace(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> codes [..., 8 (i = 4 e + 2 q + h)] (int64)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for i in range(8):
        e, q, h = i >> 2, (i >> 1) & 1, i & 1
        r = h + 2 * q
        out.append(((w >> mag_bit(r, e)) & 0x7) | (((w >> sign_bit(r, e)) & 1) << 3))
    return torch.stack(out, -1)


def to_compute_layout(packed: torch.Tensor, scale: torch.Tensor, is_nv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) in the compute layout (see the module docstring), on packed's device."""
    N, KH = packed.shape
    K = 2 * KH
    Np, Kp = _pad_to(N, RBLOCK), _pad_to(K, KBLOCK)
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    B = 16 if is_nv else 32
    out = torch.empty(Np // 16, Kp // 64, 8, 4, 16, dtype=torch.uint8, device=packed.device)
    step = LAYOUT_CHUNK_ROWS  # rows at a time: the int64 codes are 8 bytes a weight while they exist
    for r0 in range(0, Np, step):
        r1 = min(r0 + step, Np)
        # codes [rows, Kp]: one uint8 per weight (padding: code 0)
        codes = torch.zeros(r1 - r0, Kp, dtype=torch.uint8, device=packed.device)
        src = packed[r0:min(r1, N)]
        codes[:src.shape[0], :K:2] = src & 0xF
        codes[:src.shape[0], 1:K:2] = src >> 4
        # [nb, h, g, kb, t, q, c, e] -> [nb, kb, g, c, t, i = (e, q, h)]
        nb = (r1 - r0) // 16
        c8 = codes.view(nb, 2, 8, Kp // 64, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 7, 5, 1)
        words = _place(c8.reshape(nb, Kp // 64, 8, 4, 4, 8))
        out[r0 // 16:r1 // 16] = words.view(torch.uint8).view(nb, Kp // 64, 8, 4, 16)
    # scales: the bf16 of the block of columns 64 kb + 16 t .. of each row
    sp = torch.zeros(Np, Kp // B, dtype=torch.bfloat16, device=packed.device)
    sp[:N, :K // B] = scale_bf16(s, is_nv)
    cols = (torch.arange(Kp // 64, device=packed.device)[:, None] * 64
            + torch.arange(4, device=packed.device)[None, :] * 16) // B  # [kb, t]
    st = sp[:, cols]  # [Np, kb, t]
    st = st.view(Np // 16, 2, 8, Kp // 64, 4).permute(0, 3, 2, 4, 1).contiguous()  # [nb, kb, g, t, h]
    return out, st.view(torch.uint8).view(Np // 16, Kp // 64, 8, 4, 4)


def from_compute_layout(packed_c: torch.Tensor, scales_c: torch.Tensor, N: int, K: int,
                        is_nv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact inverse of ``to_compute_layout``: (weight_packed uint8 [N, K/2], scale bytes uint8 [N, K/B])."""
    nb, kb = packed_c.shape[:2]
    Np, Kp = nb * 16, kb * 64
    words = packed_c.contiguous().view(torch.int32).view(nb, kb, 8, 4, 4)
    c8 = _unplace(words).view(nb, kb, 8, 4, 4, 2, 2, 2)  # [nb, kb, g, c, t, e, q, h]
    codes = c8.permute(0, 7, 2, 1, 4, 6, 3, 5).reshape(Np, Kp)  # [nb, h, g, kb, t, q, c, e]
    packed = (codes[:N, :K:2] | (codes[:N, 1:K:2] << 4)).to(torch.uint8)
    B = 16 if is_nv else 32
    sbf = scales_c.contiguous().view(torch.bfloat16).view(nb, kb, 8, 4, 2)
    st = sbf.permute(0, 4, 2, 1, 3).reshape(Np, kb * 4)  # [nb, h, g, kb, t] -> [Np, kb * 4]
    st = st[:, ::B // 16] if B > 16 else st
    st = scale_bytes_from_bf16(st[:N, :K // B].contiguous(), is_nv)
    return packed.contiguous(), st.contiguous()


def decode_reference(packed_c: torch.Tensor, scales_c: torch.Tensor, N: int, K: int, is_nv: bool,
                     gs: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] weight the kernel multiplies by, computed the kernel's way in torch (the rotated bits
    read as a bf16, E2M1 * 2^-126, times the scale's bf16, then the epilogue factor): for tests on any device."""
    nb, kb = packed_c.shape[:2]
    words = packed_c.contiguous().view(torch.int32).view(nb, kb, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF
    parts = []
    for i in range(8):
        e, q, h = i >> 2, (i >> 1) & 1, i & 1
        r = h + 2 * q
        rot = ((words << ROT_MAG[r]) | (words >> (32 - ROT_MAG[r]))) & 0xFFFFFFFF
        rs = ((words << ROT_SIGN[r]) | (words >> (32 - ROT_SIGN[r]))) & 0xFFFFFFFF
        bits = (((rot >> (16 * e)) & 0x01C0) | ((rs >> (16 * e)) & 0x8000)).to(torch.int16)
        parts.append(bits.view(torch.bfloat16).double())  # E2M1 * 2^-126
    code = torch.stack(parts, -1)  # [nb, kb, g, c, t, i = (e, q, h)]
    sbf = scales_c.contiguous().view(torch.bfloat16).view(nb, kb, 8, 4, 2).double()  # [nb, kb, g, t, h]
    # weight (h, t, q, c, e) of lane (g, c): scale of (g, t, h)
    c8 = code.view(nb, kb, 8, 4, 4, 2, 2, 2)  # [nb, kb, g, c, t, e, q, h]
    w = c8 * sbf[:, :, :, None, :, None, None, :]
    w = w.permute(0, 7, 2, 1, 4, 6, 3, 5).reshape(nb * 16, kb * 64)[:N, :K]
    w = w * 2.0 ** (126 - (NV_SCALE_EXP if is_nv else MX_SCALE_BIAS))  # the epilogue's power of two
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
