"""A step's batch as flat arrays, and the engine-side block table that is kept between steps.

* :class:`SeqBatchEntry`: one sequence's share of a step (the executor interface's unit).
* :class:`FlatBatch`: a whole step as a few numpy arrays. It is also a ``Sequence[SeqBatchEntry]``
  (entries made on demand), so every executor that takes entries takes it; the model runner reads
  the arrays directly.
* :class:`PersistentBlockTable`: one row of block ids per running request, mirrored from the
  block manager's lists and updated incrementally (a decode step appends at most one block per
  sequence), so a step's ``[N, W]`` block table is one gather, not a rebuild from Python lists.
* :class:`BatchBuilder`: a scheduler's output to a :class:`FlatBatch`, through the persistent table.
* :func:`block_table_array`: lists of block ids to a zero-padded table.
* :class:`TokenFeed`: under asynchronous scheduling, which input tokens of a step are the sampled
  tokens of the step still in flight (taken from its output on the device).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plinth.core.speculative import DraftRow

if TYPE_CHECKING:
    from plinth.core.scheduler import SchedulerOutput


@dataclasses.dataclass
class SeqBatchEntry:
    """One sequence's share of a step."""

    token_ids: Sequence[int]   # the tokens to compute this step
    start_pos: int             # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: Sequence[int]   # every KV block of the sequence, in order
    sample: bool               # whether the logits of its last token are wanted


def block_table_array(block_ids: Sequence[Sequence[int]] | np.ndarray, width: int, rows: int | None = None,
                      dtype: type = np.int64) -> np.ndarray:
    """Each sequence's first ``width`` block ids as one row of a ``[rows, width]`` array (0-padded).

    ``block_ids`` is a list of lists, or a ``[B, W']`` array whose rows are 0-padded already.
    ``rows`` (default the number of sequences) may exceed it: the extra rows are 0 (the scratch
    block), as padding rows of a fixed-size batch need.
    """
    b = len(block_ids)
    rows = b if rows is None else rows
    table = np.zeros((rows, width), dtype=dtype)
    if isinstance(block_ids, np.ndarray):
        w = min(width, block_ids.shape[1]) if block_ids.ndim == 2 else 0
        table[:b, :w] = block_ids[:, :w]
        return table
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=b)                 # [B]
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int64, count=int(lens.sum()))
    starts = np.zeros(b, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    take = np.minimum(lens, width)                                                   # [B]
    seq = np.repeat(np.arange(b), take)                                              # [N]
    col = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)       # [N]
    table[seq, col] = flat[starts[seq] + col]
    return table


@dataclasses.dataclass(eq=False)
class TokenFeed:
    """Input tokens that the previous step samples (not known on the host when the step is built).

    Attributes:
        rows: ``[K]`` int64, rows of the batch's ``token_ids`` (their host value is a placeholder).
        src: ``[K]`` int64, the row of each in the previous step's sampled tokens.
        tokens: the previous step's sampled tokens ``[S]`` int64, on the device (set by the engine).
    """

    rows: np.ndarray
    src: np.ndarray
    tokens: Any = None

    def apply_on_host(self, token_ids: np.ndarray) -> np.ndarray:
        """``token_ids`` with the fed rows filled in, read from ``tokens`` (for a runner that computes
        on the CPU, where the previous step's tokens are already there)."""
        out = np.array(token_ids, dtype=np.int64, copy=True)
        out[self.rows] = self.tokens.cpu().numpy()[self.src]
        return out


@dataclasses.dataclass(eq=False)
class StateCheckpoints:
    """A step's work on the prefix cache's checkpoints of recurrent state (models with Mamba layers; see
    :mod:`plinth.core.block_manager`): the sequences (batch indices) that start from a checkpoint slot's state, and
    the saves: a sequence's state after the first ``offset`` of its tokens of the step into a slot."""

    restore_seqs: np.ndarray    # [R] int64
    restore_slots: np.ndarray   # [R] int64
    save_seqs: np.ndarray       # [S] int64
    save_offsets: np.ndarray    # [S] int64
    save_slots: np.ndarray      # [S] int64

    @classmethod
    def of(cls, index: dict[str, int], restores: dict[str, int],
           saves: dict[str, list[tuple[int, int]]]) -> StateCheckpoints | None:
        """From the scheduler's plan (request id -> slot, request id -> ``[(offset, slot)]``) and each scheduled
        request's batch index; ``None``: nothing to do."""
        r = [(index[rid], slot) for rid, slot in restores.items() if rid in index]
        w = [(index[rid], off, slot) for rid, planned in saves.items() if rid in index for off, slot in planned]
        if not r and not w:
            return None
        ra = np.array(r, dtype=np.int64).reshape(-1, 2)
        wa = np.array(w, dtype=np.int64).reshape(-1, 3)
        return cls(ra[:, 0], ra[:, 1], wa[:, 0], wa[:, 1], wa[:, 2])


