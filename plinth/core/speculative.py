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
from collections.abc import Sequence
from typing import Any

import numpy as np

from plinth.core.request import Request


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens, for the largest ``n`` from ``max_n`` down to ``min_n`` that occurs.

    Args:
        num_tokens: the most draft tokens proposed.
        min_n, max_n: the n-gram sizes searched.
    """

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, num_tokens)`` draft tokens to follow ``token_ids`` (possibly none)."""
        k = min(limit, self.num_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = tokens[length - n:]
            # starts i of earlier occurrences: tokens[i:i + n] == pattern with i + n < length (a token follows)
            starts = np.flatnonzero(tokens[:length - n] == pattern[0])
            for i in starts[::-1].tolist():
                if n == 1 or np.array_equal(tokens[i:i + n], pattern):
                    return tokens[i + n:i + n + k].tolist()
        return []


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
