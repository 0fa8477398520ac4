"""The prefill/extend kernel: causal attention over paged KV for mixed batches.

One program owns ``BLOCK_Q`` query tokens of one sequence and the ``GROUP`` query heads of one
KV head, packed as ``BLOCK_M = BLOCK_Q * GROUP`` rows, so every K/V tile it loads serves the
whole GQA group. It walks the sequence's keys (cached context and the new tokens, already
written to the cache) through ``block_tables`` with an online softmax. Decode rows are
sequences with one query token, so one launch serves a mixed prefill + decode batch.

The grid is ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``: an upper bound on the number
of query blocks, so it depends on the batch sizes only. Program ``pid`` finds its sequence by
binary search over ``query_start_loc[s] // BLOCK_Q + s`` (non-decreasing in ``s``); programs
that fall past the end of their sequence's queries exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth.attention_backends.triton.tiles import (
    LOG2E,
    PrefillTiles,
    next_power_of_2,
    sinks_args,
    soft_cap_args,
)
from plinth.kernels.triton_jit import tanh

_FINITE_MIN = tl.constexpr(-1.0e30)  # running-max start: finite, so fully masked rows never give NaN


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= pid``."""
    lo = pid * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, pos, start, kv_end, window, qk_scale,
    k_base, v_base, block_table_row, stride_cb, stride_ct,
    offs_d, d_ok, soft_cap,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """Fold keys ``start .. start + BLOCK_N`` into the running softmax of the rows."""
    offs_n = start + tl.arange(0, BLOCK_N)                                   # [N] key positions
    if CAUSAL_MASK:
        n_ok = offs_n < kv_end
        page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    else:
        page = tl.load(block_table_row + offs_n // BLOCK_SIZE)
    slot_off = page.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct  # [N]
    k_ptrs = k_base + slot_off[None, :] + offs_d[:, None]                   # [D, N]
    v_ptrs = v_base + slot_off[:, None] + offs_d[None, :]                   # [N, D]
    if CAUSAL_MASK:
        if PAD_D:
            k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        if PAD_D:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    k = k.to(q.dtype)   # an 8-bit cache's values widened (a no-op for a cache of the model's dtype)
    v = v.to(q.dtype)

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale              # [M, N], log2 units
    if SOFT_CAP:
        s = soft_cap * tanh(s / soft_cap)
    if CAUSAL_MASK:
        ok = offs_n[None, :] <= pos[:, None]
        if SLIDING:
            ok = ok & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))                               # [M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                          # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# not specialised on integers that change from step to step: each divisibility class (by 16, equal to 1)
# would be one more compile in the middle of serving
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,              # [T, num_heads, head_size]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_size]
    out_ptr,            # [T, num_heads, head_size]
    block_tables_ptr,   # [B, max_blocks_per_seq] int32
    seq_lens_ptr,       # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    qk_scale,           # softmax scale * log2(e)
    window,             # sliding window (used only when SLIDING)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,   # cache strides, the same for keys and values
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    soft_cap=1.0,                    # SOFT_CAP: the cap * log2(e) (scores are in log2 units)
    SOFT_CAP: tl.constexpr = False,  # scores become cap * tanh(score / cap) (Gemma 2)
    sinks_ptr=None,                  # SINKS: [num_heads] float32, each head's sink logit
    SINKS: tl.constexpr = False,     # the sinks join the softmax's denominators
):
    # heaviest query blocks (the ends of the sequences) first, so the tail of the grid is short
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    first_tok = q_block * BLOCK_Q
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = first_tok + offs_m // GROUP                                        # [M] token within seq
    head = kv_head * GROUP + offs_m % GROUP                                  # [M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx_len + tok                                                      # [M] position
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )                                                                        # [M, D]

    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    min_pos = ctx_len + first_tok
    kv_end = ctx_len + last_tok + 1                                          # keys < kv_end
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _FINITE_MIN, dtype=tl.float32)
    if SINKS:   # a key whose score is the sink and whose value is zero
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    if SLIDING:
        masked_start = tl.maximum(min_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        # keys <= min_pos are visible to every row: no mask needed on those tiles
        masked_start = (min_pos + 1) // BLOCK_N * BLOCK_N
        for start in range(0, masked_start, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, pos, start, kv_end, window, qk_scale, k_base, v_base, block_table_row,
                stride_cb, stride_ct, offs_d, d_ok, soft_cap,
                BLOCK_SIZE, BLOCK_N, BLOCK_D != HEAD_SIZE, False, False, DOT_PRECISION, SOFT_CAP,
            )
    for start in range(masked_start, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, pos, start, kv_end, window, qk_scale, k_base, v_base, block_table_row,
            stride_cb, stride_ct, offs_d, d_ok, soft_cap,
            BLOCK_SIZE, BLOCK_N, BLOCK_D != HEAD_SIZE, True, SLIDING, DOT_PRECISION, SOFT_CAP,
        )

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def prefill_attention(
    query: torch.Tensor,        # [T, num_heads, head_size]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
    out: torch.Tensor,          # [T, num_heads, head_size]
    block_tables: torch.Tensor,     # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,         # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    num_seqs: int,
    scale: float,
    sliding_window: int | None,
    tiles: PrefillTiles,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the prefill kernel; writes every real query row of ``out`` (``sinks``: ``[num_heads]`` float32
    sink logits, or ``None``).

    ``k_cache`` and ``v_cache`` must share strides (two halves of one cache tensor).
    """
    assert k_cache.stride() == v_cache.stride()
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    grid = (num_tokens // tiles.block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        num_seqs, scale * LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        SLIDING=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **soft_cap_args(soft_cap),
        **sinks_args(sinks),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
