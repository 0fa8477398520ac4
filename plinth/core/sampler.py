"""Sampling: one step's logits to next tokens (and logprobs), vectorised over the batch.

Order of operations, per row (vLLM's):

1. logprobs, when asked, are taken from the RAW model logits (``log_softmax`` before
   min_tokens, penalties, temperature or filters), as vLLM does by default (``logprobs_mode``: the
   ``processed_*`` modes take them from the logits each row's token is chosen from, step 4 or 5, and
   the ``*_logits`` modes report logits); then the engine's custom logits processors
   (:mod:`plinth.core.logits_processors`) change the rows they apply to;
2. structured outputs: tokens the request's grammar does not allow next get ``-inf``;
   ``logit_bias`` is added to its tokens' logits; ``min_tokens``: EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` get ``-inf`` while fewer than ``min_tokens`` tokens have been generated;
3. penalties: repetition (CTRL: a logit of a token seen in prompt or output is divided by the
   penalty when positive, multiplied when not), then frequency and presence (OpenAI:
   ``logit -= frequency * count + presence * (count > 0)`` over output tokens);
4. greedy rows (``temperature < 1e-5``) take the argmax here;
5. temperature, then min-p (drop tokens whose probability is below ``min_p`` times the top
   one), then top-k (keep the k highest logits, ties with the k-th included), then top-p (keep
   the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised after
   top-k);
6. a random choice: the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (seeded rows everywhere,
   every row on accelerators), or on the CPU for unseeded rows the inverse CDF (the first token
   whose running probability sum exceeds ``u * total``, ``u ~ U(0, 1)``: one draw per row). When a
   CPU batch has nothing but temperatures (no step 2, 3 or 5 filter), the inverse CDF runs natively
   on the raw logits (``cpu_native.sample_rows``: one pass per row, no ``[B, V]`` temporaries).

Seeds. A seeded row's noise is a counter-based hash of (seed, output index, token id), so a
seed gives the same tokens whatever else is in the batch, after a preemption, and on any
device. Unseeded rows draw from the sampler's own generator (seeded from the engine seed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from plinth.core.logits_processors import ProcessorSet
from plinth.core.request import Logprob, PositionLogprobs
from plinth.core.sampling_batch import M32, SAMPLING_EPS, SamplingBatch, SamplingBatchBuilder
from plinth.kernels import cpu_native

__all__ = ["SAMPLING_EPS", "LogprobsTensors", "Sampler", "SamplerOutput", "SamplingBatch", "SamplingBatchBuilder",
           "apply_min_p", "apply_penalties", "apply_top_k_top_p", "compute_prompt_logprobs", "counter_uniform",
           "fast_argmax", "gather_logprobs"]


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[B, V]`` (first index of the maximum), through a blocked maximum on the CPU,
    where ``argmax`` along a row is not vectorised and ``amax`` is (about 8x faster at V = 49k)."""
    rows, vocab = x.shape
    chunk = 1024
    blocks = vocab // chunk
    if x.device.type != "cpu" or blocks < 4 or rows == 0:
        return x.argmax(dim=-1)
    head = x[:, : blocks * chunk].reshape(rows, blocks, chunk)              # [B, nb, c]
    best_block = head.amax(dim=-1).argmax(dim=-1)                           # [B]
    within = head[torch.arange(rows, device=x.device), best_block].argmax(dim=-1)  # [B]
    index = best_block * chunk + within
    if blocks * chunk < vocab:                                              # the tail: later ids win only if larger
        tail = x[:, blocks * chunk:]
        tail_idx = tail.argmax(dim=-1)
        best = x.gather(1, index[:, None])[:, 0]
        tail_best = tail.gather(1, tail_idx[:, None])[:, 0]
        index = torch.where(tail_best > best, tail_idx + blocks * chunk, index)
    return index