@dataclasses.dataclass(eq=False)
class FlatBatch(Sequence[SeqBatchEntry]):
    """One step's sequences as flat arrays.

    Attributes:
        token_ids: ``[T]`` int64, every sequence's new tokens, concatenated.
        q_lens: ``[N]`` int64, new tokens per sequence.
        starts: ``[N]`` int64, position of each sequence's first new token.
        block_tables: ``[N, W]`` int32, each sequence's blocks, 0-padded (W: the most blocks any holds).
        block_counts: ``[N]`` int64, blocks each sequence holds.
        sample: ``[N]`` bool, whether the sequence's last token is sampled.
        decode_only: every sequence computes one token and is sampled (a decode step), and no one reads the
            step's hidden states: it may be a replayed decode graph.
        feed: the tokens that the step in flight samples (asynchronous scheduling), or None.
        needs_hidden: the step's hidden states are read afterwards (embeddings), so it is never decode-only.
        lora_slots: ``[N]`` int64, each sequence's LoRA adapter slot (-1: the base model); ``None``: no adapters.
        lora_loads: ``(slot, adapter)`` pairs (:class:`~plinth.lora.adapter.LoRAAdapter`) to copy into the
            slots before the step runs.
        num_logits: ``[N]`` int64, how many of a sampled sequence's last positions are sampled (speculative
            decoding: its token and each draft), or ``None``: one each.
        images: the rows that take image embeddings instead of their tokens' (prompt positions of image inputs),
            as :data:`~plinth.multimodal.runner.ImageRows`; ``None``: none.
        rope_shift: ``[T]`` int64 added to each token's position for its rotary embedding (multimodal RoPE: a
            Qwen2-VL prompt's text after an image sits at positions other than its index), or ``None``: none.
        state_rows: ``[N]`` int64, each sequence's row of the model's recurrent state (its block-table row, its own
            while it runs; models with Mamba layers), or ``None``: the model keeps no such state.
        state_checkpoints: the step's restores and saves of such states' prefix-cache checkpoints, or ``None``.
        token_types: ``[T]`` int64, each token's segment (token type: an encoder's text pairs), or ``None``: every
            token's is 0.
    """

    token_ids: np.ndarray
    q_lens: np.ndarray
    starts: np.ndarray
    block_tables: np.ndarray
    block_counts: np.ndarray
    sample: np.ndarray
    decode_only: bool
    feed: TokenFeed | None = None
    needs_hidden: bool = False
    lora_slots: np.ndarray | None = None
    lora_loads: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    num_logits: np.ndarray | None = None
    images: list[Any] | None = None
    rope_shift: np.ndarray | None = None
    state_rows: np.ndarray | None = None
    state_checkpoints: StateCheckpoints | None = None
    token_types: np.ndarray | None = None
    _entries: list[SeqBatchEntry] | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_entries(cls, entries: Sequence[SeqBatchEntry]) -> FlatBatch:
        """The arrays of a list of entries (one pass over them)."""
        if isinstance(entries, FlatBatch):
            return entries
        n = len(entries)
        q_lens = np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n)
        counts = np.fromiter((len(e.block_ids) for e in entries), dtype=np.int64, count=n)
        sample = np.fromiter((e.sample for e in entries), dtype=np.bool_, count=n)
        num_tokens = int(q_lens.sum())
        return cls(
            token_ids=np.fromiter((t for e in entries for t in e.token_ids), dtype=np.int64, count=num_tokens),
            q_lens=q_lens,
            starts=np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n),
            block_tables=block_table_array([e.block_ids for e in entries], int(counts.max()) if n else 0,
                                           dtype=np.int32),
            block_counts=counts,
            sample=sample,
            decode_only=num_tokens == n and bool(sample.all()),
        )

    def block_ids_flat(self) -> np.ndarray:
        """``[sum(block_counts)]`` int64: every sequence's blocks, concatenated."""
        width = self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0
        mask = np.arange(width) < self.block_counts[:, None]                     # [N, W]
        return self.block_tables[mask].astype(np.int64)

    # ---------------------------------------------------------------- Sequence[SeqBatchEntry]

    def entries(self) -> list[SeqBatchEntry]:
        """The batch as entries (built once, on first use: callers that take entries iterate it)."""
        if self._entries is None:
            if self.feed is not None:
                raise ValueError("a batch fed by the step in flight has no host token ids to make entries of")
            ends = np.cumsum(self.q_lens).tolist()
            tokens, starts, counts = self.token_ids.tolist(), self.starts.tolist(), self.block_counts.tolist()
            tables, sample = self.block_tables.tolist(), self.sample.tolist()
            out = []
            begin = 0
            for i, end in enumerate(ends):
                out.append(SeqBatchEntry(tokens[begin:end], starts[i], tables[i][: counts[i]], sample[i]))
                begin = end
            self._entries = out
        return self._entries

    def __len__(self) -> int:
        return len(self.q_lens)

    @overload
    def __getitem__(self, i: int) -> SeqBatchEntry: ...

    @overload
    def __getitem__(self, i: slice) -> list[SeqBatchEntry]: ...

    def __getitem__(self, i: int | slice) -> SeqBatchEntry | list[SeqBatchEntry]:
        return self.entries()[i]

    def __iter__(self) -> Iterator[SeqBatchEntry]:
        return iter(self.entries())


