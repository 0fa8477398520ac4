"""Paged attention batches for backend tests: a flat batch over shuffled blocks (unowned slots NaN) and a float64
reference."""

from __future__ import annotations

import dataclasses
import math

import torch

from plinth.attention_backends.interface import AttentionMetadata


@dataclasses.dataclass
class Batch:
    query: torch.Tensor        # [T, H, D]
    key: torch.Tensor          # [T, Hkv, D]
    value: torch.Tensor        # [T, Hkv, D]
    kv_cache: torch.Tensor     # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]: every key, cached and new
    full_v: list[torch.Tensor]
    num_real_tokens: int


def make_batch(
    seqs: list[tuple[int, int]],  # (context_len, query_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int = 16,
    pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """A flat batch with shuffled (non-contiguous) blocks, cached context already in the cache.

    Cache slots no sequence owns hold NaN, so a kernel that reads outside a sequence's
    valid slots produces NaN. Padding rows write to the scratch block 0.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(blocks_needed) + 2
    # the unused tail of each row holds random block ids: a kernel must not follow them
    block_tables = torch.randint(0, num_blocks, (len(seqs), width), generator=g, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    full_k, full_v, keys, values, slots = [], [], [], [], []
    for s, ((ctx, _), n) in enumerate(zip(seqs, seq_lens, strict=True)):
        table = [free.pop() for _ in range(blocks_needed[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for p in range(n):
            slot = table[p // block_size] * block_size + p % block_size
            if p < ctx:
                kv_cache[0].view(-1, num_kv_heads, head_size)[slot] = k[p]
                kv_cache[1].view(-1, num_kv_heads, head_size)[slot] = v[p]
            else:
                slots.append(slot)
        keys.append(k[ctx:])
        values.append(v[ctx:])
    num_real = sum(q for _, q in seqs)
    keys.append(torch.randn(pad_tokens, num_kv_heads, head_size, generator=g).to(dtype))
    values.append(torch.randn(pad_tokens, num_kv_heads, head_size, generator=g).to(dtype))
    slots += [i % block_size for i in range(pad_tokens)]  # padding rows -> scratch block 0
    query = torch.randn(num_real + pad_tokens, num_heads, head_size, generator=g).to(dtype)
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    metadata = AttentionMetadata(
        num_tokens=num_real + pad_tokens,
        num_seqs=len(seqs),
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return Batch(query, torch.cat(keys), torch.cat(values), kv_cache, metadata, full_k, full_v, num_real)


def reference_attention(batch: Batch, scale: float, sliding_window: int | None,
                        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """Per-sequence causal attention in float64 with an explicit softmax (scores soft-capped,
    ``cap * tanh(score / cap)``, with ``soft_cap``; head ``h``'s denominator also holds ``exp(sinks[h])``; with
    ``chunk``, a query sees only the keys of its own ``chunk``-position chunk). Returns [T_real, H, D]."""
    md = batch.metadata
    num_heads = batch.query.shape[1]
    outs = []
    for s in range(md.num_seqs):
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        n = md.seq_lens_cpu[s]
        q = batch.query[lo:hi].double()                          # [q_len, H, D]
        group = num_heads // batch.full_k[s].shape[1]
        k = batch.full_k[s].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = batch.full_v[s].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale      # [H, q_len, n]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(n - (hi - lo), n)[:, None]
        k_pos = torch.arange(n)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        if chunk is not None:
            visible &= k_pos // chunk == q_pos // chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        if sinks is not None:
            top = torch.maximum(top, sinks.double()[:, None, None])
        weights = torch.exp(scores - top)
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + torch.exp(sinks.double()[:, None, None] - top)
        weights = weights / denominator
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
    return torch.cat(outs)
