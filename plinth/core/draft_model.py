"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes each decoding
sequence's next ``k`` tokens greedily, and the target model verifies them in its next step.

The drafts go through the same verification as n-gram drafts (:mod:`plinth.core.speculative`): a draft is kept
while the target's sample at its position equals it. A greedy draft is one fixed token per position, so this is
exact rejection sampling whatever the draft model says: greedy requests get the tokens they get without drafts, and
sampled ones the same distribution. The draft model only decides how many tokens a step yields.

The draft model keeps its own KV cache, indexed by the target's block ids: a sequence's draft keys and values for
position ``p`` live in the same block and slot as the target's. Before a schedule needs drafts, one batched call
:meth:`DraftProposer.propose_all` brings every decoding sequence's draft KV up to its tokens (a catch-up pass over
the tokens the draft has not computed: the prompt the first time, then the tokens accepted since), which also gives
the first draft, then runs ``k - 1`` one-token decode passes for the rest. Positions past the blocks a sequence
holds (its drafts' slots are allocated only once the drafts are known) are written to scratch blocks past the
target's, and computed again in the real blocks by the next catch-up. Draft KV that is stale (a prefix-cache hit on
blocks the draft never computed, a block reused after preemption) only lowers the acceptance rate: the target's
verification keeps the output exact.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from typing import Any

import numpy as np
import torch

from plinth.core.speculative import speculates
from plinth.worker.batching import FlatBatch, SeqBatchEntry, TokenFeed

__all__ = ["DraftProposer", "scratch_blocks"]

logger = logging.getLogger(__name__)


def scratch_blocks(num_speculative_tokens: int, block_size: int, max_num_seqs: int) -> int:
    """Blocks the draft's KV cache holds past the target's: for each sequence of a step, room for a catch-up and
    drafts that run past the blocks it holds."""
    return max_num_seqs * _scratch_per_seq(num_speculative_tokens, block_size)