class PersistentBlockTable:
    """Block ids of running requests, one table row each, kept up to date between steps.

    A row mirrors one request's ``block_ids`` list. The block manager only appends to that list
    while the request holds its blocks, and gives the request a new list when it frees them
    (finish, abort, preemption), so :meth:`row` writes just the appended ids, and rewrites the row
    when the list object is not the one it mirrors. Entries past a row's length are always 0.

    Args:
        width: the most blocks a sequence can hold (grown on demand).
        rows: the initial number of rows (grown on demand).
    """

    def __init__(self, width: int, rows: int = 64):
        self.table = np.zeros((max(rows, 1), max(width, 1)), dtype=np.int32)   # [R, W]
        self._lens: list[int] = [0] * len(self.table)
        self._lens_array = np.zeros(len(self.table), dtype=np.int64)          # [R] the same, for gathers
        self._lists: list[list[int] | None] = [None] * len(self.table)
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(len(self.table) - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def row(self, key: str, blocks: list[int]) -> int:
        """The row of request ``key``, brought up to date with its block list ``blocks``."""
        row = self._row_of.get(key)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else self._grow_rows()
            self._row_of[key] = row
        n, have = len(blocks), self._lens[row]
        if blocks is self._lists[row] and n >= have:
            if n > have:
                if n > self.table.shape[1]:
                    self._grow_width(n)
                self.table[row, have:n] = blocks[have:]
                self._lens[row] = n
                self._lens_array[row] = n
            return row
        self._write(row, blocks)
        return row

    def release(self, key: str) -> None:
        """Forget request ``key`` (finished, aborted or preempted); unknown keys are ignored."""
        row = self._row_of.pop(key, None)
        if row is None:
            return
        self.table[row, : self._lens[row]] = 0
        self._lens[row] = 0
        self._lens_array[row] = 0
        self._lists[row] = None
        self._free_rows.append(row)

    def counts(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows)]`` int64: blocks held by the given rows."""
        return self._lens_array[rows]

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """``[len(rows), width]`` int32: the given rows, cut or 0-padded to ``width`` columns."""
        if width <= self.table.shape[1]:
            return self.table[rows, :width]
        out = np.zeros((len(rows), width), dtype=np.int32)
        out[:, : self.table.shape[1]] = self.table[rows]
        return out

    def _write(self, row: int, blocks: list[int]) -> None:
        n = len(blocks)
        if n > self.table.shape[1]:
            self._grow_width(n)
        self.table[row, : max(n, self._lens[row])] = 0
        self.table[row, :n] = blocks
        self._lens[row] = n
        self._lens_array[row] = n
        self._lists[row] = blocks

    def _grow_rows(self) -> int:
        old = len(self.table)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._lens += [0] * old
        self._lens_array = np.concatenate([self._lens_array, np.zeros(old, dtype=np.int64)])
        self._lists += [None] * old
        self._free_rows.extend(range(2 * old - 1, old, -1))
        return old

    def _grow_width(self, width: int) -> None:
        grown = np.zeros((len(self.table), max(width, 2 * self.table.shape[1])), dtype=np.int32)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown


class BatchBuilder:
    """Turns each step's schedule into a :class:`FlatBatch`, keeping the block table between steps.

    Args:
        max_blocks_per_seq: the block-table width (``max_model_len / block_size``, rounded up).
        max_num_seqs: the most running requests (the initial number of table rows).
        keep_hidden: every step's hidden states are read afterwards (an embedding engine): no batch is
            decode-only, so none is a replayed decode graph.
    """

    def __init__(self, max_blocks_per_seq: int, max_num_seqs: int, keep_hidden: bool = False):
        self.block_table = PersistentBlockTable(max_blocks_per_seq, max_num_seqs)
        self.keep_hidden = keep_hidden
        #: with LoRA adapters: the engine's :class:`~plinth.lora.slots.LoRASlotTable`, and a function that returns
        #: the scheduler's running requests (whose adapters keep their slots)
        self.lora_slots: Any = None
        self.running: Any = tuple
        #: speculative decoding: a sequence's token and drafts go as one-token rows of the sequence at consecutive
        #: positions (a decode batch: CPU decode plans and compiled steps run it), instead of a query of several
        #: tokens sampled at each. Only for attention backends that write every row's keys before any row attends
        #: (the CPU backends; not a decode kernel that writes a row's keys itself, as Triton's fused one does).
        self.drafts_as_rows = False
        #: the model keeps recurrent state per sequence (Mamba layers): batches carry the sequences' rows
        self.carries_state_rows = False

    def release(self, out: SchedulerOutput) -> None:
        """Free the rows of the requests preempted or finished (call for every step, even an empty one)."""
        table = self.block_table
        for rid in out.preempted_request_ids:
            table.release(rid)
        for rid in out.finished_request_ids:
            table.release(rid)

    def build(self, out: SchedulerOutput, in_flight: dict[str, int] | None = None) -> tuple[FlatBatch, list[Any]]:
        """The step's batch, and the requests it samples, one per sampled row in batch order (a sequence with
        drafts: a :class:`~plinth.core.speculative.DraftRow` for each of its sampled positions).

        Args:
            out: the scheduler's output.
            in_flight: request id -> row in the sampled tokens of the step in flight, for requests
                whose last token that step samples (asynchronous scheduling); their rows go to
                the batch's :class:`TokenFeed`.
        """
        self.release(out)
        table = self.block_table
        row_of = table.row
        rows: list[int] = []
        q_lens: list[int] = []
        starts: list[int] = []
        tokens: list[int] = []
        sample: list[bool] = []
        sampled: list[Any] = []
        fed_rows: list[int] = []
        fed_src: list[int] = []
        num_logits: list[int] | None = None
        expanded: list[int] | None = None   # drafts as rows: rows per scheduled entry
        images: list[Any] | None = None
        shifts: list[tuple[int, np.ndarray]] | None = None   # (first row, shifts) of multimodal-RoPE sequences
        types: list[tuple[int, np.ndarray]] | None = None    # (first row, token types) of sequences that have them
        for i, s in enumerate(out.scheduled):
            req = s.request
            row = row_of(req.request_id, req.block_ids)
            start, num_new = s.num_computed_tokens, s.num_new_tokens
            if req.rope_layout is not None:
                if shifts is None:
                    shifts = []
                shifts.append((len(tokens), req.rope_layout.shifts(start, 1 + s.num_drafts if s.num_drafts else num_new)))
            if s.num_drafts and self.drafts_as_rows:
                if expanded is None:
                    expanded = [1] * i
                expanded.append(1 + s.num_drafts)
                rows.extend([row] * (1 + s.num_drafts))
                starts.extend(range(start, start + 1 + s.num_drafts))
                q_lens.extend([1] * (1 + s.num_drafts))
                tokens.append(req.all_token_ids[start])
                tokens.extend(req.draft_token_ids)
                sample.extend([True] * (1 + s.num_drafts))
                sampled.extend(DraftRow(req, j) for j in range(1 + s.num_drafts))
                continue
            if expanded is not None:
                expanded.append(1)
            rows.append(row)
            starts.append(start)
            q_lens.append(num_new)
            if s.num_drafts:   # its token, then the drafts: a row of logits after each
                if num_logits is None:
                    num_logits = [1] * i
                num_logits.append(1 + s.num_drafts)
                tokens.append(req.all_token_ids[start])
                tokens.extend(req.draft_token_ids)
                sample.append(True)
                sampled.extend(DraftRow(req, j) for j in range(1 + s.num_drafts))
                continue
            if num_logits is not None:
                num_logits.append(1)
            if req.images and start < len(req.prompt_token_ids):
                images = _image_rows(req.images, start, num_new, len(tokens), images)
            if req.token_types is not None:
                if types is None:
                    types = []
                types.append((len(tokens), req.token_types[start:start + num_new]))
            if num_new == 1:
                known = req.all_token_ids
                if start < len(known):
                    tokens.append(known[start])
                else:   # sampled by the step in flight
                    if in_flight is None or req.request_id not in in_flight:
                        raise ValueError(f"request {req.request_id!r}: token {start} is not known and no step "
                                         "in flight samples it")
                    fed_rows.append(len(tokens))
                    fed_src.append(in_flight[req.request_id])
                    tokens.append(0)
            else:
                tokens.extend(req.all_token_ids[start:start + num_new])
            sample.append(s.sample)
            if s.sample:
                sampled.append(req)
        lora_slots, lora_loads = (self.lora_slots.assign([s.request for s in out.scheduled], self.running())
                                  if self.lora_slots is not None else (None, []))
        if lora_slots is not None and expanded is not None:
            lora_slots = np.repeat(lora_slots, expanded)
        row_array = np.array(rows, dtype=np.int64)                                  # [N]
        counts = table.counts(row_array)
        batch = FlatBatch(
            token_ids=np.array(tokens, dtype=np.int64),
            q_lens=np.array(q_lens, dtype=np.int64),
            starts=np.array(starts, dtype=np.int64),
            block_tables=table.gather(row_array, int(counts.max()) if len(rows) else 0),
            block_counts=counts,
            sample=np.array(sample, dtype=np.bool_),
            decode_only=len(tokens) == len(rows) == len(sampled) and not self.keep_hidden and not images,
            needs_hidden=self.keep_hidden,
            feed=(TokenFeed(np.array(fed_rows, dtype=np.int64), np.array(fed_src, dtype=np.int64))
                  if fed_rows else None),
            lora_slots=lora_slots,
            lora_loads=lora_loads,
            num_logits=np.array(num_logits, dtype=np.int64) if num_logits is not None else None,
            images=images,
            rope_shift=_at_rows(shifts, len(tokens)) if shifts else None,
            token_types=_at_rows(types, len(tokens)) if types else None,
            state_rows=row_array if self.carries_state_rows else None,
            state_checkpoints=(StateCheckpoints.of({s.request.request_id: i for i, s in enumerate(out.scheduled)},
                                                   out.state_restores, out.state_saves)
                               if out.state_restores or out.state_saves else None),
        )
        return batch, sampled


def _at_rows(parts: list[tuple[int, np.ndarray]], num_tokens: int) -> np.ndarray:
    """``[T]`` int64: each part's values at its rows (from its first row on), 0 elsewhere."""
    out = np.zeros(num_tokens, dtype=np.int64)
    for base, values in parts:
        out[base:base + len(values)] = values
    return out


def _image_rows(items: list[Any], start: int, num_new: int, base: int, out: list[Any] | None) -> list[Any] | None:
    """``out`` (a new list if ``None`` and needed) with the image rows of positions ``[start, start + num_new)`` of a
    sequence whose first new token is row ``base`` of the flat batch."""
    end = start + num_new
    for item in items:
        lo, hi = max(start, item.offset), min(end, item.end)
        if lo < hi:
            if out is None:
                out = []
            out.append((base + lo - start, hi - lo, item, lo - item.offset))
    return out
