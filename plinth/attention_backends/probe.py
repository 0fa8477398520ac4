"""Random paged batches for checking and timing attention backends.

:func:`make_paged_batch` lays out a flat batch exactly as the model runner does (random,
non-contiguous block tables; block 0 kept as the scratch block that padding rows write to;
earlier context already in the cache); tests use it. Startup selection uses :func:`max_error`
to check a candidate against the reference backend and :func:`step_runners` to time it on
the model's shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata, AttentionSpec


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



def random_block_tables(
    seq_lens: list[int], block_size: int, generator: torch.Generator, *, spare_blocks: int = 3,
    garbage_table_tail: bool = False,
) -> tuple[torch.Tensor, int]:
    """Give each sequence random, non-contiguous blocks (never block 0, the scratch block).

    Returns:
        ``(block_tables [B, max_blocks] int32, num_blocks)``; the unused tail of each row is 0,
        or random block ids with ``garbage_table_tail`` (a backend must not read them).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    shape = (len(seq_lens), max(blocks_per_seq) + 1)
    if garbage_table_tail:
        table = torch.randint(0, num_blocks, shape, generator=generator, dtype=torch.int32)
    else:
        table = torch.zeros(shape, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        table[s, :nb] = torch.tensor(order[:nb], dtype=torch.int32)
        order = order[nb:]
    return table, num_blocks


def step_metadata(
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (host)
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    *,
    device: torch.device | str = "cpu",
    pad_rows: int = 0,
) -> AttentionMetadata:
    """The metadata of one step: sequence ``s`` has ``context_lens[s]`` cached tokens and
    ``query_lens[s]`` new ones; ``pad_rows`` padding rows at the end write into block 0 (several into one slot
    where the block has fewer, as the engine's padded steps do)."""
    if len(context_lens) != len(query_lens) or not query_lens or min(query_lens) < 1:
        raise ValueError("context_lens and query_lens must be non-empty, of equal length, query_lens >= 1")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    slots: list[int] = []
    for s, (ctx, n) in enumerate(zip(context_lens, query_lens, strict=True)):
        pos = torch.arange(ctx, ctx + n)
        slots.extend((block_tables[s, pos // block_size].long() * block_size + pos % block_size).tolist())
    slots.extend(i % block_size for i in range(pad_rows))
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    dev = torch.device(device)
    return AttentionMetadata(
        num_tokens=qsl[-1] + pad_rows,
        num_seqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=block_tables.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


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
    """Build a random flat batch in the default KV-cache layout whose earlier context is
    already in the cache (random values).

    Args:
        pad_rows: extra rows at the end of the batch (graph padding); their slots are in block 0.
        spare_blocks: unused blocks in the cache besides the scratch block.
        garbage_table_tail: see :func:`random_block_tables`.
    """
    dtype = spec.dtype if dtype is None else dtype
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    h, hkv, d, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    table, num_blocks = random_block_tables(seq_lens, bs, gen, spare_blocks=spare_blocks,
                                            garbage_table_tail=garbage_table_tail)
    metadata = step_metadata(table, context_lens, query_lens, bs, device=device, pad_rows=pad_rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    cache = randn(2, num_blocks, bs, hkv, d)  # unused slots hold noise, never zeros
    rows = metadata.num_tokens
    query, key, value = randn(rows, h, d), randn(rows, hkv, d), randn(rows, hkv, d)
    flat = cache.view(2, -1, hkv, d)
    seq_keys, seq_values = [], []
    for s, ctx in enumerate(context_lens):
        pos = torch.arange(ctx)
        past = table[s, pos // bs].long() * bs + pos % bs  # [ctx] slots of the cached context
        a, b = metadata.query_start_loc_cpu[s], metadata.query_start_loc_cpu[s + 1]
        seq_keys.append(torch.cat([flat[0, past], key[a:b]]))
        seq_values.append(torch.cat([flat[1, past], value[a:b]]))
    dev = torch.device(device)
    return PagedBatch(query.to(dev), key.to(dev), value.to(dev), cache.to(dev), metadata, seq_keys, seq_values)


# -- checking and timing a backend ----------------------------------------------------------


#: most forwards per timed step that :meth:`AttentionWorkload.for_engine` asks for
MAX_TIMED_LAYERS = 4


@dataclasses.dataclass(frozen=True)
class AttentionWorkload:
    """The shapes a backend is timed on: one prefill step and one decode step.

    Attributes:
        prefill_seqs, prefill_len: sequences in the prefill step and new tokens in each.
        decode_seqs, decode_context: sequences in the decode step and tokens cached before it.
        num_layers: forward calls per step after one ``prepare`` (a model's attention layers).
    """

    prefill_seqs: int = 2
    prefill_len: int = 256
    decode_seqs: int = 16
    decode_context: int = 512
    num_layers: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionWorkload.{f.name} must be a positive integer, got {value!r}")

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   num_layers: int = 1) -> AttentionWorkload:
        """Shapes an engine with these limits will run, capped so that timing stays short at startup.

        ``num_layers`` (the model's attention layers) is capped at :data:`MAX_TIMED_LAYERS`:
        enough forwards per ``prepare`` to weigh per-step preparation as a deep model does.
        """
        return cls(
            prefill_seqs=1,
            prefill_len=max(1, min(max_num_batched_tokens, max_model_len, 512)),
            decode_seqs=max(1, min(max_num_seqs, 32)),
            decode_context=max(1, min(max_model_len - 1, 512)),
            num_layers=max(1, min(num_layers, MAX_TIMED_LAYERS)),
        )

    def steps(self) -> dict[str, tuple[list[int], list[int]]]:
        """``{label: (context_lens, query_lens)}``."""
        return {
            "prefill": ([0] * self.prefill_seqs, [self.prefill_len] * self.prefill_seqs),
            "decode": ([self.decode_context] * self.decode_seqs, [1] * self.decode_seqs),
        }


def _check_steps(block_size: int) -> list[tuple[list[int], list[int]]]:
    """Three steps of three sequences: prefill (a chunk, a short and a long prompt), then a
    mixed step (a second chunk beside two decodes), then decode only."""
    bs = block_size
    a, b = [0, 0, 0], [bs + 3, 5, 2 * bs]
    c = [x + y for x, y in zip(a, b, strict=True)]
    d = [4, 1, 1]
    e = [x + y for x, y in zip(c, d, strict=True)]
    return [(a, b), (c, d), (e, [1, 1, 1])]


def run_steps(backend_cls: type[AttentionBackend], spec: AttentionSpec, device: torch.device,
              seed: int = 0) -> torch.Tensor:
    """Run a fresh instance through :func:`_check_steps` from an empty cache of its own layout.

    The context each step reads was written by the backend itself in earlier steps, so the
    write path and any custom KV-cache layout are checked too. Inputs depend only on ``seed``.

    Returns:
        The outputs of every real query row of every step, concatenated: ``[rows, H, D]``.
    """
    gen = torch.Generator().manual_seed(seed)
    bs, h, hkv, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_size
    steps = _check_steps(bs)
    final_lens = [x + y for x, y in zip(*steps[-1], strict=True)]
    table, num_blocks = random_block_tables(final_lens, bs, gen, garbage_table_tail=True)
    cache = torch.zeros(backend_cls.kv_cache_shape(num_blocks, bs, hkv, d), dtype=spec.cache_dtype, device=device)
    backend = backend_cls()
    scale = d ** -0.5
    outs = []
    for ctx, q in steps:
        md = step_metadata(table, ctx, q, bs, device=device, pad_rows=2)
        rows = md.num_tokens
        qkv = [torch.randn(rows, n, d, generator=gen).to(device=device, dtype=spec.dtype) for n in (h, hkv, hkv)]
        backend.prepare(md)
        out = backend.forward(*qkv, cache, md, scale=scale, **spec.attend_kwargs(device))
        outs.append(out[: md.query_start_loc_cpu[-1]])
    return torch.cat(outs)


def max_error(backend_cls: type[AttentionBackend], reference_out: torch.Tensor,
              spec: AttentionSpec, device: torch.device) -> float:
    """The largest difference from ``reference_out`` (the reference's :func:`run_steps`) over
    :func:`run_steps`, relative to the reference's largest magnitude when that exceeds 1
    (``inf`` for NaN/inf outputs or a wrong shape)."""
    got = run_steps(backend_cls, spec, device).double()
    want = reference_out.double()
    if got.shape != want.shape or not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def step_runners(
    backend_cls: type[AttentionBackend], spec: AttentionSpec, workload: AttentionWorkload, device: torch.device,
) -> dict[str, Callable[[], None]]:
    """One callable per workload step, each running that step once on a fresh instance's inputs:
    ``prepare`` plus ``num_layers`` forwards (the caller times them and synchronises the device)."""
    gen = torch.Generator().manual_seed(1)
    bs, h, hkv, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_size
    backend = backend_cls()
    runners = {}
    for label, (ctx, q) in workload.steps().items():
        seq_lens = [x + y for x, y in zip(ctx, q, strict=True)]
        table, num_blocks = random_block_tables(seq_lens, bs, gen, spare_blocks=0)
        cache = torch.randn(backend_cls.kv_cache_shape(num_blocks, bs, hkv, d), generator=gen)
        cache = cache.to(device=device, dtype=spec.cache_dtype)
        md = step_metadata(table, ctx, q, bs, device=device)
        qkv = [torch.randn(md.num_tokens, n, d, generator=gen).to(device=device, dtype=spec.dtype)
               for n in (h, hkv, hkv)]

        extras = spec.attend_kwargs(device)

        def run(md: AttentionMetadata = md, qkv: list[torch.Tensor] = qkv, cache: torch.Tensor = cache,
                extras: dict = extras) -> None:
            md.backend_data = None
            backend.prepare(md)
            for _ in range(workload.num_layers):
                backend.forward(*qkv, cache, md, scale=d ** -0.5, **extras)

        runners[label] = run
    return runners