def _scratch_per_seq(num_speculative_tokens: int, block_size: int) -> int:
    """Scratch blocks one sequence's drafts may run into: its last partial block's successors."""
    return -(-(num_speculative_tokens + 1) // block_size) + 1


class DraftProposer:
    """Greedy drafts from a draft model, computed for every decoding sequence at once.

    Args:
        runner: the draft model's :class:`~plinth.worker.model_runner.ModelRunner`, whose KV cache has the target's
            blocks and then :func:`scratch_blocks` more.
        scheduler: the target's scheduler (its running requests).
        num_speculative_tokens: drafts per sequence and step.
        num_target_blocks: the target's blocks (the draft cache's scratch blocks follow them).
    """

    def __init__(self, runner: Any, scheduler: Any, num_speculative_tokens: int, num_target_blocks: int):
        self.runner = runner
        self.scheduler = scheduler
        self.k = num_speculative_tokens
        self.block_size = runner.block_size
        #: the last position + 1 the draft takes (its context, within the runner's block tables)
        self.max_len = min(runner.max_blocks_per_seq * runner.block_size,
                           getattr(runner.model, "draft_context", None) or sys.maxsize)
        #: token ids the draft's embedding has (a target's larger vocabulary: its other ids go in as 0)
        self.vocab: int | None = getattr(runner.model, "draft_vocab", None)
        #: set when drafting failed: the engine goes on without drafts
        self.failed = False
        self.num_target_blocks = num_target_blocks
        self.per_seq_scratch = _scratch_per_seq(self.k, self.block_size)
        self.max_scratch_seqs = (runner.num_blocks - num_target_blocks) // self.per_seq_scratch
        #: each request's drafts for its current length: (num_tokens, drafts)
        self._drafts: weakref.WeakKeyDictionary[Any, tuple[int, list[int]]] = weakref.WeakKeyDictionary()
        #: how many of each request's positions hold its draft KV (in its own blocks), and at which preemption count
        self._computed: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
        #: draft tokens proposed, and catch-up passes run as rows of a decode step (counts for logs and tests)
        self.num_proposed = 0
        self.row_passes = 0

    def forget(self) -> None:
        """Forget every sequence's drafts and draft KV (its KV cache was freed: sleep mode)."""
        self._drafts = weakref.WeakKeyDictionary()
        self._computed = weakref.WeakKeyDictionary()

    def propose(self, req: Any, limit: int) -> list[int]:
        """The scheduler's proposer: ``req``'s drafts (at most ``limit``), computed with every other decoding
        sequence's on the first call for its current length."""
        if not speculates(req) or limit <= 0 or self.failed:
            return []
        entry = self._drafts.get(req)
        if entry is None or entry[0] != req.num_tokens:
            try:
                self.propose_all(req)
            except Exception:  # noqa: BLE001 - drafts are an optimization: the engine goes on, exact, without them
                logger.exception("drafting with the draft model failed; speculative decoding is off from now on")
                self.failed = True
                return []
            entry = self._drafts.get(req)
            if entry is None:
                return []
        return entry[1][:limit]

    def _decoding(self, first: Any) -> list[Any]:
        """The running requests that decode in the next step and have no drafts for their length yet (``first``
        among them), at most the scratch room's worth."""
        out = [first]
        for r in self.scheduler.running:
            if r is first or not speculates(r) or r.num_pending_tokens:
                continue
            if r.num_tokens - r.num_computed_tokens != 1:
                continue   # still in its prompt
            entry = self._drafts.get(r)
            if entry is not None and entry[0] == r.num_tokens:
                continue
            out.append(r)
        return out[: max(1, self.max_scratch_seqs)]

    @torch.inference_mode()
    def propose_all(self, first: Any) -> None:
        """Catch each decoding sequence's draft KV up to its tokens and draft up to ``k`` tokens for it (fewer near
        the context limit)."""
        bs, max_len, vocab = self.block_size, self.max_len, self.vocab
        reqs, tables, lens, held, wanted, pending = [], [], [], [], [], []
        for r in self._decoding(first):
            tokens = r.all_token_ids
            n = len(tokens)
            k = min(self.k, max_len - n)
            if k <= 0:
                self._drafts[r] = (n, [])
                continue
            done, preemptions = self._computed.get(r, (0, -1))
            if preemptions != r.metrics.num_preemptions:
                done = 0   # its blocks were given up and taken again
            done = min(done, n - 1)
            real = list(r.block_ids)
            need = -(-(n + k - 1) // bs)   # every position up to the last draft's
            base = self.num_target_blocks + len(reqs) * self.per_seq_scratch
            reqs.append(r)
            tables.append(real[:need] + [base + j for j in range(max(0, need - len(real)))])
            lens.append(n)
            held.append(len(real))
            wanted.append(k)
            tail = tokens[done:]   # the tokens the draft has not computed, from position `done`
            if vocab is not None and max(tail) >= vocab:   # ids the draft does not have: drafts only worse
                tail = [t if t < vocab else 0 for t in tail]
            pending.append((tail, done))
        if not reqs:
            return
        device = self.runner.device
        # each sequence's drafts, kept on the device until all are known (no wait for the device between passes)
        cur = torch.zeros(len(reqs), dtype=torch.int64, device=device)
        rows = sum(len(tail) for tail, _ in pending)
        graphs = self.runner.graphs
        if self.runner.shared_decode_rows and graphs is not None and rows <= getattr(graphs, "max_size", 0):
            # the catch-up as rows of one decode step (each token a row at its position): a replayed graph or
            # the decode plan runs it; each sequence's last row drafts
            entries, last = [], []
            for i, (tail, start) in enumerate(pending):
                entries += [SeqBatchEntry([t], start + j, tables[i], True) for j, t in enumerate(tail)]
                last.append(len(entries) - 1)
                pending[i] = ([], start + len(tail))
            logits, seqs, _ = self.runner.execute(entries)
            row_of = {j: r for r, j in enumerate(seqs)}
            cur = self._take(logits, [row_of[j] for j in last]).argmax(dim=-1)
            self.row_passes += 1
        # otherwise in passes of at most `budget` tokens (a long prompt in pieces): the last piece's logits draft
        budget = max(self.scheduler.config.max_num_batched_tokens, len(reqs))
        while any(tail for tail, _ in pending):
            entries, owners, used = [], [], 0
            for i, (tail, start) in enumerate(pending):
                if not tail or used >= budget:
                    continue
                take = min(len(tail), max(1, budget - used))
                entries.append(SeqBatchEntry(tail[:take], start, tables[i], take == len(tail)))
                owners.append(i)
                pending[i] = (tail[take:], start + take)
                used += take
            logits, seqs, _ = self.runner.execute(entries)
            if seqs:
                cur[self._index([owners[j] for j in seqs])] = logits.argmax(dim=-1)
        steps = [cur]
        for step in range(1, self.k):
            rows_of = [i for i in range(len(reqs)) if wanted[i] > step]
            if not rows_of:
                break
            # the previous pass's drafts go in on the device (a feed), the host's token ids are placeholders
            batch = FlatBatch.from_entries([SeqBatchEntry([0], lens[i] + step - 1, tables[i], True) for i in rows_of])
            batch = dataclasses.replace(batch, feed=TokenFeed(np.arange(len(rows_of)), np.asarray(rows_of), cur))
            logits, seqs, _ = self.runner.execute(batch)
            order = [rows_of[j] for j in seqs]
            if order == list(range(len(reqs))):   # every sequence (the common case): no index to copy
                nxt = logits.argmax(dim=-1)
            else:
                nxt = cur.clone()
                nxt[self._index(order)] = logits.argmax(dim=-1)
            steps.append(nxt)
            cur = nxt
        table = torch.stack(steps, dim=1).tolist()   # [R, passes]: the one wait for the device
        drafts = [row[:wanted[i]] for i, row in enumerate(table)]
        for i, r in enumerate(reqs):
            self._drafts[r] = (lens[i], drafts[i])
            # positions in the blocks it holds keep their draft KV; those in scratch blocks are computed again
            self._computed[r] = (min(lens[i], held[i] * bs), r.metrics.num_preemptions)
        self.num_proposed += sum(len(d) for d in drafts)

    def _index(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an index on the device, copied from page-locked memory (a copy from pageable memory would
        wait for the device's queue)."""
        host = torch.tensor(rows, dtype=torch.int64)
        if self.runner.device.type != "cuda":
            return host
        return host.pin_memory().to(self.runner.device, non_blocking=True)

    def _take(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits[rows]`` (``logits`` itself when ``rows`` are all of its rows in order)."""
        return logits if rows == list(range(len(logits))) else logits[self._index(rows)]
