"""Random paged batches for checking and timing attention backends.

:func:`make_paged_batch` lays out a flat batch exactly as the model runner does (random,
non-contiguous block tables; block 0 kept as the scratch block that padding rows write to;
earlier context already in the cache). Startup selection uses it to check every candidate
against the reference backend and to time it on the model's shapes; tests use it too.
"""

from __future__ import annotations

import dataclasses

import torch

from plinth.attention_backends.interface import AttentionMetadata, AttentionSpec


@dataclasses.dataclass
class PagedBatch:
    """One step's attention inputs plus each sequence's full keys/values (for references)."""

    query: torch.Tensor            # [T, H, D] (T includes pad_rows)
    key: torch.Tensor              # [T, Hkv, D]
    value: torch.Tensor            # [T, Hkv, D]
    kv_cache: torch.Tensor         # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata
    seq_keys: list[torch.Tensor]   # per sequence: [seq_len, Hkv, D], context then new tokens
    seq_values: list[torch.Tensor]

    def fresh_cache(self) -> torch.Tensor:
        """A copy of the cache as it was before any forward (forward writes into it)."""
        return self._initial_cache.clone()

    def __post_init__(self) -> None:
        self._initial_cache = self.kv_cache.clone()


def make_paged_batch(
    spec: AttentionSpec,
    context_lens: list[int],
    query_lens: list[int],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    pad_rows: int = 0,
    spare_blocks: int = 3,
    generator: torch.Generator | None = None,
    garbage_table_tail: bool = False,
) -> PagedBatch:
    """Build a random flat batch: sequence ``s`` has ``context_lens[s]`` cached tokens and
    ``query_lens[s]`` new ones.

    Args:
        pad_rows: extra rows at the end of the batch (graph padding); their slots are in block 0.
        spare_blocks: unused blocks in the cache besides the scratch block.
        garbage_table_tail: fill the unused tail of each block-table row with random block ids
            instead of 0 (a backend must not read them).
    """
    if len(context_lens) != len(query_lens) or not query_lens:
        raise ValueError("context_lens and query_lens must be non-empty and of equal length")
    dtype = spec.dtype if dtype is None else dtype
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    h, hkv, d, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays scratch
    max_blocks = max(blocks_per_seq) + 1
    if garbage_table_tail:
        table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    else:
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        table[s, :nb] = torch.tensor(order[:nb], dtype=torch.int32)
        order = order[nb:]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    cache = randn(2, num_blocks, bs, hkv, d)  # unused slots hold noise, never zeros
    total = sum(query_lens)
    query, key, value = randn(total + pad_rows, h, d), randn(total + pad_rows, hkv, d), randn(total + pad_rows, hkv, d)
    slots: list[int] = []
    seq_keys, seq_values = [], []
    start = 0
    for s, (ctx, n) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(seq_lens[s])
        seq_slots = table[s, pos // bs].long() * bs + pos % bs  # [seq_len]
        flat = cache.view(2, -1, hkv, d)
        past_k, past_v = flat[0, seq_slots[:ctx]], flat[1, seq_slots[:ctx]]
        seq_keys.append(torch.cat([past_k, key[start:start + n]]))
        seq_values.append(torch.cat([past_v, value[start:start + n]]))
        slots.extend(seq_slots[ctx:].tolist())
        start += n
    slots.extend(range(pad_rows))  # padding rows write into the scratch block
    if pad_rows > bs:
        raise ValueError(f"pad_rows {pad_rows} exceeds the scratch block ({bs} slots)")

    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    dev = torch.device(device)
    metadata = AttentionMetadata(
        num_tokens=total + pad_rows,
        num_seqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=table.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(query.to(dev), key.to(dev), value.to(dev), cache.to(dev), metadata, seq_keys, seq_values)
