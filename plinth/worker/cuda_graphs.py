"""Decode steps replayed from captured CUDA graphs.

A graph is captured for each batch size of a ladder (1, 2, 4, 8, 16, 24, 32, 48, ...). A decode step of
``B`` sequences replays the smallest captured size ``G >= B``; rows ``B..G-1`` are padding sequences of
one token that live in the scratch block 0. Inputs are copied into static device buffers from pinned
host buffers; the graph computes hidden states and the logits of every row.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata
from plinth.worker.batching import TokenFeed

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The capture ladder: dense at small sizes, where batch-1..8 latency matters."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, 513, 16))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


@dataclasses.dataclass
class _Static:
    """Device buffers a graph reads (inputs) and writes (outputs), sized for the largest graph."""

    input_ids: torch.Tensor      # [G] int64
    positions: torch.Tensor      # [G] int64
    slot_mapping: torch.Tensor   # [G] int64
    seq_lens: torch.Tensor       # [G] int32
    context_lens: torch.Tensor   # [G] int32
    query_start_loc: torch.Tensor  # [G + 1] int32
    block_tables: torch.Tensor   # [G, W] int32


class DecodeGraphRunner:
    """Captures and replays decode steps.

    Args:
        model: the CausalLM (its attention layers already hold their KV caches).
        backend: the attention backend (must be ``graph_safe``).
        device: a CUDA device.
        max_num_seqs: the largest decode batch.
        max_blocks_per_seq: the block-table width (max_model_len / block_size, rounded up).
        block_size: tokens per block.
        shared_rows: rows may be one sequence's consecutive positions (speculative decoding's drafts): captured
            with ``AttentionMetadata.rows_share_sequences``.
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 max_num_seqs: int, max_blocks_per_seq: int, block_size: int, shared_rows: bool = False):
        self.model = model
        self.shared_rows = shared_rows
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capture_error_mode = "global"
        g, w = self.sizes[-1], max_blocks_per_seq
        self.max_size = g

        # The static inputs are views into two device buffers, each filled from a pinned host buffer of the
        # same layout with one copy per step: int64 rows (token ids, positions, slots, then the two rows of
        # fed tokens: batch rows and rows of the previous output) and int32 words (sequence lengths, context
        # lengths, then the block table, whose first `size` rows are copied).
        self.host_vec = torch.zeros((6, g), dtype=torch.int64, pin_memory=True)
        self.host_words = torch.zeros(2 * g + g * w, dtype=torch.int32, pin_memory=True)
        self.dev_vec = torch.zeros((6, g), dtype=torch.int64, device=device)
        self.dev_words = torch.zeros(2 * g + g * w, dtype=torch.int32, device=device)
        self.static = _Static(
            input_ids=self.dev_vec[0], positions=self.dev_vec[1], slot_mapping=self.dev_vec[2],
            seq_lens=self.dev_words[:g], context_lens=self.dev_words[g: 2 * g],
            query_start_loc=torch.zeros(g + 1, dtype=torch.int32, device=device),
            block_tables=self.dev_words[2 * g:].view(g, w),
        )
        #: a model with Mamba layers: each row's state row (the sixth int64 row; padding rows take the state's
        #: scratch row, the last, which no sequence holds), and the state (see :mod:`plinth.model_registry.layers.mamba`)
        self.recurrent = getattr(model, "recurrent_state", None) if getattr(model, "has_recurrent_state", False) \
            else None
        self.scratch_row = self.recurrent.scratch_row if self.recurrent is not None else 0
        #: the state's tensors the graphs were captured on (a state grown while serving is new memory: the steps
        #: run eagerly from then on)
        self._state_tensors = (self.recurrent.conv, self.recurrent.ssm) if self.recurrent is not None else None
        self._copied: torch.cuda.Event | None = None   # recorded after the latest copies from the host buffers
        # keyed by (batch size, with the LoRA adapters' products)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.lora = getattr(model, "lora_state", None)   # its slot weights are set before each replay
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            num_tokens=size, num_seqs=size, max_query_len=1,
            max_seq_len=s.block_tables.shape[1] * self.block_size,
            query_start_loc=s.query_start_loc[: size + 1], seq_lens=s.seq_lens[:size],
            context_lens=s.context_lens[:size], slot_mapping=s.slot_mapping[:size],
            block_tables=s.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size,
            rows_share_sequences=self.shared_rows,
            # the state rows on the device only: the model's step preparation (zeroing rows that start, growing
            # the state) happens before the replay, outside the graph
            state_rows=self.dev_vec[5, :size] if self.recurrent is not None else None,
        )

    def _forward(self, size: int) -> torch.Tensor:
        md = self._metadata(size)
        self.backend.prepare(md)
        s = self.static
        hidden = self.model(s.input_ids[:size], s.positions[:size], md)
        return self.model.compute_logits(hidden)   # [size, vocab] float32

    @torch.inference_mode()
    def capture(self, capture_error_mode: str = "global", warmups: int = 2) -> float:
        """Capture every size of the ladder (largest first, sharing one memory pool); returns seconds.

        ``capture_error_mode`` is ``torch.cuda.graph``'s: ``"thread_local"`` lets other threads of the
        process (the NCCL watchdog of a tensor-parallel worker) make CUDA calls during a capture. ``warmups``:
        eager runs of each size before its capture (the first capture compiles Triton kernels, settles cuBLAS
        workspaces; a capture again, after sleep mode, needs fewer).
        """
        t0 = time.perf_counter()
        self.capture_error_mode = capture_error_mode
        self._fill_padding(0, self.max_size)
        if self.recurrent is not None:   # the graphs gather and scatter the state's rows, whichever they are
            self.recurrent.first_row = None
        lora = self.lora
        # with LoRA adapters, each size twice: without the adapters' products (steps of base-model requests only)
        # and with them (a replay's slot weights pick each row's adapter; base rows have zero weights)
        variants = (False, True) if lora is not None else (False,)
        if lora is not None:
            lora.set_tokens(None)
        for with_lora in variants:
            if lora is not None:
                lora.active = with_lora
            for size in reversed(self.sizes):
                for _ in range(warmups):   # warm-up: compile Triton kernels, settle cuBLAS workspaces
                    self._forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=capture_error_mode):
                    out = self._forward(size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size, with_lora] = graph
                self.outputs[size, with_lora] = out
        torch.cuda.synchronize(self.device)
        if lora is not None:
            lora.active = False
        elapsed = time.perf_counter() - t0
        logger.info("captured %d decode graphs (batch %d..%d%s) in %.1f s", len(self.graphs), self.sizes[0],
                    self.sizes[-1], ", with and without LoRA products" if lora is not None else "", elapsed)
        return elapsed

    def rebuilder(self) -> Callable[[], DecodeGraphRunner]:
        """What captures these graphs again (after the weights or the KV cache moved: sleep mode); it holds
        none of this runner's graphs or memory."""
        model, backend, device, sizes = self.model, self.backend, self.device, self.sizes
        width, block_size, shared, mode = self.max_blocks_per_seq, self.block_size, self.shared_rows, \
            self.capture_error_mode

        def rebuild() -> DecodeGraphRunner:
            graphs = DecodeGraphRunner(model, backend, device, sizes[-1], width, block_size, shared_rows=shared)
            graphs.capture(capture_error_mode=mode, warmups=1)   # (kernels compiled, workspaces settled)
            return graphs

        return rebuild

    def _fill_padding(self, start: int, end: int) -> None:
        s = self.static
        idx = torch.arange(start, end, device=self.device, dtype=torch.int32)
        s.input_ids[start:end] = 0
        s.positions[start:end] = 0
        s.slot_mapping[start:end] = 0
        s.seq_lens[start:end] = 1
        s.context_lens[start:end] = 0
        s.query_start_loc[start + 1: end + 1] = idx + 1
        s.block_tables[start:end] = 0
        self.dev_vec[5, start:end] = self.scratch_row

    def _replayable(self, state_rows: np.ndarray | None) -> bool:
        """Whether a step of these state rows can replay the graphs: ``False`` (the step runs eagerly) for rows past
        the ones allocated, and from the step on which the state was grown to new memory."""
        assert self.recurrent is not None and self._state_tensors is not None
        if state_rows is None or int(state_rows.max()) >= self.scratch_row:
            return False
        if self._state_tensors[0] is self.recurrent.conv and self._state_tensors[1] is self.recurrent.ssm:
            return True
        if self.graphs:
            logger.warning("the Mamba layers' state was grown while serving: decode steps run eagerly from now on")
            self.graphs.clear()
        return False

    def padded_size(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    @torch.inference_mode()
    def run(self, token_ids: np.ndarray, positions: np.ndarray,
            block_ids: Sequence[Sequence[int]] | np.ndarray, feed: TokenFeed | None = None,
            rope_shift: np.ndarray | None = None, state_rows: np.ndarray | None = None) -> torch.Tensor:
        """Replay one decode step for ``B`` sequences; returns logits ``[B, vocab]`` (a view into static output).

        Args:
            token_ids: ``[B]`` the last token of each sequence.
            positions: ``[B]`` its position (= tokens already in the cache).
            block_ids: each sequence's KV blocks (lists, or a zero-padded ``[B, W]`` integer array).
            feed: rows of ``token_ids`` to take from the previous step's sampled tokens on the device.
            rope_shift: ``[B]`` added to the positions for the rotary embedding (multimodal RoPE), or ``None``.
            state_rows: ``[B]`` each sequence's row of the model's recurrent state (Mamba layers), or ``None``.
        """
        b = len(token_ids)
        if self.recurrent is not None and not self._replayable(state_rows):
            return None
        size = self.padded_size(b)
        assert size is not None, f"decode batch {b} exceeds the largest graph {self.max_size}"
        if self._copied is not None:   # the previous step's copies may still read the host buffers
            self._copied.synchronize()
        bs = self.block_size
        g, w = self.host_vec.shape[1], self.static.block_tables.shape[1]
        vec = self.host_vec.numpy()
        words = self.host_words.numpy()
        lens = words[: 2 * g].reshape(2, g)
        tables = words[2 * g: 2 * g + size * w].reshape(size, w)
        tables[:] = 0
        if isinstance(block_ids, np.ndarray):          # a zero-padded [B, W'] table: one slice copy
            n = min(block_ids.shape[1], w)
            tables[:b, :n] = block_ids[:, :n]
        else:
            for i, blocks in enumerate(block_ids):
                n = min(len(blocks), w)
                tables[i, :n] = blocks[:n]
        pos = positions.astype(np.int64)
        vec[0, :b] = token_ids
        vec[1, :b] = pos if rope_shift is None else pos + rope_shift   # the rotary embedding's positions
        vec[2, :b] = tables[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs
        lens[0, :b] = pos + 1         # seq_lens
        lens[1, :b] = pos             # context_lens
        # padding rows: one token at slot 0 of the scratch block
        vec[:3, b:size] = 0
        lens[0, b:size] = 1
        lens[1, b:size] = 0
        if self.recurrent is not None:
            assert state_rows is not None
            vec[5, :b] = state_rows
            vec[5, b:size] = self.scratch_row
        k = 0 if feed is None else len(feed.rows)
        if k:
            vec[3, :k] = feed.rows
            vec[4, :k] = feed.src
        s = self.static
        # two copies from the pinned buffers (the block table's first `size` rows only)
        self.dev_vec.copy_(self.host_vec, non_blocking=True)
        self.dev_words[: 2 * g + size * w].copy_(self.host_words[: 2 * g + size * w], non_blocking=True)
        if k:
            s.input_ids.index_copy_(0, self.dev_vec[3, :k], feed.tokens.index_select(0, self.dev_vec[4, :k]))
        self._copied = torch.cuda.Event()
        self._copied.record()
        if self.recurrent is not None and not pos.all():   # sequences whose first token this is: zero states
            self.recurrent.reset(self.dev_vec[5, :b][torch.from_numpy(pos == 0).to(self.device)])
        # query_start_loc is 0..size for a decode batch: constant, filled at capture
        key = (size, self.lora is not None and self.lora.active)
        self.graphs[key].replay()
        return self.outputs[key][:b]
