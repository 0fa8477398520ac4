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
