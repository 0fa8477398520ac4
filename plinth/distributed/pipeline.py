"""Pipeline-parallel execution of one step on one stage, in micro-batches.

A step's sequences are cut into up to ``pp_size`` contiguous micro-batches of about equal
token counts. Each stage runs the micro-batches in order: it receives a micro-batch's
``(hidden, residual)`` from the previous stage (one ``[2, T, H]`` message), runs its layers
and starts sending the result to the next stage asynchronously, then goes on with the next
micro-batch. So while stage ``s`` works on micro-batch ``i`` stage ``s + 1`` works on ``i - 1``:
a step costs about ``(m + p - 1) / m`` stage-times instead of ``p`` (``m`` micro-batches, ``p``
stages; with ``m = p = 2``, 1.5 instead of 2). A batch of one sequence is one micro-batch and
does not overlap.

Micro-batches are contiguous and run in the same order on every stage, so a sequence that
reads KV blocks another sequence of the same step writes (prefix-cache sharing, ``n > 1``)
still finds them written: the writer comes first in the step, hence in the same or an earlier
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from plinth.distributed.communication import pp_recv, pp_send_async
from plinth.distributed.parallel_state import ParallelLayout
from plinth.worker.batching import FlatBatch, StateCheckpoints
from plinth.worker.model_runner import ModelRunner, SeqBatchEntry


def split_microbatches(entries: Sequence[SeqBatchEntry] | FlatBatch, max_parts: int) -> list[range]:
    """Contiguous ranges of entry indices, at most ``max_parts``, with balanced token counts."""
    n = len(entries)
    parts = max(1, min(max_parts, n))
    if parts == 1:
        return [range(n)]
    q_lens = entries.q_lens if isinstance(entries, FlatBatch) else [len(e.token_ids) for e in entries]
    cum = np.cumsum(q_lens)   # [N]
    total = int(cum[-1])
    bounds = [0]
    for k in range(1, parts):
        cut = int(np.searchsorted(cum, total * k / parts, side="left")) + 1
        cut = min(max(cut, bounds[-1] + 1), n - (parts - k))    # every part keeps at least one entry
        bounds.append(cut)
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def sub_batch(batch: FlatBatch, part: range) -> FlatBatch:
    """Sequences ``part`` (contiguous) of ``batch``, as views of its arrays."""
    if batch.feed is not None:
        raise ValueError("pipeline micro-batches do not take tokens fed by a step in flight")
    a, b = part.start, part.stop
    ends = np.cumsum(batch.q_lens)                                           # [N]
    t0, t1 = (int(ends[a - 1]) if a else 0), int(ends[b - 1])
    counts = batch.block_counts[a:b]
    width = int(counts.max()) if b > a else 0
    return FlatBatch(token_ids=batch.token_ids[t0:t1], q_lens=batch.q_lens[a:b], starts=batch.starts[a:b],
                     block_tables=batch.block_tables[a:b, :width], block_counts=counts, sample=batch.sample[a:b],
                     decode_only=t1 - t0 == b - a and bool(batch.sample[a:b].all()),
                     lora_slots=batch.lora_slots[a:b] if batch.lora_slots is not None else None,
                     num_logits=batch.num_logits[a:b] if batch.num_logits is not None else None,
                     rope_shift=batch.rope_shift[t0:t1] if batch.rope_shift is not None else None,
                     token_types=batch.token_types[t0:t1] if batch.token_types is not None else None,
                     state_rows=batch.state_rows[a:b] if batch.state_rows is not None else None,
                     state_checkpoints=_sub_checkpoints(batch.state_checkpoints, a, b),
                     images=[(row - t0, *rest) for row, *rest in batch.images if t0 <= row < t1] or None
                     if batch.images else None)


def _sub_checkpoints(c: StateCheckpoints | None, a: int, b: int) -> StateCheckpoints | None:
    """The recurrent-state checkpoint work of sequences ``a .. b - 1``, their indices made relative to ``a``."""
    if c is None:
        return None
    r = (c.restore_seqs >= a) & (c.restore_seqs < b)
    w = (c.save_seqs >= a) & (c.save_seqs < b)
    if not r.any() and not w.any():
        return None
    return StateCheckpoints(c.restore_seqs[r] - a, c.restore_slots[r], c.save_seqs[w] - a, c.save_offsets[w],
                            c.save_slots[w])


class PipelineStage:
    """Runs this rank's stage of the model over a step's micro-batches.

    Args:
        runner: the stage's model runner (its KV cache holds this stage's layers only).
        layout: this rank's place in the TP x PP grid.
        hidden_size: the model width.
        dtype: the activation dtype.
    """

    def __init__(self, runner: ModelRunner, layout: ParallelLayout, hidden_size: int, dtype: torch.dtype):
        self.runner = runner
        self.model: Any = runner.model
        self.layout = layout
        self.hidden_size = hidden_size
        self.dtype = dtype

    def _image_inputs(self, part: FlatBatch) -> tuple[torch.Tensor | None, ...]:
        """A micro-batch's image rows: the first stage encodes them (their embeddings replace the token
        embeddings); later stages take the rows and, for a multimodal RoPE, their positions."""
        from plinth.multimodal.runner import image_rows_without_embeddings

        assert part.images
        if self.layout.is_first_stage:
            if self.runner.images is None:
                raise RuntimeError("a batch with image inputs reached a first stage without an image encoder")
            return self.runner.images.rows(part.images)
        rows, *positions = image_rows_without_embeddings(part.images, self.runner.device)
        return rows, None, *positions

    @torch.inference_mode()
    def execute(self, entries: Sequence[SeqBatchEntry] | FlatBatch) -> tuple[torch.Tensor | None, list[int],
                                                                              list[torch.Tensor]]:
        """Run the step.

        Returns:
            (logits ``[S, vocab]`` float32 on the last stage, else ``None``; the sampled entry
            indices; the final hidden states of each micro-batch on the last stage, else ``[]``).
        """
        runner, layout = self.runner, self.layout
        sends: list[tuple[Any, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        sample_seqs: list[int] = []
        hiddens: list[torch.Tensor] = []
        batch = FlatBatch.from_entries(entries)
        runner.load_adapters(batch)
        runner.restore_states(batch)   # (models with recurrent state: each stage its own layers')
        try:
            for mb in split_microbatches(batch, layout.pp_size):
                part = sub_batch(batch, mb)
                inputs = runner.prepare(part)
                runner.backend.prepare(inputs.metadata)
                hidden = residual = None
                if not layout.is_first_stage:
                    t = inputs.metadata.num_tokens
                    packed = pp_recv((2, t, self.hidden_size), self.dtype, runner.device)   # [2, T, H]
                    hidden, residual = packed[0], packed[1]
                extra = {"image_embeds": self._image_inputs(part)} if part.images else {}
                hidden, residual = self.model.forward_stage(inputs.input_ids, inputs.positions, inputs.metadata,
                                                            hidden, residual, **extra)
                runner.save_states(part)
                if not layout.is_last_stage:
                    packed = torch.stack((hidden, residual))    # [2, T, H]
                    sends.append((pp_send_async(packed), packed))
                    continue
                hiddens.append(hidden)
                if inputs.sample_seqs:
                    logits.append(self.model.compute_logits(hidden[inputs.sample_rows]))
                    sample_seqs.extend(mb.start + i for i in inputs.sample_seqs)
        finally:
            for work, _ in sends:
                work.wait()
        if not layout.is_last_stage:
            return None, [], []
        vocab = self.model.ctx.hf_config.vocab_size
        out = torch.cat(logits) if logits else torch.empty(0, vocab, dtype=torch.float32, device=runner.device)
        return out, sample_seqs, hiddens
