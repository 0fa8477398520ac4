"""Compiled decode steps for the CPU: the forward pass of a padded decode batch through ``torch.compile``.

The CPU counterpart of :mod:`plinth.worker.cuda_graphs`. A decode step of ``B`` sequences runs the
compiled graph of the smallest ladder size ``G >= B`` (1, 2, 4, 8, 16, 32, 48, 64, ...); rows
``B..G-1`` are padding sequences of one token in the scratch block 0. Attention runs through the
backend's static-shape decode path (:mod:`plinth.worker.cpu_decode_attention`): the block tables are
padded to the batch's widest sequence, which is a dynamic dimension of the graph, so one graph per
batch size serves every context length.

A size is compiled the first time a batch needs it (or up front with :meth:`CompiledDecodeRunner.warm_up`);
each compilation is logged with its time. Inductor keeps compiled kernels in its on-disk cache, so a
second process compiles the same sizes from cache. A failed compilation is logged and that step, and
every later one, runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata
from plinth.worker.batching import block_table_array
from plinth.worker.cpu_decode_attention import StaticDecode

logger = logging.getLogger(__name__)

#: the block-table width never goes below this (a width of 1 would be specialised by the compiler)
MIN_WIDTH = 2


def compile_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode sizes: powers of two up to 32, then steps of 16, then of 64."""
    sizes = [1, 2, 4, 8, 16, 32] + list(range(48, 129, 16)) + list(range(192, 1025, 64))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class CompiledDecodeRunner:
    """Runs decode steps through ``torch.compile``d forward passes, one per padded batch size.

    Args:
        model: the CausalLM (its attention layers already hold their KV caches).
        backend: the attention backend (must declare ``compile_safe_decode``).
        max_num_seqs: the largest decode batch.
        block_size: tokens per KV block.
        max_blocks_per_seq: the widest block table (max_model_len / block_size, rounded up).
        sizes: the padded batch sizes (default :func:`compile_batch_sizes`).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_num_seqs: int, block_size: int,
                 max_blocks_per_seq: int, sizes: Sequence[int] | None = None):
        if not getattr(backend, "compile_safe_decode", False):
            raise ValueError(f"attention backend {backend.name} has no static-shape decode path")
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_width = max(MIN_WIDTH + 1, max_blocks_per_seq)
        self.sizes = sorted(set(sizes)) if sizes else compile_batch_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.compiled_sizes: set[int] = set()
        self.compile_seconds: dict[int, float] = {}
        self.failed = False
        limit = len(self.sizes) + 8
        if torch._dynamo.config.cache_size_limit < limit:
            torch._dynamo.config.cache_size_limit = limit
        self._fn: Callable[..., torch.Tensor] = torch.compile(self._forward, dynamic=False, fullgraph=True)

    def rebuilder(self) -> Callable[[], CompiledDecodeRunner]:
        """What builds this runner again (after the KV cache moved: sleep mode)."""
        model, backend, block_size, width, sizes = self.model, self.backend, self.block_size, self.max_width, \
            list(self.sizes)
        return lambda: CompiledDecodeRunner(model, backend, sizes[-1], block_size, width, sizes)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[G]`` tokens, positions, slots; ``[G, W]`` tables; ``[G]`` lengths -> logits ``[G, vocab]``."""
        g = input_ids.shape[0]
        md = AttentionMetadata(
            num_tokens=g, num_seqs=g, max_query_len=1, max_seq_len=0, query_start_loc=seq_lens,
            seq_lens=seq_lens, context_lens=seq_lens, slot_mapping=slot_mapping, block_tables=block_tables,
            query_start_loc_cpu=[], seq_lens_cpu=[], backend_data=StaticDecode(block_tables, seq_lens),
        )
        hidden = self.model(input_ids, positions, md)
        return self.model.compute_logits(hidden)

    def padded_size(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def inputs(self, token_ids: np.ndarray, positions: np.ndarray, block_ids: Sequence[Sequence[int]],
               size: int, rope_shift: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """The padded step tensors (no Python loop over sequences)."""
        b = len(token_ids)
        bs = self.block_size
        pos = np.asarray(positions, dtype=np.int64)
        used = pos // bs + 1                                                   # [B] blocks each sequence needs
        width = max(MIN_WIDTH, int(used.max()) if b else 1)
        tables = block_table_array(block_ids, width, size)                     # [G, W]
        vec = np.zeros((4, size), dtype=np.int64)
        vec[0, :b] = token_ids
        vec[1, :b] = pos if rope_shift is None else pos + rope_shift         # the rotary embedding's positions
        vec[2, :b] = tables[np.arange(b), pos // bs] * bs + pos % bs          # slots (padding: slot 0)
        vec[3, :b] = pos + 1
        vec[3, b:] = 1
        t = torch.from_numpy(vec)
        return t[0], t[1], t[2], torch.from_numpy(tables), t[3]

    def warm_up(self, sizes: Sequence[int] | None = None) -> float:
        """Compile ``sizes`` (default: all) now, on padding rows only; returns seconds."""
        t0 = time.perf_counter()
        for size in sizes or self.sizes:
            if size in self.compiled_sizes or self.failed:
                continue
            self._call(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), [], size)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def _call(self, token_ids: np.ndarray, positions: np.ndarray, block_ids: Sequence[Sequence[int]],
              size: int, rope_shift: np.ndarray | None = None) -> torch.Tensor | None:
        args = self.inputs(token_ids, positions, block_ids, size, rope_shift)
        torch._dynamo.maybe_mark_dynamic(args[3], 1)
        if size in self.compiled_sizes:
            return self._fn(*args)
        t0 = time.perf_counter()
        try:
            out = self._fn(*args)
        except Exception as exc:  # noqa: BLE001 (reported, then the step runs eagerly)
            # a missing C++ toolchain, an unsupported op in a custom model: run eagerly from now on
            logger.warning("compiling the decode step failed, decode runs eagerly: %s: %s",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.failed = True
            return None
        elapsed = time.perf_counter() - t0
        self.compiled_sizes.add(size)
        self.compile_seconds[size] = elapsed
        logger.info("compiled the decode step for batch %d in %.1f s", size, elapsed)
        return out

    def run(self, token_ids: np.ndarray, positions: np.ndarray,
            block_ids: Sequence[Sequence[int]], rope_shift: np.ndarray | None = None) -> torch.Tensor | None:
        """One decode step (:meth:`_run`), as a decode step for the layers' GEMMs (``cpu_linear.decode_step``)."""
        from plinth.worker.cpu_linear import decode_step

        with decode_step():
            return self._run(token_ids, positions, block_ids, rope_shift)

    def _run(self, token_ids: np.ndarray, positions: np.ndarray,
             block_ids: Sequence[Sequence[int]], rope_shift: np.ndarray | None = None) -> torch.Tensor | None:
        """One decode step for ``B`` sequences; logits ``[B, vocab]`` float32, or ``None`` (run it eagerly).

        Args:
            token_ids: ``[B]`` the last token of each sequence.
            positions: ``[B]`` its position (= tokens already in the cache).
            block_ids: each sequence's KV blocks.
            rope_shift: ``[B]`` added to the positions for the rotary embedding (multimodal RoPE), or ``None``.
        """
        if self.failed:
            return None
        size = self.padded_size(len(token_ids))
        if size is None:
            return None
        out = self._call(token_ids, positions, block_ids, size, rope_shift)
        return None if out is None else out[: len(token_ids)]
