"""A step's sampling parameters as tensors, rebuilt only as far as the batch changed.

:class:`SamplingBatch` holds one row per sampled request. Most of it depends only on WHICH
requests are in the batch (temperatures, filters, penalty weights, prompt masks, logprob counts);
three parts move every step: the output-token counts (penalties), the ``min_tokens`` masks and
the seeded rows' keys (they hash the output index). :class:`SamplingBatchBuilder` keeps the first
kind between steps while the batch holds the same requests in the same order, updates the counts
with the one token each request gained, and rebuilds everything when the composition changes.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from plinth.core.logits_processors import ProcessorRow
from plinth.core.request import Request, SamplingParams
from plinth.core.structured import allowed_tokens

SAMPLING_EPS = 1e-5   # temperatures below this are greedy
#: the range temperatures and repetition penalties are held to as float32 factors: beyond it sampling is
#: the same (uniform, or the seen tokens first), but a factor that overflows to inf or underflows to 0
#: makes logits NaN
FACTOR_RANGE = (1e-30, 1e30)
M32 = 0xFFFFFFFF


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as device tensors (``None`` = unused by every row)."""

    temperature: torch.Tensor                # [B] float32; 1.0 on greedy rows
    greedy: torch.Tensor                     # [B] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None               # [B] int64 in [1, V] (V = off)
    max_top_k: int                           # host copy of max(top_k)
    top_p: torch.Tensor | None               # [B] float32 (1.0 = off)
    min_p: torch.Tensor | None               # [B] float32 (0.0 = off)
    repetition_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None   # [B] float32
    presence_penalty: torch.Tensor | None    # [B] float32
    output_counts: torch.Tensor | None       # [B, V] float32: occurrences of each token in the output
    prompt_mask: torch.Tensor | None         # [B, V] bool: token occurs in the prompt
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None   # (rows [M], token ids [M]) to mask
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # (rows [L], token ids [L], float32 [L])
    allowed: tuple[torch.Tensor, torch.Tensor] | None   # (rows [R], bool [R, V]): grammars, allowed_token_ids
    seeded_rows: torch.Tensor | None         # [S] int64
    seed_keys: torch.Tensor | None           # [S, 2] int64: 32-bit keys of (seed, output index)
    num_logprobs: list[int | None]           # [B] per row
    max_num_logprobs: int | None
    # custom logits processors: per installed processor, (its row indices, its rows); None: no row for any
    custom: tuple[tuple[tuple[int, ...], tuple[ProcessorRow, ...]], ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.num_logprobs)

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int, device: torch.device | str,
                      processors: Sequence[type] = ()) -> SamplingBatch:
        """Gather the parameters of ``requests`` (one row each, in order) for one step (``processors``: the
        engine's custom logits processor classes)."""
        return _Composition(requests, vocab_size, torch.device(device), processors).batch(requests, remember=False)

    @classmethod
    def plain_greedy(cls, batch_size: int, device: torch.device) -> SamplingBatch:
        """Every row greedy, without penalties, min_tokens or logprobs: the argmax of the raw logits."""
        ones = torch.ones(batch_size, dtype=torch.float32, device=device)
        return cls(
            temperature=ones, greedy=ones.bool(), all_greedy=True, any_greedy=batch_size > 0, top_k=None,
            max_top_k=0, top_p=None, min_p=None, repetition_penalty=None, frequency_penalty=None,
            presence_penalty=None, output_counts=None, prompt_mask=None, min_tokens_index=None, logit_bias=None,
            allowed=None, seeded_rows=None, seed_keys=None, num_logprobs=[None] * batch_size, max_num_logprobs=None,
        )


class SamplingBatchBuilder:
    """Builds each step's :class:`SamplingBatch`, keeping what only depends on the batch's requests.

    Args:
        vocab_size: the model's vocabulary.
        processors: the engine's custom logits processor classes (:mod:`plinth.core.logits_processors`).
    """

    def __init__(self, vocab_size: int, processors: Sequence[type] = ()):
        self.vocab_size = vocab_size
        self.processors = tuple(processors)
        # the last batch's requests, weakly: a finished request (and the LoRA adapter it names) is not kept alive
        self._requests: list[weakref.ref[Request]] = []
        self._compositions: dict[torch.device, _Composition] = {}
        self.num_rebuilds = 0   # compositions built (for tests and benchmarks)

    def build(self, requests: list[Request], device: torch.device | str) -> SamplingBatch:
        """The batch of ``requests`` (one row each, in order) on ``device``."""
        device = torch.device(device)
        known = self._requests
        if len(known) != len(requests) or any(ref() is not r for ref, r in zip(known, requests, strict=True)):   # another batch
            self._requests = [weakref.ref(r) for r in requests]
            self._compositions.clear()
        comp = self._compositions.get(device)
        if comp is None:
            comp = self._compositions[device] = _Composition(requests, self.vocab_size, device, self.processors)
            self.num_rebuilds += 1
        return comp.batch(requests, remember=True)


