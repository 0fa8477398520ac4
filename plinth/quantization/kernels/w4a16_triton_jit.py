"""The Triton W4A16 GEMM: ``c = a @ ((q - z) * s)`` with 4-bit codes unpacked in registers.

Weight layout (made by :class:`~plinth.quantization.kernels.w4a16_triton.TritonW4A16Kernel`):
``q`` int32 ``[K / 8, N]``, code of input feature ``k`` in nibble ``k % 8`` of word row ``k // 8``
(GPTQ's order: loads along N are contiguous); ``s`` and ``z`` float32 ``[K / GROUP_SIZE, N]``.

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
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4                                   # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None], other=0.0)                            # [BM, BK]
        packed = tl.load(q_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_n[None, :], other=0)                         # [BK, BN] int32
        codes = (packed >> shifts[:, None]) & 0xF
        group = k0 // GROUP_SIZE
        s = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)   # [BN]
        z = tl.load(z_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
        w = ((codes.to(tl.float32) - z[None, :]) * s[None, :]).to(a.dtype)    # [BK, BN]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c, acc, mask=mask)


@triton.jit
def w4a16_skinny_kernel(
    x_ptr,              # [M, K] activations, M <= 16
    q_ptr,              # [N, K / 8] int32 packed codes (nibble k % 8 of word k // 8)
    s_ptr,              # [N, K / GROUP_SIZE] float32 scales
    z_ptr,              # [N, K / GROUP_SIZE] float32 zero points (code units)
    y_ptr,              # [M, N] output (activation dtype, or float32 when SPLIT_K > 1)
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Decode-sized W4A16: grid ``(cdiv(N, BLOCK_N), SPLIT_K)``; ``K`` a multiple of ``BLOCK_K * SPLIT_K``,
    ``BLOCK_K`` a multiple of 8 and of nothing else (a tile may span several groups).

    Words are loaded once as ``[BLOCK_N, BLOCK_K / 8]`` and their eight nibbles unpacked along a third
    axis; scales and zero points are read per word. One row (``USE_DOT`` false): with ``x`` viewed as
    ``[BLOCK_K / 8, 8]``, each word contributes ``s * (sum_j c_j x_j - z * sum_j x_j)``. Several rows:
    the dequantized tile is reshaped to ``[BLOCK_N, BLOCK_K]`` for ``tl.dot`` with the rows padded to 16.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    offs_w = tl.arange(0, WORDS)
    nib = tl.arange(0, 8)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + (k_begin // 8 + offs_w)[None, :]
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_len, BLOCK_K):
            packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)                            # [BN, W]
            g = (k0 + offs_w * 8) // GROUP_SIZE                                               # [W]
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None], other=0.0)
            z = tl.load(z_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None], other=0.0)
            codes = ((packed[:, :, None] >> (nib * 4)[None, None, :]) & 0xF).to(tl.float32)    # [BN, W, 8]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=mask_m[:, None], other=0.0)                                       # [BM, BK]
            w = ((codes - z[:, :, None]) * s[:, :, None]).to(x.dtype)
            acc += tl.dot(x, tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K))), input_precision=DOT_PRECISION)
            q_ptrs += WORDS
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        acc2 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_len, BLOCK_K):
            packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)                            # [BN, W]
            g = (k0 + offs_w * 8) // GROUP_SIZE                                               # [W]
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None], other=0.0)
            z = tl.load(z_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptr + k0 + offs_w[:, None] * 8 + nib[None, :]).to(tl.float32)         # [W, 8]
            codes = ((packed[:, :, None] >> (nib * 4)[None, None, :]) & 0xF).to(tl.float32)    # [BN, W, 8]
            cx = tl.sum(codes * x[None, :, :], axis=2)                                         # [BN, W]
            acc2 += s * (cx - z * tl.sum(x, axis=1)[None, :])
            q_ptrs += WORDS
        out = tl.sum(acc2, axis=1)                                                            # [BN]
        if SPLIT_K == 1:
            tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.atomic_add(y_ptr + offs_n, out, mask=mask_n)
