"""Beam search on top of the engine (``LLM.beam_search``).

Each round extends every live beam by one token: the beams run as one batch of one-token requests (their
token ids as prompts, so the prefix cache supplies all but the last partial block of each), each asking for
its ``2 * beam_width`` most likely next tokens. Of all the extensions, those ending in EOS are complete; the
``beam_width`` best others (by cumulative log-probability) go on to the next round. After ``max_tokens``
rounds (or when no beam is left, or the beams reach ``max_model_len``, or the tokens the KV cache holds when
that is less) the complete and the live beams are ranked by ``cumulative_logprob / length ** length_penalty`` (length: prompt plus generated tokens, an ending
EOS not counted, as vLLM does) and the best ``beam_width`` returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import numbers
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from plinth.core.engine import _token_ids
from plinth.core.request import SamplingParams
from plinth.core.scheduler import RequestRejectedError

if TYPE_CHECKING:
    from plinth.entrypoints.llm import LLM

#: the widest search: beams x 2 candidates fit in the engine's default max_logprobs (an engine with a lower
#: max_logprobs allows less, see :func:`search`)
MAX_BEAM_WIDTH = SamplingParams.MAX_LOGPROBS // 2


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams of at most ``max_tokens`` new tokens, ranked by the model's log-probabilities;
    ``length_penalty`` weighs the length in the final ranking (0: none; larger values favour longer
    sequences); ``ignore_eos`` keeps beams going past EOS."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))   # numpy integers as ints (a frozen dataclass)
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH} (2 x beam_width logprobs per step, at "
                             f"most {SamplingParams.MAX_LOGPROBS}), got {self.beam_width}")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, numbers.Real)
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")


@dataclasses.dataclass
class BeamSequence:
    """One beam: its generated tokens (an ending EOS included), their text, the sum of their log-probabilities,
    the ranking score and why it ended (``stop``: EOS, ``length``: ``max_tokens``)."""

    token_ids: list[int]
    cumulative_logprob: float
    text: str = ""
    score: float = 0.0
    finish_reason: str = "length"


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


def _length(num_prompt: int, beam: BeamSequence, eos_ids: Sequence[int]) -> int:
    """The length a beam's score divides by: prompt and generated tokens, an ending EOS not counted (at least 1)."""
    length = num_prompt + len(beam.token_ids)
    if beam.token_ids and beam.token_ids[-1] in eos_ids:
        length -= 1
    return max(length, 1)


def score(num_prompt: int, beam: BeamSequence, eos_ids: Sequence[int], length_penalty: float) -> float:
    """``cumulative_logprob / length ** length_penalty`` (length: prompt and generated tokens, an ending EOS
    not counted); a ``length_penalty`` so large that the power overflows gives -0.0, so negative that it
    underflows -inf (the ranking uses :func:`rank_key`)."""
    cumulative = beam.cumulative_logprob
    try:
        return cumulative / _length(num_prompt, beam, eos_ids) ** length_penalty
    except OverflowError:
        return -0.0 if cumulative < 0 else 0.0
    except ZeroDivisionError:
        return -math.inf if cumulative < 0 else 0.0


def rank_key(num_prompt: int, beam: BeamSequence, eos_ids: Sequence[int], length_penalty: float) -> float:
    """Larger for a better beam, in the order of :func:`score` but computed in logarithms, without its overflow to
    -inf or underflow to 0 (beams whose scores round alike still rank by their true scores): minus
    ``log(-cumulative_logprob) - length_penalty * log(length)`` (+inf for a cumulative log-probability of 0)."""
    if beam.cumulative_logprob >= 0:
        return math.inf
    return length_penalty * math.log(_length(num_prompt, beam, eos_ids)) - math.log(-beam.cumulative_logprob)


def check_prompts(starts: list[list[int]], limit: int) -> None:
    """Raises RequestRejectedError for an empty prompt or one that leaves no room in the context."""
    for i, start in enumerate(starts):
        if not start or len(start) >= limit:
            raise RequestRejectedError(f"prompt {i}: " + ("the prompt is empty" if not start else
                                       f"{len(start)} tokens leave no room for a new one in this model's context "
                                       f"of {limit} tokens"), param="prompt")