_PARAMS = operator.attrgetter("sampling_params")


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.temperature < SAMPLING_EPS and p.logprobs is None and p.min_tokens == 0 and not p.logit_bias
            and p.structured_outputs is None and p.allowed_token_ids is None and not p.bad_words
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


class _Composition:
    """The parts of a batch fixed by its requests, plus the output counts as of the latest step."""

    def __init__(self, requests: Sequence[Request], vocab_size: int, device: torch.device,
                 processors: Sequence[type] = ()):
        self.device = device
        self.vocab_size = V = vocab_size
        params = list(map(_PARAMS, requests))
        distinct = {id(p): p for p in params}.values()   # requests usually share a few params objects
        # per custom logits processor, the rows it applies to (asked when each request arrived; None: no row for any)
        custom = [tuple(i for i, r in enumerate(requests) if k < len(r.logits_processors) and r.logits_processors[k])
                  for k in range(len(processors))]
        self.custom_rows = custom if any(custom) else None
        self.plain: SamplingBatch | None = None
        if self.custom_rows is None and all(map(_plain_greedy, distinct)):
            self.plain = SamplingBatch.plain_greedy(len(params), device)
            return
        low, high = FACTOR_RANGE
        temp = np.array([min(p.temperature, high) for p in params], dtype=np.float32)
        greedy = temp < SAMPLING_EPS
        temp[greedy] = 1.0
        random = ~greedy
        top_k = np.array([p.top_k if 0 < p.top_k < V else V for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float32)
        min_p = np.array([p.min_p for p in params], dtype=np.float32)
        use_k = bool((top_k[random] < V).any())
        use_p = bool((top_p[random] < 1.0).any())
        use_min_p = bool((min_p[random] > 0.0).any())
        rep = np.array([min(max(p.repetition_penalty, low), high) for p in params], dtype=np.float32)
        freq = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        pres = np.array([p.presence_penalty for p in params], dtype=np.float32)
        use_rep = bool((rep != 1.0).any())
        use_add = bool((freq != 0.0).any() or (pres != 0.0).any())
        dev = self._dev
        prompt_mask = None
        if use_rep:
            prompt_mask = torch.zeros(len(params), V, dtype=torch.bool, device=device)
            rows, ids = _flatten([r.prompt_token_ids if not r.prompt_is_embeds else [] for r in requests])
            prompt_mask[dev(rows), dev(ids)] = True
        self.use_counts = use_rep or use_add
        self.counts: torch.Tensor | None = None      # [B, V] as of ``num_output`` tokens per row
        self.num_output: list[int] = []
        # rows with min_tokens: (row, min_tokens, the ids it masks)
        self.min_tokens_rows = [(i, p.min_tokens, sorted(t for t in r.stop_token_ids if t < V))
                                for i, (r, p) in enumerate(zip(requests, params, strict=True)) if p.min_tokens > 0]
        self.structured = [i for i, r in enumerate(requests) if r.matcher is not None]
        # allowed_token_ids: a fixed mask per row, combined with the grammar's where a row has both
        self.fixed_allowed: dict[int, np.ndarray] = {}
        for i, p in enumerate(params):
            if p.allowed_token_ids is not None:
                mask = np.zeros(V, dtype=bool)
                mask[[t for t in p.allowed_token_ids if t < V]] = True
                self.fixed_allowed[i] = mask
        # bad_words: (row, one-token words, longer words) banned where the output ends with a word's prefix
        self.bad_word_rows = [(i, [w[0] for w in r.bad_words_ids if len(w) == 1],
                               [w for w in r.bad_words_ids if len(w) > 1])
                              for i, r in enumerate(requests) if r.bad_words_ids]
        self.masked_rows = sorted(set(self.structured) | set(self.fixed_allowed) | {i for i, _, _ in self.bad_word_rows})
        self.seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        self.seeds = np.array([params[i].seed & (2**64 - 1) for i in self.seeded], dtype=np.uint64)
        logit_bias = None
        if any(p.logit_bias for p in params):
            rows, ids = _flatten([list(p.logit_bias or ()) for p in params])
            values = np.fromiter(itertools.chain.from_iterable((p.logit_bias or {}).values() for p in params),
                                 dtype=np.float32, count=len(ids))
            logit_bias = (dev(rows), dev(ids), dev(values))
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        self.static = SamplingBatch(
            temperature=dev(temp), greedy=dev(greedy), all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            top_k=dev(top_k) if use_k else None, max_top_k=int(top_k[top_k < V].max()) if use_k else V,
            top_p=dev(top_p) if use_p else None, min_p=dev(min_p) if use_min_p else None,
            repetition_penalty=dev(rep) if use_rep else None,
            frequency_penalty=dev(freq) if use_add else None, presence_penalty=dev(pres) if use_add else None,
            output_counts=None, prompt_mask=prompt_mask, min_tokens_index=None, logit_bias=logit_bias, allowed=None,
            seeded_rows=dev(np.array(self.seeded, dtype=np.int64)) if self.seeded else None, seed_keys=None,
            num_logprobs=num_logprobs, max_num_logprobs=max(asked) if asked else None,
        )

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def batch(self, requests: Sequence[Request], remember: bool) -> SamplingBatch:
        """This step's batch of ``requests`` (the ones this composition was built for).

        With ``remember``, the output counts are kept for the next step, which then adds one token
        per row to them in place (a batch's ``output_counts`` is only valid until the next build)."""
        if self.plain is not None:
            return self.plain
        if not (self.use_counts or self.min_tokens_rows or self.seeded or self.masked_rows or self.custom_rows):
            return self.static
        # a token sampled by the step in flight (asynchronous scheduling) counts as an output
        num_output = [len(r.output_token_ids) + r.num_pending_tokens for r in requests]
        counts = self._counts(requests, num_output) if self.use_counts else None
        if remember:
            self.counts, self.num_output = counts, num_output
        min_tokens_index = None
        masked = [(row, ids) for row, min_tokens, ids in self.min_tokens_rows if num_output[row] < min_tokens and ids]
        if masked:
            rows = np.repeat(np.array([row for row, _ in masked], dtype=np.int64), [len(ids) for _, ids in masked])
            ids = np.fromiter(itertools.chain.from_iterable(ids for _, ids in masked), dtype=np.int64, count=len(rows))
            min_tokens_index = (self._dev(rows), self._dev(ids))
        seed_keys = None
        if self.seeded:
            steps = np.array([num_output[i] for i in self.seeded], dtype=np.uint64)
            keys = splitmix64(splitmix64(self.seeds) ^ steps)
            seed_keys = self._dev(np.stack([keys & M32, keys >> np.uint64(32)], axis=1).astype(np.int64))
        allowed = None
        if self.masked_rows:   # the grammar matchers are as of the requests' latest tokens (synchronous steps)
            mask = np.ones((len(self.masked_rows), self.vocab_size), dtype=bool)
            position = {i: j for j, i in enumerate(self.masked_rows)}
            if self.structured:
                at = [position[i] for i in self.structured]
                mask[at] = allowed_tokens([requests[i].matcher for i in self.structured], self.vocab_size)
            for i, fixed in self.fixed_allowed.items():
                mask[position[i]] &= fixed
            for i, single, longer in self.bad_word_rows:   # as of the request's latest token (synchronous steps)
                out = requests[i].output_token_ids
                banned = single + [w[-1] for w in longer
                                   if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]]
                mask[position[i], banned] = False
            allowed = (self._dev(np.array(self.masked_rows, dtype=np.int64)), self._dev(mask))
        custom = None
        if self.custom_rows is not None:   # as of the requests' latest tokens (synchronous steps)
            # the requests' own lists (no copy per step; processors read them)
            rows = {i: ProcessorRow(requests[i].request_id,
                                    requests[i].prompt_token_ids if not requests[i].prompt_is_embeds else (),
                                    requests[i].output_token_ids, requests[i].sampling_params.extra_args or {})
                    for i in set().union(*self.custom_rows)}
            custom = tuple((index, tuple(rows[i] for i in index)) for index in self.custom_rows)
        return dataclasses.replace(self.static, output_counts=counts, min_tokens_index=min_tokens_index,
                                   seed_keys=seed_keys, allowed=allowed, custom=custom)

    def _counts(self, requests: Sequence[Request], num_output: list[int]) -> torch.Tensor:
        """``[B, V]`` output-token counts: the previous step's plus one token per row when every row
        gained exactly one since, else counted afresh."""
        prev, before = self.counts, self.num_output
        if prev is not None and all(n == b + 1 for n, b in zip(num_output, before, strict=True)):
            last = np.fromiter((r.output_token_ids[-1] for r in requests), dtype=np.int64, count=len(requests))
            rows = torch.arange(len(requests), device=self.device)
            prev.index_put_((rows, self._dev(last)), torch.ones(len(requests), device=self.device), accumulate=True)
            return prev
        counts = torch.zeros(len(requests), self.vocab_size, dtype=torch.float32, device=self.device)
        rows, ids = _flatten([r.output_token_ids for r in requests])
        counts.index_put_((self._dev(rows), self._dev(ids)), torch.ones(len(ids), device=self.device),
                          accumulate=True)
        return counts


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixer over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _flatten(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, value) pairs of a ragged list of lists, as int64 arrays."""
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lengths), values
