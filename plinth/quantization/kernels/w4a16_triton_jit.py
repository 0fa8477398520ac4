"""The Triton W4A16 kernels: ``c = a @ ((q - z) * s)`` with 4-bit codes unpacked in registers.

Weight layout (made by :class:`~plinth.quantization.kernels.w4a16_triton.TritonW4A16Kernel`):
``q`` int32 ``[N, K / 8]``, interleaved in spans of ``TILE`` input features (``TILE`` divides the
group): within span ``t``, word ``t * TILE / 8 + w`` holds in nibble ``j`` the code of feature
``t * TILE + j * TILE / 8 + w``. A decode row then unpacks each nibble plane of a
``[BLOCK_N, TILE / 8]`` word tile against a contiguous slice of ``x``. ``s`` and ``z`` float32
``[N, K / GROUP_SIZE]``.

Three kernels read that layout: :func:`w4a16_gemv_fold_kernel` (one row, CUDA cores),
:func:`w4a16_mma_kernel` (up to 16 rows per program, tensor cores) and :func:`w4a16_gemm_kernel`
(prefill-sized inputs). For the GEMM: grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``. ``BLOCK_K`` divides ``GROUP_SIZE``, so each
K tile needs one row of scales and zero points. With ``SPLIT_K > 1`` the programs of one output
tile take every ``SPLIT_K``-th K tile and add their partial sums into a float32 output atomically
(more programs for small-M decode GEMMs).

This module imports Triton at import time; load it through ``TritonW4A16Kernel`` (which switches
Triton to its interpreter first when ``PLINTH_TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nibbles_as_float(codes):
    """Codes 0..15 as float32 without an integer-to-float conversion (a slow instruction): OR-ed into
    the mantissa of 2**23 they give ``2**23 + code`` exactly; subtracting ``2**23`` leaves the code."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def w4a16_gemm_kernel(
    a_ptr,              # [M, K] activations (fp16, bf16 or fp32)
    q_ptr,              # [K / 8, N] int32 packed codes
    s_ptr,              # [K / GROUP_SIZE, N] float32 scales
    z_ptr,              # [K / GROUP_SIZE, N] float32 zero points (code units)
    c_ptr,              # [M, N] output (activation dtype, or float32 when SPLIT_K > 1)
    M, N, K,
    stride_am, stride_ak,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_cm, stride_cn,
    GROUP_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    SPAN: tl.constexpr = TILE // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None], other=0.0)                            # [BM, BK]
        within = offs_k % TILE
        word = (offs_k // TILE) * SPAN + within % SPAN                           # [BK]
        shifts = (within // SPAN) * 4
        packed = tl.load(q_ptr + word[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_n[None, :], other=0)                         # [BK, BN] int32
        codes = _nibbles_as_float((packed >> shifts[:, None]) & 0xF)
        group = k0 // GROUP_SIZE
        s = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)   # [BN]
        z = tl.load(z_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        w = ((codes - z[None, :]) * s[None, :]).to(a.dtype)                    # [BK, BN]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c, acc, mask=mask)


@triton.jit
def _unit_plus_code(packed, J: tl.constexpr):
    """Nibble ``J`` of int32 ``packed`` as the float32 ``1 + code / 16``: the code shifted into the four
    highest mantissa bits of 1.0 (one shift and one ``lop3``; no conversion instruction)."""
    if 4 * J <= 19:
        t = packed << (19 - 4 * J)
    else:
        t = packed >> (4 * J - 19)
    return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def w4a16_gemv_fold_kernel(
    x_ptr,              # [K] one activation row
    q_ptr,              # [N, K / 8] int32, interleaved in spans of TILE features (TILE divides GROUP_SIZE)
    s_ptr,              # [N, K / GROUP_SIZE] float32 scales
    z_ptr,              # [N, K / GROUP_SIZE] float32 zero points (code units)
    y_ptr,              # [N] output (activation dtype, or float32 when SPLIT_K > 1)
    N, K, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, TILE: tl.constexpr, SPANS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One decode row on the CUDA cores, about three instructions per weight: grid
    ``(cdiv(N, BLOCK_N), SPLIT_K)``, ``K / SPLIT_K`` a multiple of ``TILE * SPANS``.

    Each code enters as ``u = 1 + q / 16`` (:func:`_unit_plus_code`) and meets ``x`` in one FMA; within
    a span (one group or part of one), ``sum((q - z) * s * x) = s * (16 * sum(u * x) - (16 + z) *
    sum(x))``, folded in per span. Each step loads ``SPANS`` spans at once, so that enough loads are in
    flight: the loop is not software-pipelined, and one span per step leaves the kernel waiting on
    memory latency.
    """
    SPAN: tl.constexpr = TILE // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_u = tl.arange(0, SPANS)
    offs_w = tl.arange(0, SPAN)
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    q_ptrs = (q_ptr + offs_n[:, None, None] * stride_qn + (k_begin // 8 + offs_u * SPAN)[None, :, None]
              + offs_w[None, None, :])                                                  # [BN, SPANS, SPAN]
    x_ptrs = x_ptr + offs_u[:, None] * TILE + offs_w[None, :]                           # [SPANS, SPAN]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn                                        # [BN, 1]
    z_ptrs = z_ptr + offs_n[:, None] * stride_sn
    out = tl.zeros((BLOCK_N, SPANS), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_len, TILE * SPANS):
        packed = tl.load(q_ptrs, mask=mask_n[:, None, None], other=0)
        g = ((k0 + offs_u * TILE) // GROUP_SIZE)[None, :]                                  # [1, SPANS]
        sc = tl.load(s_ptrs + g, mask=mask_n[:, None], other=0.0)                          # [BN, SPANS]
        z = tl.load(z_ptrs + g, mask=mask_n[:, None], other=0.0)
        part = tl.zeros((BLOCK_N, SPANS, SPAN), dtype=tl.float32)
        xs = tl.zeros((SPANS, SPAN), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptrs + k0 + j * SPAN).to(tl.float32)                             # [SPANS, SPAN]
            part += _unit_plus_code(packed, j) * x[None, :, :]
            xs += x
        out += sc * (16.0 * tl.sum(part, axis=2) - (16.0 + z) * tl.sum(xs, axis=1)[None, :])
        q_ptrs += SPANS * SPAN
    res = tl.sum(out, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, res.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(y_ptr + offs_n, res, mask=mask_n)


@triton.jit
def _magic_halves(words, MAGIC_BITS: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr):
    """The codes in bits 0-3 and 16-19 of int32 ``words`` as 16-bit floats ``MAGIC + code``, exactly.

    OR-ing a code into the mantissa of a 16-bit float whose unit in the last place is 1 (128 in
    bfloat16, ``MAGIC_BITS`` 0x4300; 1024 in float16, 0x6400) gives ``MAGIC + code`` with no
    conversion instruction. With ``ASM`` one ``lop3`` makes both halves at once (two codes per
    instruction); without it (Triton's interpreter, other GPUs) the same bits come from plain integer ops.
    """
    if ASM:
        if MAGIC_BITS == 0x4300:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$0, $1}, t; }",
                "=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; mov.b32 {$0, $1}, t; }",
                "=h,=h,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo = ((words & 0xF) | MAGIC_BITS).to(tl.int16).to(OUT, bitcast=True)
        hi = (((words >> 16) & 0xF) | MAGIC_BITS).to(tl.int16).to(OUT, bitcast=True)
    return lo, hi


@triton.jit
def _close_group(acc, part, xs, s_ptr, z_ptr, offs_n, mask_n, stride_sn, g, MAGIC: tl.constexpr):
    """``part`` holds ``x @ (MAGIC + q)`` over one group and ``xs`` the group's ``x`` folded to a few
    columns: ``(q - z) * s`` weights give ``s * (part - (MAGIC + z) * sum(x))``."""
    xsum = tl.sum(xs, axis=1)
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
    z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
    return acc + part * s[None, :] - xsum[:, None] * ((z + MAGIC) * s)[None, :]


@triton.jit
def w4a16_mma_kernel(
    x_ptr,              # [M, K] activations (float16 or bfloat16), M small
    q_ptr,              # [N, K / 8] int32, interleaved in spans of TILE features (TILE divides GROUP_SIZE)
    s_ptr,              # [N, K / GROUP_SIZE] float32 scales
    z_ptr,              # [N, K / GROUP_SIZE] float32 zero points (code units)
    y_ptr,              # [M, N] output (activation dtype, or float32 when SPLIT_K > 1)
    M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr,
):
    """Decode-sized rows on the tensor cores: grid ``(cdiv(M, 16), cdiv(N, BLOCK_N), SPLIT_K)``.

    Each word tile ``[BLOCK_N, TILE / 8]`` gives eight nibble planes, two per ``lop3``
    (:func:`_magic_halves`); each plane is ``MAGIC + code`` exactly and multiplies its slice of ``x``
    (padded to 16 rows) on the tensor cores with float32 accumulation. Zero points and scales are
    applied once per span (:func:`_close_group`), so the weights cost about one integer instruction
    per code. ``K / SPLIT_K`` is a multiple of ``GROUP_SIZE``; ``TILE / 8`` is at least 16 (the
    smallest 16-bit ``tl.dot`` the GPUs take).
    """
    SPAN: tl.constexpr = TILE // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * 16 + tl.arange(0, 16)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, SPAN)
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + (k_begin // 8 + offs_w)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_w[None, :]
    OUT: tl.constexpr = x_ptr.dtype.element_ty
    XW: tl.constexpr = SPAN
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_len, TILE):
        words = tl.load(q_ptrs, mask=mask_n[:, None], other=0)                           # [BN, SPAN]
        part = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((16, XW), dtype=tl.float32)
        for h in tl.static_range(4):
            lo, hi = _magic_halves(words >> (4 * h), MAGIC_BITS, OUT, ASM)
            xl = tl.load(x_ptrs + k0 + h * SPAN, mask=mask_m[:, None], other=0.0)           # [16, SPAN]
            xh = tl.load(x_ptrs + k0 + (h + 4) * SPAN, mask=mask_m[:, None], other=0.0)
            part = tl.dot(xl, tl.trans(lo), part)
            part = tl.dot(xh, tl.trans(hi), part)
            xs += xl.to(tl.float32) + xh.to(tl.float32)
        q_ptrs += SPAN
        # closed every span (a span lies in one group, and the close is linear): part never carries more
        # than TILE features' MAGIC * sum(x), which keeps the cancellation small for any group size
        acc = _close_group(acc, part, xs, s_ptr, z_ptr, offs_n, mask_n, stride_sn, k0 // GROUP_SIZE, MAGIC)
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y, acc, mask=mask)
