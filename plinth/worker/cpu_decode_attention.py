"""Decode attention with static shapes, for a compiled decode step.

Every sequence of a decode batch has one query token. The batch is padded to a fixed size ``G``
and each sequence's block list to a common width ``W`` (padding entries point at the scratch block
0); keys beyond ``seq_lens`` are masked. The shapes seen by the compiler are therefore ``G`` (one
compiled graph per size of the ladder) and ``W`` (a dynamic dimension), and no host value of the
step is read inside the graph.

The KV-cache write is a custom op that mutates the cache in place, so a compiled graph neither
copies nor functionalizes the cache tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from plinth.attention_backends.interface import soft_capped, softmax_with_sinks, write_kv_cache


@torch.library.custom_op("plinth::cpu_write_kv", mutates_args=("kv_cache",))
def cpu_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` ``[2, N, BS, Hkv, D]`` at ``slot_mapping`` ``[T]``."""
    write_kv_cache(key, value, kv_cache, slot_mapping)


@cpu_write_kv.register_fake
def _cpu_write_kv_fake(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    return None


@dataclasses.dataclass
class StaticDecode:
    """Per-step tensors of a padded decode batch (``metadata.backend_data`` of a compiled step).

    Backends that declare ``compile_safe_decode`` route their ``forward`` to :meth:`attend`.
    """

    block_tables: torch.Tensor   # [G, W] int64 (padding -> block 0)
    seq_lens: torch.Tensor       # [G] int64: tokens in the cache after this step (padding rows: 1)
    static_decode: bool = True

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               slot_mapping: torch.Tensor, scale: float, sliding_window: int | None,
               soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the new K/V, then one query per sequence attends to its cached keys.

        ``query`` ``[G, H, D]``, ``key``/``value`` ``[G, Hkv, D]`` -> ``[G, H, D]``.
        """
        cpu_write_kv(key, value, kv_cache, slot_mapping)
        return static_decode_attention(query, kv_cache, self.block_tables, self.seq_lens, scale, sliding_window,
                                       soft_cap, sinks)


def static_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                            soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention of ``query`` ``[G, H, D]`` over the blocks in ``block_tables`` ``[G, W]`` (scores
    soft-capped, ``soft_cap * tanh(score / soft_cap)``, when ``soft_cap`` is set; ``sinks`` ``[H]`` in the
    softmax's denominators when given)."""
    g_rows, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    length = width * block_size
    flat_blocks = block_tables.reshape(-1)                                              # [G * W]
    k = kv_cache[0].index_select(0, flat_blocks).view(g_rows, length, num_kv_heads, head_size).to(query.dtype)
    v = kv_cache[1].index_select(0, flat_blocks).view(g_rows, length, num_kv_heads, head_size).to(query.dtype)
    q = query.view(g_rows, num_kv_heads, group, head_size)                              # [G, Hkv, Gq, D]
    # [G, Hkv, Gq, D] @ [G, Hkv, D, L] -> [G, Hkv, Gq, L]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).to(torch.promote_types(query.dtype, torch.float32)) * scale
    if soft_cap is not None:
        scores = soft_capped(scores, soft_cap)
    key_pos = torch.arange(length, device=query.device)                                 # [L]
    last = (seq_lens - 1)[:, None]                                                      # [G, 1]
    allowed = key_pos[None, :] <= last                                                  # [G, L]
    if sliding_window is not None:
        allowed = allowed & (key_pos[None, :] > last - sliding_window)
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    probs = softmax_with_sinks(scores, head_sinks).to(query.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))                                        # [G, Hkv, Gq, D]
    return out.reshape(g_rows, num_heads, head_size)
