"""Scatter the step's new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth.attention_backends.interface import FP8_KV_DTYPES
from plinth.attention_backends.triton.tiles import next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr,            # [T, num_kv_heads, head_size]
    value_ptr,          # [T, num_kv_heads, head_size]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    slot_mapping_ptr,   # [T] int64
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ckb, stride_ckt, stride_ckh,
    stride_cvb, stride_cvt, stride_cvh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LIMIT: tl.constexpr = 0.0,   # an 8-bit float cache: values clamped to +-LIMIT before rounding
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    page = slot // BLOCK_SIZE
    in_page = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]   # [H, D]
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if LIMIT > 0:
        k = tl.clamp(k.to(tl.float32), -LIMIT, LIMIT)
        v = tl.clamp(v.to(tl.float32), -LIMIT, LIMIT)
    tl.store(k_cache_ptr + page * stride_ckb + in_page * stride_ckt + offs_h[:, None] * stride_ckh
             + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + page * stride_cvb + in_page * stride_cvt + offs_h[:, None] * stride_cvh
             + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,          # [T, num_kv_heads, head_size]
    value: torch.Tensor,        # [T, num_kv_heads, head_size]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [n] int64, n <= T
) -> None:
    """Write rows ``0 .. n-1`` of ``key``/``value`` to their slots (one program per token)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _, num_kv_heads, head_size = key.shape
    block_h = next_power_of_2(num_kv_heads)
    block_d = next_power_of_2(head_size)
    _write_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        LIMIT=FP8_KV_DTYPES.get(k_cache.dtype, 0.0),
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
