"""Split-KV decode (flash-decoding) for decode-only batches.

Grid ``(num_seqs, num_kv_heads, num_splits)``. Each program takes the one query token of a
sequence for all ``GROUP`` query heads of one KV head (so each K/V tile is loaded once for
the group) and reduces one contiguous range of the sequence's KV tiles to a partial
``(max, sum, acc)``. On NVIDIA GPUs (and in Triton's interpreter) the last program of a
(sequence, KV head) to finish merges the splits: each program counts itself in with an atomic add
on a per-(sequence, KV head) counter after writing its partial (a block barrier, then a release),
and the one that sees every other split done reads the partials (acquire), writes the output and
resets the counter to zero for the next launch. So a decode step costs one launch, not a split
kernel and a merge kernel (a launch is a few microseconds at batch 1, where a step runs ~64 of
them). Elsewhere (ROCm, XPU: whether their block barrier orders global stores before the release is
not established) a second kernel merges the splits. With one split the program writes the output
directly. The counters are shared by every launch on a device, which is safe because the launches
of one device run in one stream, one after another.

The split count comes from the batch size and the cache-capacity bound only (see
:func:`plinth.attention_backends.triton.tiles.decode_splits`); each program derives its KV
range from the real sequence length on the device, so the launch is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth.attention_backends.triton.tiles import DecodeTiles, next_power_of_2

_FINITE_MIN = tl.constexpr(-1.0e30)


@triton.jit
def _decode_split_kernel(
    q_ptr,              # [T, num_heads, head_size]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    out_ptr,            # [T, num_heads, head_size] (written when NUM_SPLITS == 1 or by the merging program)
    part_acc_ptr,       # [B, num_heads, NUM_SPLITS, HEAD_SIZE] fp32
    part_ml_ptr,        # [B, num_heads, NUM_SPLITS, 2] fp32: running max (log2 units), sum
    counters_ptr,       # [B * num_kv_heads] int32: zero between launches (the merging program resets it)
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FUSED_MERGE: tl.constexpr,   # the last split merges (else the merge kernel runs after this one)
    PEER_LOAD: tl.constexpr,     # cache modifier of the merge's loads of other programs' partials
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
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

    if SLIDING:
        kv_start = tl.maximum(seq_len - window, 0)    # the query sits at position seq_len - 1
    else:
        kv_start = seq_len * 0
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _FINITE_MIN, dtype=tl.float32)
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
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale          # [G, N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        first = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS           # [G] split 0 of each head
        part = first + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)
        if FUSED_MERGE:
            tl.debug_barrier()   # every thread's partial is written before the release below
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")   # splits done before this one
            if finished == NUM_SPLITS - 1:
                # the last split of this (sequence, KV head): merge every split of the group's heads
                offs_s = tl.arange(0, BLOCK_S)
                gs_ok = g_ok[:, None] & (offs_s[None, :] < NUM_SPLITS)                # [G, S]
                idx = first[:, None] + offs_s[None, :]
                m_s = tl.load(part_ml_ptr + idx * 2, mask=gs_ok, other=_FINITE_MIN, cache_modifier=PEER_LOAD)
                l_s = tl.load(part_ml_ptr + idx * 2 + 1, mask=gs_ok, other=0.0, cache_modifier=PEER_LOAD)
                m_all = tl.max(m_s, axis=1)                                              # [G]
                w = tl.exp2(m_s - m_all[:, None])                                        # [G, S]
                total = tl.sum(w * l_s, axis=1)
                total = tl.where(total == 0.0, 1.0, total)
                merged = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                for s in range(NUM_SPLITS):
                    w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)         # [G]
                    a = tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_SIZE + offs_d[None, :],
                                mask=g_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=PEER_LOAD)
                    merged += a * w_s[:, None]
                tl.store(
                    out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                    (merged / total[:, None]).to(out_ptr.dtype.element_ty),
                    mask=g_ok[:, None] & d_ok[None, :],
                )
                tl.atomic_xchg(counter, 0)


@triton.jit
def _decode_merge_kernel(
    out_ptr,            # [T, num_heads, head_size]
    part_acc_ptr,       # [B, num_heads, NUM_SPLITS, HEAD_SIZE] fp32
    part_ml_ptr,        # [B, num_heads, NUM_SPLITS, 2] fp32
    query_start_loc_ptr,
    num_tokens,
    stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    store_ok = offs_d < tl.where(row < num_tokens, HEAD_SIZE, 0)
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s       # [S]
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
) -> None:
    """Launch split-KV decode (and the merge when ``num_splits > 1``) for one query per sequence.

    ``k_cache`` and ``v_cache`` must share strides (two halves of one cache tensor).
    """
    assert k_cache.stride() == v_cache.stride()
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_size), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
        fused = fused_merge_supported(query.device)
        counters = merge_counters(query.device, num_seqs * num_kv_heads) if fused else out   # unused if not fused
    else:
        fused = False
        part_acc = part_ml = counters = out  # unused by the kernel
    block_d = next_power_of_2(head_size)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_ml, counters, block_tables, seq_lens, query_start_loc,
        num_tokens, scale * 1.4426950408889634, sliding_window or 0,
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
        NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits),
        FUSED_MERGE=fused,
        # NVIDIA: read other programs' partials from L2 (".cg"), never a stale L1 line; elsewhere the default
        PEER_LOAD=".cg" if query.device.type == "cuda" and torch.version.hip is None else "",
        SLIDING=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )

    if num_splits > 1 and not fused:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, query_start_loc, num_tokens,
            out.stride(0), out.stride(1),
            HEAD_SIZE=head_size,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits),
            num_warps=4,
        )


def fused_merge_supported(device: torch.device) -> bool:
    """Whether the last split merges in the same launch: on NVIDIA GPUs and in the interpreter (CPU), not on
    ROCm or XPU."""
    return device.type == "cpu" or (device.type == "cuda" and torch.version.hip is None)


#: merge counters per device: one int32 per (sequence, KV head), zero between launches
_COUNTERS: dict[torch.device, torch.Tensor] = {}
#: the counters allocated per device (enough for 4096 sequences of 64 KV heads)
MAX_COUNTERS = 1 << 18


def merge_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed merge counters (allocated once, so captured graphs keep a valid address)."""
    if needed > MAX_COUNTERS:
        raise ValueError(f"a decode step of {needed} (sequence, KV head) pairs exceeds {MAX_COUNTERS}")
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda":
            with torch.cuda.device(device):
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("the decode merge counters must be allocated before graph capture")
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters
