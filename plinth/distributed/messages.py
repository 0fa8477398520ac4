"""What the driver sends to every worker each step: the batch as a few flat numpy arrays.

Flat arrays pickle in one pass with no per-sequence Python objects, so one encoding is cheap
to send to many workers (over pipes or through Ray's object store).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from plinth.core.logits_processors import ProcessorRow
from plinth.worker.batching import FlatBatch, StateCheckpoints
from plinth.worker.model_runner import SeqBatchEntry


@dataclasses.dataclass
class StepBatch:
    """One step's scheduled sequences.

    Attributes:
        token_ids: ``[T]`` int64, every sequence's new tokens, concatenated.
        q_lens: ``[N]`` int64, new tokens per sequence.
        starts: ``[N]`` int64, position of each sequence's first new token.
        block_counts: ``[N]`` int64, KV blocks per sequence.
        block_ids: ``[sum(block_counts)]`` int64, every sequence's blocks, concatenated.
        sample: ``[N]`` bool, whether the sequence's last token is sampled.
        needs_hidden: the step's hidden states are read afterwards (embeddings): never a replayed decode step.
        lora_slots, lora_loads: the LoRA adapters' slots and loads (see :class:`~plinth.worker.batching.FlatBatch`).
        num_logits: sampled positions per sequence (speculative decoding; see the same).
        images: the rows that take image embeddings, with the images' pixels (see the same).
        rope_shift: rotary positions apart from the cache's (multimodal RoPE; see the same).
        state_rows: each sequence's row of the model's recurrent state (Mamba layers; see the same).
        state_checkpoints: the step's restores and saves of those states' prefix-cache checkpoints (see the same).
        token_types: each token's segment (an encoder's text pairs; see the same).
    """

    token_ids: np.ndarray
    q_lens: np.ndarray
    starts: np.ndarray
    block_counts: np.ndarray
    block_ids: np.ndarray
    sample: np.ndarray
    needs_hidden: bool = False
    lora_slots: np.ndarray | None = None
    lora_loads: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    num_logits: np.ndarray | None = None
    images: list[Any] | None = None
    rope_shift: np.ndarray | None = None
    state_rows: np.ndarray | None = None
    state_checkpoints: StateCheckpoints | None = None
    token_types: np.ndarray | None = None

    @classmethod
    def from_entries(cls, entries: Sequence[SeqBatchEntry] | FlatBatch) -> StepBatch:
        """The batch of a step; a :class:`~plinth.worker.batching.FlatBatch` (the engine's) is taken
        as its arrays, with no pass over the sequences."""
        if isinstance(entries, FlatBatch):
            if entries.feed is not None:
                raise ValueError("a batch fed by the step in flight (asynchronous scheduling) cannot go to "
                                 "worker processes: its token ids are on the engine's device")
            return cls(token_ids=entries.token_ids, q_lens=entries.q_lens, starts=entries.starts,
                       block_counts=entries.block_counts, block_ids=entries.block_ids_flat(), sample=entries.sample,
                       needs_hidden=entries.needs_hidden, lora_slots=entries.lora_slots,
                       lora_loads=entries.lora_loads, num_logits=entries.num_logits, images=entries.images,
                       rope_shift=entries.rope_shift, state_rows=entries.state_rows,
                       state_checkpoints=entries.state_checkpoints, token_types=entries.token_types)
        n = len(entries)
        q_lens = np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n)
        block_counts = np.fromiter((len(e.block_ids) for e in entries), dtype=np.int64, count=n)
        return cls(
            token_ids=np.fromiter((t for e in entries for t in e.token_ids), dtype=np.int64, count=int(q_lens.sum())),
            q_lens=q_lens,
            starts=np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n),
            block_counts=block_counts,
            block_ids=np.fromiter((b for e in entries for b in e.block_ids), dtype=np.int64,
                                  count=int(block_counts.sum())),
            sample=np.fromiter((e.sample for e in entries), dtype=np.bool_, count=n),
        )

    def flat(self) -> FlatBatch:
        """The batch as the model runner's :class:`~plinth.worker.batching.FlatBatch` (numpy only)."""
        n = len(self.q_lens)
        width = int(self.block_counts.max()) if n else 0
        tables = np.zeros((n, width), dtype=np.int32)                          # [N, W]
        tables[np.arange(width) < self.block_counts[:, None]] = self.block_ids
        return FlatBatch(token_ids=self.token_ids, q_lens=self.q_lens, starts=self.starts, block_tables=tables,
                         block_counts=self.block_counts, sample=self.sample, needs_hidden=self.needs_hidden,
                         lora_slots=self.lora_slots, lora_loads=self.lora_loads, num_logits=self.num_logits,
                         images=self.images, rope_shift=self.rope_shift, state_rows=self.state_rows,
                         state_checkpoints=self.state_checkpoints, token_types=self.token_types,
                         decode_only=len(self.token_ids) == n and bool(self.sample.all()) and not self.needs_hidden
                         and not self.images)

    def entries(self) -> list[SeqBatchEntry]:
        """The batch as the model runner's entries (views into the arrays, no copies of the ids)."""
        tok_ends = np.cumsum(self.q_lens)
        blk_ends = np.cumsum(self.block_counts)
        out = []
        for i in range(len(self.q_lens)):
            t1, b1 = int(tok_ends[i]), int(blk_ends[i])
            out.append(SeqBatchEntry(self.token_ids[t1 - int(self.q_lens[i]):t1].tolist(), int(self.starts[i]),
                                     self.block_ids[b1 - int(self.block_counts[i]):b1].tolist(),
                                     bool(self.sample[i])))
        return out

    @property
    def num_sampled(self) -> int:
        return int(self.sample.sum())


#: torch dtypes whose host tensors travel as numpy arrays (the sampling parameters' and outputs')
_NUMPY_DTYPES = frozenset({torch.bool, torch.int32, torch.int64, torch.float32, torch.float64})


@dataclasses.dataclass
class HostArray:
    """A host tensor on its way between processes, as a numpy array.

    Pickling a torch tensor serialises its storage through ``torch.save`` (~50 us a tensor, more to
    load); a numpy array pickles as its raw bytes. The sampling parameters and the sampled tokens
    cross the pipes every step, so they travel as these.
    """

    array: np.ndarray

    def tensor(self, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        """The array as a tensor on ``device``; with ``non_blocking`` a CUDA copy goes through pinned
        memory and does not wait for the device (a copy from pageable memory synchronises the stream)."""
        # an array unpickled from a byte string is read-only: torch needs memory it may write
        array = self.array if self.array.flags.writeable else self.array.copy()
        t = torch.from_numpy(array)
        if device.type == "cpu":
            return t
        if non_blocking and device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)


def pack_tensors(obj: Any) -> Any:
    """``obj`` with every host tensor of a numpy-compatible dtype (also inside tuples and nested
    dataclasses) replaced by a :class:`HostArray`; other values are kept."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES:
            return HostArray(obj.contiguous().numpy())
        return obj
    if isinstance(obj, ProcessorRow):   # token ids and extra_args: nothing to walk (pickled as they are)
        return obj
    if isinstance(obj, tuple):
        return tuple(pack_tensors(x) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, HostArray):
        return dataclasses.replace(obj, **{f.name: pack_tensors(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def unpack_tensors(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """The inverse of :func:`pack_tensors`, with every tensor (packed or not) on ``device``
    (``non_blocking``: see :meth:`HostArray.tensor`)."""
    if isinstance(obj, HostArray):
        return obj.tensor(device, non_blocking)
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=obj.device.type == "cpu")
    if isinstance(obj, ProcessorRow):
        return obj
    if isinstance(obj, tuple):
        return tuple(unpack_tensors(x, device, non_blocking) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: unpack_tensors(getattr(obj, f.name), device, non_blocking)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
