"""The Triton W4A16 GEMM: ``c = a @ ((q - z) * s)`` with 4-bit codes unpacked in registers.

Weight layout (made by :class:`~plinth.quantization.kernels.w4a16_triton.TritonW4A16Kernel`):
``q`` int32 ``[N, K / 8]``, interleaved in spans of ``TILE`` input features: within span ``t``, word
``t * TILE / 8 + w`` holds in nibble ``j`` the code of feature ``t * TILE + j * TILE / 8 + w``. A decode
row then unpacks each nibble plane of a ``[BLOCK_N, TILE / 8]`` word tile against a contiguous slice
of ``x``. ``s`` and ``z`` float32 ``[N, K / GROUP_SIZE]``.

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``. ``BLOCK_K`` divides ``GROUP_SIZE``, so each
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
def w4a16_gemv_kernel(
    x_ptr,              # [K] one activation row
    q_ptr,              # [N, K / 8] int32, interleaved in spans of TILE features
    s_ptr,              # [N, K / GROUP_SIZE] float32 scales
    z_ptr,              # [N, K / GROUP_SIZE] float32 zero points (code units)
    y_ptr,              # [N] output (activation dtype, or float32 when SPLIT_K > 1)
    N, K, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One decode row: grid ``(cdiv(N, BLOCK_N), SPLIT_K)``; ``K`` a multiple of ``TILE * SPLIT_K`` and
    ``GROUP_SIZE`` a multiple of ``TILE / 8`` (each nibble plane of a span lies in one group)."""
    SPAN: tl.constexpr = TILE // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, SPAN)
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + (k_begin // 8 + offs_w)[None, :]
    acc = tl.zeros((BLOCK_N, SPAN), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_len, TILE):
        packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)                          # [BN, SPAN]
        for j in tl.static_range(8):
            g = (k0 + j * SPAN) // GROUP_SIZE
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)           # [BN]
            zs = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0) * s
            x = tl.load(x_ptr + k0 + j * SPAN + offs_w).to(tl.float32)                    # [SPAN]
            codes = _nibbles_as_float((packed >> (4 * j)) & 0xF)
            acc += (codes * s[:, None] - zs[:, None]) * x[None, :]
        q_ptrs += SPAN
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(y_ptr + offs_n, out, mask=mask_n)
