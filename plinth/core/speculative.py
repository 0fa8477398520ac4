"""Speculative decoding: draft tokens proposed on the host, verified by the model in one step.

A decode step normally computes one token per sequence. With speculation, a sequence whose recent tokens
occurred earlier in its context (prompt lookup, ``method="ngram"``) also computes the ``k`` tokens that
followed that earlier occurrence, and the step samples at every one of those positions. Sampling position
``j`` draws from the model's distribution given the context and the drafts before ``j``; the draft token
``j + 1`` is accepted while the sample there equals it, and the first sample that differs (or the sample after
the last draft) ends the step's tokens. For a deterministic proposal this is exact rejection sampling: a draft
``d`` is accepted with probability ``p(d)``, and on rejection the sample is distributed as ``p`` without ``d``,
renormalised. So greedy requests get exactly the tokens they would get without speculation, seeded requests
too (each position's noise is keyed by its output index), and unseeded ones the same distribution.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from plinth.core.request import Request


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens, for the largest ``n`` from ``max_n`` down to ``min_n`` that occurs.

    Each request's tokens are mirrored in a numpy buffer that grows with them (a step appends a few), so a
    proposal costs one vectorised pass over the context for the last token's earlier occurrences, then a check of
    those few candidates, rather than a conversion of the whole token list.

    Args:
        num_tokens: the most draft tokens proposed.
        min_n, max_n: the n-gram sizes searched.
    """

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: weakref.WeakKeyDictionary[Any, _TokenBuffer] = weakref.WeakKeyDictionary()

    def propose_for(self, req: Request, limit: int) -> list[int]:
        """Drafts for ``req`` (at most ``limit``), its tokens mirrored incrementally."""
        buf = self._buffers.get(req)
        if buf is None:
            buf = self._buffers[req] = _TokenBuffer()
        return self._search(buf.sync(req.all_token_ids), limit)

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, num_tokens)`` draft tokens to follow ``token_ids`` (possibly none)."""
        return self._search(np.asarray(token_ids, dtype=np.int64), limit)

    def _search(self, tokens: np.ndarray, limit: int) -> list[int]:
        k = min(limit, self.num_tokens)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        # ends c (< length - 1, so a token follows) of earlier n-grams: first where the last token occurs
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        if not ends.size:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            c = ends[ends >= n - 1]
            ok = np.ones(len(c), dtype=bool)
            for j in range(1, n):
                ok &= tokens[c - j] == tokens[length - 1 - j]
            hits = c[ok]
            if hits.size:
                end = int(hits[-1]) + 1
                return tokens[end:end + k].tolist()
        return []


class _TokenBuffer:
    """A request's tokens as a growing int64 array (appends only; rebuilt if the tokens shrank)."""

    def __init__(self) -> None:
        self.array = np.empty(0, dtype=np.int64)
        self.length = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        n, have = len(tokens), self.length
        if n < have:
            have = 0
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array), 256), dtype=np.int64)
            grown[:have] = self.array[:have]
            self.array = grown
        if n > have:
            self.array[have:n] = tokens[have:n]
        self.length = n
        return self.array[:n]


def speculates(req: Request) -> bool:
    """Whether a request's decode steps may carry draft tokens: not with a grammar (its matcher advances one
    token at a time and cannot take back rejected drafts)."""
    return req.matcher is None and req.pooling is None


@dataclasses.dataclass(eq=False)
class DraftRow:
    """One sampled position of a speculative step, as the sampling batch sees a request: the request's
    parameters, with the drafts before this position counted as its output (penalties, ``min_tokens``,
    bad words and per-position seeds then see what a step without speculation would see there)."""

    request: Request
    num_drafts: int   # drafts before this position

    @property
    def sampling_params(self) -> Any:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def prompt_is_embeds(self) -> bool:
        return self.request.prompt_is_embeds

    @property
    def output_token_ids(self) -> list[int]:
        out = self.request.output_token_ids
        return out + self.drafts[:self.num_drafts] if self.num_drafts else out

    @property
    def drafts(self) -> list[int]:
        return self.request.draft_token_ids

    @property
    def num_pending_tokens(self) -> int:
        return self.request.num_pending_tokens

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids

    @property
    def matcher(self) -> Any:
        return None

    @property
    def bad_words_ids(self) -> list[list[int]]:
        return self.request.bad_words_ids

    @property
    def logits_processors(self) -> tuple[bool, ...]:
        return self.request.logits_processors

    @property
    def request_id(self) -> str:
        return self.request.request_id


def accepted_tokens(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """The tokens a verified step yields: ``samples[j]`` for each position while it equals the draft there
    (``samples[j] == drafts[j]``), then the first sample that differs, or the sample after the last draft.
    ``samples`` has one more entry than ``drafts``."""
    out = []
    for j, sample in enumerate(samples):
        out.append(sample)
        if j == len(drafts) or sample != drafts[j]:
            break
    return out


@dataclasses.dataclass
class SpeculativeStats:
    """Counters of speculative steps."""

    num_drafts: int = 0            # sequences that carried drafts in a step
    num_draft_tokens: int = 0      # draft tokens computed
    num_accepted_tokens: int = 0   # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative sequence step (accepted drafts plus the sampled one)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