def search(starts: list[list[int]], params: BeamSearchParams, eos: tuple[int, ...], limit: int,
           vocab: int | None, max_logprobs: int = SamplingParams.MAX_LOGPROBS, logprobs_as_logits: bool = False,
           ) -> Generator[tuple[list[list[int]], list[int], SamplingParams], list[Any], list[BeamSearchOutput]]:
    """The search, driven from outside: yields each round's ``(token-id prompts, the index of the prompt each
    extends, params)`` and is sent their outputs (``RequestOutput``s, in order); returns the beams (texts not filled
    in).

    Raises:
        ValueError: a beam width whose ``2 x beam_width`` candidates exceed the engine's ``max_logprobs``, or an
            engine whose logprobs are logits (``logprobs_as_logits``: a logits ``logprobs_mode``).
    """
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"beam search takes BeamSearchParams, not {type(params).__name__}")
    if logprobs_as_logits:
        raise ValueError("beam search ranks beams by log-probabilities, and this engine's logprobs are logits "
                         "(logprobs_mode raw_logits or processed_logits); start it with a logprobs mode")
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width must be at most {max_logprobs // 2} on this engine (2 x beam_width candidates "
                         f"per round, and its max_logprobs is {max_logprobs}), got {params.beam_width}")
    check_prompts(starts, limit)
    live: list[list[BeamSequence]] = [[BeamSequence([], 0.0)] for _ in starts]
    done: list[list[BeamSequence]] = [[] for _ in starts]
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=min(2 * params.beam_width, vocab or 2 * params.beam_width),
                          ignore_eos=True, detokenize=False)
    step._no_logits_processors = True   # type: ignore[attr-defined]  # beams rank by logprobs: no custom processor
    for _ in range(params.max_tokens):
        # beams that fill the context end there (finish "length")
        batch = [(i, beam) for i, beams in enumerate(live) for beam in beams
                 if len(starts[i]) + len(beam.token_ids) < limit]
        if not batch:
            break
        outs = yield [starts[i] + beam.token_ids for i, beam in batch], [i for i, _ in batch], step
        grown: list[list[BeamSequence]] = [[] for _ in starts]
        for (i, beam), out in zip(batch, outs, strict=True):
            for token, lp in (out.outputs[0].logprobs or [{}])[0].items():
                child = BeamSequence(beam.token_ids + [token], beam.cumulative_logprob + lp.logprob)
                if token in eos and not params.ignore_eos:
                    child.finish_reason = "stop"
                    done[i].append(child)
                else:
                    grown[i].append(child)
        full = [[b for b in beams if len(starts[i]) + len(b.token_ids) >= limit] for i, beams in enumerate(live)]
        live = [sorted(g + f, key=lambda b: b.cumulative_logprob, reverse=True)[:params.beam_width]
                for g, f in zip(grown, full, strict=True)]
    results = []
    for i, start in enumerate(starts):
        beams = done[i] + live[i]
        for beam in beams:
            beam.score = score(len(start), beam, eos, params.length_penalty)
        best = sorted(beams, key=lambda b: rank_key(len(start), b, eos, params.length_penalty), reverse=True)
        results.append(BeamSearchOutput(start, best[:params.beam_width]))
    return results


def _with_text(results: list[BeamSearchOutput], tokenizer: Any) -> list[BeamSearchOutput]:
    for out in results:
        for beam in out.sequences:
            beam.text = tokenizer.decode(beam.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
    return results


def beam_search(llm: LLM, prompts: Sequence[Any], params: BeamSearchParams,
                loras: Sequence[Any] | None = None) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text or token ids) on an offline engine, its beams with that prompt's LoRA
    adapter (``loras``: one per prompt, or None); see the module docstring.

    Raises:
        TypeError: ``params`` is not a :class:`BeamSearchParams`.
        RequestRejectedError: a prompt is empty, not token ids, or leaves no room in the context.
    """
    from plinth.core.prompt_embeds import PromptEmbeds
    from plinth.entrypoints.llm import _Salted

    engine = llm.engine
    if any(isinstance(p, _Salted) and p.multi_modal_data is not None for p in prompts):
        raise RequestRejectedError("beam search does not take image inputs (multi_modal_data)",
                                   param="multi_modal_data")
    if any(isinstance(p, _Salted) and p.token_type_ids is not None for p in prompts):
        raise RequestRejectedError("token_type_ids are for encoder models; beam search generates text",
                                   param="token_type_ids")
    salts = [p.salt if isinstance(p, _Salted) else None for p in prompts]   # a dict prompt's cache_salt
    prompts = [p.prompt if isinstance(p, _Salted) else p for p in prompts]
    if any(isinstance(p, PromptEmbeds) for p in prompts):
        raise RequestRejectedError("beam search takes prompts as text or token ids, not embeddings (prompt_embeds)",
                                   param="prompt_embeds")
    starts = [list(engine.tokenize(p)) if isinstance(p, str) else _token_ids(p) for p in prompts]
    loras = list(loras) if loras is not None else [None] * len(starts)
    rounds = search(starts, params, tuple(engine.eos_token_ids), engine.max_sequence_len, engine.vocab_size,
                    engine.max_logprobs, engine.logprobs_as_logits)
    try:
        batch, owners, step = next(rounds)
        while True:
            batch = [ids if salts[i] is None else {"prompt_token_ids": ids, "cache_salt": salts[i]}
                     for ids, i in zip(batch, owners, strict=True)]
            outs = llm.generate(batch, step, lora_request=[loras[i] for i in owners], use_tqdm=False)
            batch, owners, step = rounds.send(outs)
    except StopIteration as end:
        return _with_text(end.value, engine.tokenizer)


async def beam_search_async(front: Any, request_id: str, starts: list[list[int]],
                            params: BeamSearchParams, lora_request: Any = None,
                            priority: int = 0, cache_salt: str | None = None) -> list[BeamSearchOutput]:
    """The same search on a running :class:`~plinth.core.async_engine.AsyncLLMEngine` (the server's): each
    round's beams run as concurrent requests ``{request_id}-{round}-{beam}`` of the search's ``priority``."""
    rounds = search(starts, params, tuple(front.eos_token_ids), front.max_sequence_len, front.vocab_size,
                    front.max_logprobs, front.logprobs_as_logits)

    async def last(rid: str, prompt: list[int], step: SamplingParams) -> Any:
        final = None
        async for out in front.generate(rid, prompt, step, priority=priority, lora_request=lora_request,
                                        cache_salt=cache_salt):
            final = out
        return final

    r = 0
    holding = getattr(front, "holding", None)   # (sleep mode refuses while a search runs between its rounds)
    with holding() if holding is not None else contextlib.nullcontext():
        try:
            batch, _, step = next(rounds)
            while True:
                outs = await asyncio.gather(*(last(f"{request_id}-{r}-{j}", p, step) for j, p in enumerate(batch)))
                batch, _, step = rounds.send(list(outs))
                r += 1
        except StopIteration as end:
            return _with_text(end.value, front.tokenizer)
