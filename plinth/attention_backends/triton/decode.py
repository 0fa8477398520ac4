"""Split-KV decode (flash-decoding) for decode-only batches.

Grid ``(num_seqs, num_kv_heads, num_splits)``. Each program takes the one query token of a
sequence for all ``GROUP`` query heads of one KV head (so each K/V tile is loaded once for
the group) and reduces one contiguous range of the sequence's KV tiles to a partial
``(max, sum, acc)``. A second kernel merges the splits. With one split the first kernel
writes the output directly and the merge is skipped.

The split count comes from the batch size and the cache-capacity bound only (see
:func:`plinth.attention_backends.triton.tiles.decode_splits`); each program derives its KV
range from the real sequence length on the device, so the launch is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth.attention_backends.interface import FP8_KV_DTYPES
from plinth.attention_backends.triton.tiles import (
    LOG2E,
    DecodeTiles,
    next_power_of_2,
    sinks_args,
    soft_cap_args,
)
from plinth.kernels.ops import dependent_options
from plinth.kernels.triton_jit import dependent_start, tanh

_FINITE_MIN = tl.constexpr(-1.0e30)


# not specialised on integers that change from step to step (one compile per divisibility class otherwise)
@triton.jit(do_not_specialize=["num_tokens", "stride_bt"])
def _decode_split_kernel(
    q_ptr,              # [T, num_heads, head_size]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    out_ptr,            # [T, num_heads, head_size] (written without SPLIT)
    part_acc_ptr,       # [B, num_heads, num_splits, HEAD_SIZE] fp32
    part_ml_ptr,        # [B, num_heads, num_splits, 2] fp32: running max (log2 units), sum
    block_tables_ptr,   # [B, max_blocks_per_seq] int32
    seq_lens_ptr,       # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    num_tokens,
    qk_scale,           # softmax scale * log2(e)
    window,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,   # cache strides, the same for keys and values
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,   # more than one KV range (the grid's third dimension): partial results for the merge
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr = False,   # launched as a programmatic dependent (see dependent_start)
    key_ptr=None,       # ROTARY: [T, num_kv_heads, head_size] the step's keys, not yet rotated
    value_ptr=None,     # ROTARY: [T, num_kv_heads, head_size]
    cos_ptr=None,       # ROTARY: [T, head_size] (rotate-half layout: both halves hold the same angles)
    sin_ptr=None,
    slot_mapping_ptr=None,   # ROTARY: [T] int64
    stride_kt=0, stride_kh=0, stride_vt=0, stride_vh=0, stride_rt=0,
    ROTARY: tl.constexpr = False,   # rotate q and the new key here, and write the new key/value to the cache
    LIMIT: tl.constexpr = 0.0,      # an 8-bit float cache: new keys/values are clamped to +-LIMIT before rounding
    soft_cap=1.0,                   # SOFT_CAP: the cap * log2(e) (scores are in log2 units)
    SOFT_CAP: tl.constexpr = False,  # scores become cap * tanh(score / cap) (Gemma 2)
    sinks_ptr=None,                 # SINKS: [num_heads] float32, each head's sink logit
    SINKS: tl.constexpr = False,    # the sinks join the softmax's denominators (the first split holds them)
):
    dependent_start(DEPENDENT)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + offs_g                                          # [G] query heads
    g_ok = offs_g < tl.where(row < num_tokens, GROUP, 0)                   # no rows past the batch
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(
        q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )                                                                        # [G, D]
    if ROTARY:
        # rotate-half RoPE: x[d] cos[d] - x[d + D/2] sin[d] in the first half, x[d] cos[d] + x[d - D/2] sin[d]
        # in the second, in float32 and rounded once (as ops.rotary_)
        half = HEAD_SIZE // 2
        d_row_ok = offs_d < tl.where(row < num_tokens, HEAD_SIZE, 0)       # [D]: none past the batch
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)    # [D]
        cos = tl.load(cos_ptr + row * stride_rt + offs_d, mask=d_row_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_rt + offs_d, mask=d_row_ok, other=0.0).to(tl.float32)
        sin = tl.where(offs_d < half, -sin, sin)
        q2 = tl.load(
            q_ptr + row * stride_qt + head[:, None] * stride_qh + partner[None, :],
            mask=g_ok[:, None] & d_ok[None, :], other=0.0,
        )
        q = (q.to(tl.float32) * cos[None, :] + q2.to(tl.float32) * sin[None, :]).to(q.dtype)
        k_row = key_ptr + row * stride_kt + kv_head * stride_kh
        k1 = tl.load(k_row + offs_d, mask=d_row_ok, other=0.0)
        k2 = tl.load(k_row + partner, mask=d_row_ok, other=0.0)
        k_new = (k1.to(tl.float32) * cos + k2.to(tl.float32) * sin).to(k1.dtype)
        v_new = tl.load(value_ptr + row * stride_vt + kv_head * stride_vh + offs_d, mask=d_row_ok, other=0.0)
        if LIMIT > 0:
            k_new = tl.clamp(k_new.to(tl.float32), -LIMIT, LIMIT)
            v_new = tl.clamp(v_new.to(tl.float32), -LIMIT, LIMIT)
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)                       # [D] as the cache holds them
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)

    if SLIDING:
        kv_start = tl.maximum(seq_len - window, 0)    # the query sits at position seq_len - 1
    else:
        kv_start = seq_len * 0
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _FINITE_MIN, dtype=tl.float32)
    if SINKS:   # a key whose score is the sink and whose value is zero, in the first split's range
        sink = tl.load(sinks_ptr + head, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                      # [N] key positions
        n_ok = (offs_n < seq_len) & (offs_n >= kv_start)
        page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        slot_off = page.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct  # [N]
        if BLOCK_D != HEAD_SIZE:
            k = tl.load(k_base + slot_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                        other=0.0)                                           # [D, N]
            v = tl.load(v_base + slot_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)                                           # [N, D]
        else:
            k = tl.load(k_base + slot_off[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(v_base + slot_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if ROTARY:   # the step's own token is not in the cache yet: take it from the registers
            is_new = offs_n == seq_len - 1
            k = tl.where(is_new[None, :], k_new[:, None], k)
            v = tl.where(is_new[:, None], v_new[None, :], v)
        k = k.to(q.dtype)   # an 8-bit cache's values widened (a no-op for a cache of the model's dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale          # [G, N]
        if SOFT_CAP:
            s = soft_cap * tanh(s / soft_cap)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if ROTARY:
        # the program whose range holds the last tile writes the new key and value to their slot
        last_tile = first_tile + num_tiles - 1
        owner = (tile_lo <= last_tile) & (last_tile < tile_hi)
        store_ok = d_row_ok & (offs_d < tl.where(owner, HEAD_SIZE, 0))
        slot = tl.load(slot_mapping_ptr + tl.minimum(row, num_tokens - 1)).to(tl.int64)
        slot_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_d
        tl.store(k_base + slot_off, k_new, mask=store_ok)
        tl.store(v_base + slot_off, v_new, mask=store_ok)

    if not SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (seq.to(tl.int64) * num_heads + head) * tl.num_programs(2) + split   # [G]
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _decode_merge_kernel(
    out_ptr,            # [T, num_heads, head_size]
    part_acc_ptr,       # [B, num_heads, num_splits, HEAD_SIZE] fp32
    part_ml_ptr,        # [B, num_heads, num_splits, 2] fp32
    query_start_loc_ptr,
    num_tokens,
    num_splits,         # a runtime value: one compiled kernel serves every split count up to BLOCK_S
    stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    dependent_start(DEPENDENT)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    store_ok = offs_d < tl.where(row < num_tokens, HEAD_SIZE, 0)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s       # [S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_FINITE_MIN)
    lsum = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)             # [S, D]
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all)                                                   # [S]
    total = tl.sum(w * lsum, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(acc * w[:, None], axis=0) / total                           # [D]
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=store_ok)


def decode_attention(
    query: torch.Tensor,        # [T, num_heads, head_size]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    out: torch.Tensor,          # [T, num_heads, head_size]
    block_tables: torch.Tensor,     # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,         # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    num_seqs: int,
    scale: float,
    sliding_window: int | None,
    tiles: DecodeTiles,
    num_splits: int,
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch split-KV decode (and the merge when ``num_splits > 1``) for one query per sequence.

    ``k_cache`` and ``v_cache`` must share strides (two halves of one cache tensor).
    ``rotary``: ``(key, value, cos, sin, slot_mapping)`` with one token per sequence (``key``/``value``
    ``[T, num_kv_heads, head_size]``, ``cos``/``sin`` ``[T, head_size]`` sharing strides): ``query`` and
    ``key`` are taken before their rotate-half RoPE, which the kernel applies (``query`` is left as it was),
    and the kernel writes the rotated key and the value to the cache itself. ``sinks``: ``[num_heads]``
    float32 sink logits (gpt-oss) or ``None``.
    """
    assert k_cache.stride() == v_cache.stride()
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_size), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused by the kernel
    block_d = next_power_of_2(head_size)
    dependent = dependent_options(query)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc,
        num_tokens, scale * LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        BLOCK_G=tiles.block_g,
        BLOCK_N=tiles.block_n,
        SPLIT=num_splits > 1,
        SLIDING=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **_rotary_args(rotary, k_cache.dtype),
        **soft_cap_args(soft_cap),
        **sinks_args(sinks),
        **dependent,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, query_start_loc, num_tokens, num_splits,
            out.stride(0), out.stride(1),
            HEAD_SIZE=head_size,
            BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits),
            num_warps=4,
            **dependent,
        )


def _rotary_args(rotary: tuple[torch.Tensor, ...] | None, cache_dtype: torch.dtype) -> dict:
    """The split kernel's ROTARY arguments (none without ``rotary``), with the clamp of an 8-bit cache."""
    if rotary is None:
        return {}
    key, value, cos, sin, slot_mapping = rotary
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and key.stride(-1) == value.stride(-1) == 1
    return dict(key_ptr=key, value_ptr=value, cos_ptr=cos, sin_ptr=sin, slot_mapping_ptr=slot_mapping,
                stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
                stride_rt=cos.stride(0), ROTARY=True, LIMIT=FP8_KV_DTYPES.get(cache_dtype, 0.0))