@dataclasses.dataclass
class LogprobsTensors:
    """Logprobs of one token per row: column 0 is the chosen token, columns 1.. the top-N."""

    token_ids: torch.Tensor   # [B, N + 1] int64
    logprobs: torch.Tensor    # [B, N + 1] float32
    ranks: torch.Tensor       # [B] int64: rank of the chosen token (1 = most likely)

    def to_position_logprobs(self, num_logprobs: Sequence[int | None]) -> list[PositionLogprobs | None]:
        """Per row: ``{token id: Logprob}`` with the chosen token and the top ``num_logprobs[row]``."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        out: list[PositionLogprobs | None] = []
        for row, n in enumerate(num_logprobs):
            if n is None:
                out.append(None)
                continue
            entry = {ids[row][0]: Logprob(lps[row][0], ranks[row])}
            for j in range(1, min(n, len(ids[row]) - 1) + 1):
                entry.setdefault(ids[row][j], Logprob(lps[row][j], j))
            out.append(entry)
        return out


@dataclasses.dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [B] int64
    logprobs: LogprobsTensors | None         # when any row asked for logprobs
    # rows whose custom logits processor failed (row -> what failed): their requests end with that error
    failed: dict[int, str] | None = None


class Sampler:
    """Samples the next token of every row of a batch.

    Args:
        seed: seeds the generator used by rows without their own seed.
        processors: the engine's custom logits processor classes (:mod:`plinth.core.logits_processors`).
        logprobs_mode: what logprobs report (``ModelConfig.logprobs_mode``).
    """

    def __init__(self, seed: int = 0, processors: Sequence[type] = (), logprobs_mode: str = "raw_logprobs"):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.processors = ProcessorSet(processors)
        self._failed: dict[int, str] = {}
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[B, V]``, any float dtype)."""
        self._failed = {}
        chosen_from = None   # the logits each row's token was chosen from (the processed logprobs modes)
        if batch.max_num_logprobs is not None and self.logprobs_mode.startswith("processed"):
            tokens, chosen_from = self._choose(logits, batch)
        elif not batch.all_greedy and _plain_temperature(batch) and cpu_native.sampling_enabled(logits):
            tokens = self._native_choice(logits, batch)   # temperature only: straight from the logits
        elif batch.all_greedy and (batch.min_tokens_index is None and batch.output_counts is None
                                   and batch.logit_bias is None and batch.allowed is None and batch.custom is None):
            tokens = fast_argmax(logits)   # nothing changes the logits: no copy
        else:
            tokens = self._choose(logits, batch)[0]
        lp = None
        if batch.max_num_logprobs is not None:
            values = chosen_from if chosen_from is not None else logits.float()
            if self.logprobs_mode.endswith("logprobs"):
                values = torch.log_softmax(values, dim=-1)
            lp = gather_logprobs(values, tokens, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=tokens, logprobs=lp, failed=self._failed or None)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens from the processed logits (:meth:`process_logits`), and per row the logits they were chosen from:
        the greedy rows' penalised ones, the random rows' filtered ones."""
        greedy_logits, random_logits = self.process_logits(logits, batch)
        if random_logits is None:
            return fast_argmax(greedy_logits), greedy_logits
        tokens = self._random_choice(random_logits.softmax(dim=-1), batch)   # [B]
        if not batch.any_greedy:
            return tokens, random_logits
        tokens = torch.where(batch.greedy, fast_argmax(greedy_logits), tokens)
        return tokens, torch.where(batch.greedy.unsqueeze(1), greedy_logits, random_logits)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits the choice is made from.

        Returns:
            ``(penalised, filtered)``: ``penalised`` [B, V] after the custom processors, the grammar masks,
            logit_bias, min_tokens and penalties (the greedy rows' argmax); ``filtered`` [B, V] after temperature,
            min-p, top-k and top-p (``-inf`` on dropped tokens; the random rows' distribution), or ``None`` when
            every row is greedy. Rows whose processor failed are noted in ``SamplerOutput.failed``.
        """
        x = logits.to(torch.float32, copy=True)                   # [B, V]
        if batch.custom is not None:
            self._failed.update(self.processors.apply(x, batch.custom))
        if batch.allowed is not None:
            rows, allowed = batch.allowed
            x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
        if batch.logit_bias is not None:
            rows, ids, values = batch.logit_bias
            x.index_put_((rows, ids), values, accumulate=True)
        if batch.min_tokens_index is not None:
            x[batch.min_tokens_index] = float("-inf")
        x = apply_penalties(x, batch)
        if batch.all_greedy:
            return x, None
        y = x / batch.temperature.unsqueeze(1)
        if batch.min_p is not None:
            y = apply_min_p(y, batch.min_p)
        y = apply_top_k_top_p(y, batch.top_k, batch.top_p, batch.max_top_k)
        return x, y

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen

    def _native_choice(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """:meth:`_random_choice` of ``softmax(logits / temperature)`` without ``[B, V]`` temporaries (CPU rows with
        only a temperature): the same uniform per row, the inverse CDF in one native pass per row; seeded rows
        as there (their probabilities computed for them alone), greedy rows the argmax."""
        uniforms = torch.rand(logits.shape[0], 1, generator=self._generator(logits.device), dtype=torch.float64)
        tokens = cpu_native.sample_rows(logits, batch.temperature, uniforms)
        if batch.seeded_rows is not None:
            assert batch.seed_keys is not None
            rows = batch.seeded_rows
            probs = (logits[rows].to(torch.float32) / batch.temperature[rows].unsqueeze(1)).softmax(dim=-1)
            noise = -torch.log(counter_uniform(batch.seed_keys, logits.shape[1]))
            tokens[rows] = (probs / noise).argmax(dim=-1)
        if batch.any_greedy:
            tokens = torch.where(batch.greedy, fast_argmax(logits), tokens)
        return tokens

    def _random_choice(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row drawn from ``probs`` ``[B, V]``.

        Seeded rows: the exponential race with counter-based noise (the same tokens on every device).
        Unseeded rows: the exponential race with the generator's noise on accelerators; on the CPU,
        where drawing ``B x V`` exponentials costs ~30 ms for 32 rows of a 49k vocabulary, the inverse
        CDF with one uniform per row (a float64 running sum, ~1 ms)."""
        gen = self._generator(probs.device)
        if probs.device.type != "cpu":
            noise = torch.empty_like(probs).exponential_(generator=gen).clamp_min_(1e-20)
            tokens = (probs / noise).argmax(dim=-1)
        else:
            cdf = probs.to(torch.float64).cumsum_(dim=-1)                              # [B, V]
            target = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
        if batch.seeded_rows is not None:
            assert batch.seed_keys is not None
            rows = batch.seeded_rows
            noise = -torch.log(counter_uniform(batch.seed_keys, probs.shape[1]))
            tokens[rows] = (probs[rows] / noise).argmax(dim=-1)
        return tokens


def _plain_temperature(batch: SamplingBatch) -> bool:
    """Whether the random rows' distribution is ``softmax(logits / temperature)`` as it stands: no grammar,
    bias, min_tokens, penalty, min-p, top-k or top-p in the batch."""
    return (batch.custom is None and batch.allowed is None and batch.logit_bias is None
            and batch.min_tokens_index is None
            and batch.output_counts is None and batch.repetition_penalty is None and batch.frequency_penalty is None
            and batch.presence_penalty is None and batch.min_p is None and batch.top_k is None and batch.top_p is None)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties."""
    counts = batch.output_counts
    if batch.repetition_penalty is not None:
        assert counts is not None and batch.prompt_mask is not None
        seen = batch.prompt_mask | (counts > 0)                             # [B, V]
        pen = batch.repetition_penalty.unsqueeze(1)                         # [B, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    if batch.frequency_penalty is not None:
        assert counts is not None and batch.presence_penalty is not None
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` ([B]) times the row's highest."""
    probs = logits.softmax(dim=-1)                                          # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)      # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Keep the ``top_k`` ([B], V = off) highest logits, then the top-``top_p`` ([B]) mass."""
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_p is None and max_top_k is not None and max_top_k < V:
        assert top_k is not None
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = torch.where((top_k >= V).unsqueeze(1), torch.full_like(kth, float("-inf")), kth)
        return logits.masked_fill(logits < kth, float("-inf"))
    ascending, order = logits.sort(dim=-1)                                  # [B, V]
    if top_k is not None:
        kth = ascending.gather(1, (V - top_k).unsqueeze(1))                 # [B, 1]: the k-th largest
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if top_p is not None:
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)               # [B, V]
        drop = (mass_below <= (1 - top_p).unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, -1] = False                                                 # always keep the top token
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num: int) -> LogprobsTensors:
    """Chosen-token logprob and rank plus the top ``num`` of each row of ``logprobs`` ([B, V])."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))                     # [B, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1                             # [B]
    top_lp, top_ids = logprobs.topk(min(num, logprobs.shape[-1]), dim=-1)   # [B, num] (a vocabulary may be smaller)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([chosen, top_lp], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor | Sequence[int],
                            num_logprobs: int, as_logits: bool = False) -> LogprobsTensors:
    """Prompt logprobs from raw logits: row ``i`` of ``logits`` ([L, V]) predicts ``target_ids[i]``
    (``as_logits``: the logits themselves, for the logits ``logprobs_mode``).

    For a whole prompt, pass the logits of positions ``0 .. P-2`` and ``prompt_ids[1:]``; the
    first prompt token has no logprob. Use :meth:`LogprobsTensors.to_position_logprobs`.
    """
    targets = torch.as_tensor(target_ids, dtype=torch.int64, device=logits.device)
    values = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(values, targets, num_logprobs)


def counter_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), ``[S, V]`` float32, a pure function of ``keys`` ([S, 2] int64) and the column.

    32-bit integer hashing done in int64 without overflow, so every device gives the same bits.
    """
    idx = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # [V]
    x = (idx * 0x9E3779B1 + keys[:, :1]) & M32                             # [S, V]
    x = _fmix32(_fmix32(x) ^ keys[:, 1:])
    return unit_interval(x)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit integers (in int64) to float32 strictly inside (0, 1): the top 23 bits plus a half, times 2**-23
    (every value exact; 24 bits would round the largest to exactly 1.0, whose noise -log(1) = 0 turns a
    zero-probability token's p / noise into NaN, which argmax picks)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` with int64 intermediates below ``2**49``."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)
