"""The reference attention backend: exact, simple, runs anywhere torch runs.

Each step writes the new keys/values into the paged cache, then, sequence by sequence,
gathers the sequence's whole context from its block table and calls
``torch.nn.functional.scaled_dot_product_attention`` with a causal (and optionally
sliding-window) mask offset by the tokens already cached.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from plinth.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Support,
    math_attention,
    torch_reads_kv_cache,
    write_kv_cache,
)


def _mask(num_queries: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """``[Q, L]`` bool: query ``i`` (at position ``L - Q + i``) may see key ``j``."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=device)[:, None]  # [Q, 1]
    k_pos = torch.arange(seq_len, device=device)[None, :]                        # [1, L]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


class TorchSDPABackend(AttentionBackend):
    """Paged attention with one ``scaled_dot_product_attention`` call per sequence."""

    decode_rows_may_share_sequences = True   # every key and value is written before attention
    supports_soft_cap = True
    supports_sinks = True
    shares_kv_cache = True   # the cache is read and written through its strides

    name: ClassVar[str] = "torch_sdpa"
    priority: ClassVar[int] = 0

    @classmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        """Every device, dtype and head size."""
        return Support.yes()

    @classmethod
    def supports_kv_cache_dtype(cls, spec: AttentionSpec, device_type: str) -> Support:
        """Any cache type torch converts from (8-bit floats included)."""
        return torch_reads_kv_cache(spec, device_type)

    def forward(
        self,
        query: torch.Tensor,     # [T, Hq, D]
        key: torch.Tensor,       # [T, Hkv, D]
        value: torch.Tensor,     # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:           # [T, Hq, D]
        """Write K/V at ``slot_mapping``, then attend per sequence over its gathered context."""
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[-2]
        group = num_heads // num_kv_heads
        block_size = kv_cache.shape[2]
        out = torch.zeros_like(query)
        qsl = metadata.query_start_loc_cpu
        for s in range(metadata.num_seqs):
            start, end = qsl[s], qsl[s + 1]
            if end == start:
                continue
            seq_len = metadata.seq_lens_cpu[s]
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_tables[s, :num_blocks].long()
            # [L, Hkv, D] -> [Hq, L, D]
            k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, dim=0)
            v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, dim=0)
            k, v = k.to(query.dtype), v.to(query.dtype)
            q = query[start:end].transpose(0, 1)                                       # [Hq, Q, D]
            num_queries = end - start
            if sliding_window is None and num_queries == 1:
                mask = None  # a single newest token sees the whole sequence
            else:
                mask = _mask(num_queries, seq_len, sliding_window, query.device)
            if soft_cap is not None or sinks is not None:
                head_sinks = None if sinks is None else sinks[:, None, None]                     # [Hq, 1, 1]
                out[start:end] = math_attention(q, k, v, mask, scale, soft_cap, head_sinks).transpose(0, 1)
                continue
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=mask, scale=scale)            # [1, Hq, Q, D]
            out[start:end] = o[0].transpose(0, 1)
        return out
