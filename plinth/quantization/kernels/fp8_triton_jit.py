"""The Triton FP8 weight-only GEMM: ``c = a @ (w * s)^T`` with FP8 E4M3 weights widened in registers.

``w`` uint8 ``[N, K]`` (the FP8 bytes), ``s`` float32 ``[ceil(N / SBN), ceil(K / SBK)]`` (per output channel:
``SBN = 1`` and ``SBK`` at least ``K``; DeepSeek-style blocks: ``SBN = SBK = 128``). Grid
``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``; ``BLOCK_K`` divides ``SBK``, so each K tile of a column has one
scale, applied to the tile's partial product. With ``SPLIT_K > 1`` the programs of one output tile take every
``SPLIT_K``-th K tile and add into a float32 output atomically (more programs for decode-sized inputs).

This module imports Triton at import time; load it through
:func:`plinth.quantization.kernels.w4a16_triton.load_jit_module`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_w8a16_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr,
    M, N, K,
    stride_am, stride_wn, stride_sn, stride_sk, stride_cm,
    SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    s_cols = s_ptr + (offs_n // SBN) * stride_sn                                          # [BN] pointers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)                    # [BM, BK]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)                      # [BK, BN] bytes
        w = w.to(tl.float8e4nv, bitcast=True).to(a.dtype)
        s = tl.load(s_cols + (k0 // SBK) * stride_sk, mask=mask_n, other=0.0)            # [BN]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c, acc, mask=mask)
