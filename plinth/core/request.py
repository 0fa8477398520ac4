"""The core records: sampling parameters, requests and their outputs.

These types are used everywhere (scheduler, sampler, engine, server); they live
in one place so that every layer speaks of the same thing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import time
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

from plinth.core import structured

#: the types :meth:`SamplingParams._plain_numbers` leaves as they are (without an ABC check per field)
_PLAIN_TYPES = frozenset({int, float, bool, type(None)})


def truncation_problem(keep: Any) -> str | None:
    """What is wrong with a ``truncate_prompt_tokens`` value (None: nothing; the engine checks it against the
    context)."""
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and (keep >= 1 or keep == -1)):
        return None
    return f"must be at least 1 (or -1: the model's context), got {keep!r}"


def cache_salt_problem(salt: Any) -> str | None:
    """What is wrong with a ``cache_salt`` (None: nothing)."""
    if salt is None or (isinstance(salt, str) and salt):
        return None
    return f"must be a non-empty string if given, got {salt!r}"


class TextPrompt(TypedDict):
    """A prompt as text (vLLM's ``TextPrompt``: ``{"prompt": "..."}``); ``cache_salt``: see
    :meth:`plinth.core.engine.LLMEngine.add_request`."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids (vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}``); ``prompt``: their text, which
    the output reports as its ``prompt``; ``cache_salt``: see :meth:`plinth.core.engine.LLMEngine.add_request`."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """A prompt as its input embeddings (vLLM's ``EmbedsPrompt``: ``{"prompt_embeds": tensor}``, ``[positions,
    hidden_size]``; an engine with ``enable_prompt_embeds``, see :mod:`plinth.core.prompt_embeds`); ``cache_salt``:
    see :meth:`plinth.core.engine.LLMEngine.add_request`."""

    prompt_embeds: Any
    cache_salt: NotRequired[str]


#: the message of ``min_tokens`` given with a structured output constraint (formatted with the constraint's field)
MIN_TOKENS_CONFLICT = "cannot be combined with {} (the grammar decides where the text may end)"


class SamplingParamsError(ValueError):
    """An invalid sampling parameter. ``param`` names it (the OpenAI field name)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class RequestOutputKind(enum.IntEnum):
    """What the outputs of a streamed request hold (``AsyncLLMEngine.generate``; vLLM's): everything so far
    (``CUMULATIVE``, the default), only what is new since the output before (``DELTA``), or only the final output
    (``FINAL_ONLY``). Offline calls return final outputs whatever it says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request, with the OpenAI / vLLM meanings.

    ``temperature=0`` means greedy. ``top_k<=0`` and ``top_p=1`` and ``min_p=0`` turn those
    filters off. ``repetition_penalty`` is the multiplicative (CTRL) penalty over prompt and
    output tokens; ``presence_penalty`` and ``frequency_penalty`` are the additive OpenAI
    penalties over output tokens. ``logprobs=k`` returns the sampled token's logprob and the
    top-k (-1: every token of the vocabulary, where the engine's ``max_logprobs`` allows it);
    ``prompt_logprobs=k`` the same for every prompt token after the first.
    ``detokenize=False`` leaves the output text empty and skips turning tokens into text (token
    ids only); stop strings need the text, so they require ``detokenize=True``.
    ``logit_bias`` maps token ids to a value in [-100, 100] added to their logits before the
    penalties, greedy choice and filters (OpenAI's ``logit_bias``; keys may be given as digit strings).
    ``structured_outputs`` constrains the text to JSON, a regular expression, a choice of strings or a
    grammar (``{"json": schema}``, ``{"json_object": True}``, ``{"regex": ...}``, ``{"choice": [...]}``,
    ``{"grammar": ...}``; see :mod:`plinth.core.structured`). ``allowed_token_ids`` restricts every
    sampled token to the listed ids (vLLM's parameter). ``bad_words`` (vLLM's) are never generated: each word,
    tokenized alone and after a space, has its last token banned wherever the output ends with the tokens
    before it (a one-token word is banned everywhere). ``seed=-1`` is no seed, as in vLLM. ``extra_args`` (vLLM's) is a mapping with string keys handed
    to the engine's custom logits processors (:mod:`plinth.core.logits_processors`); plinth itself reads none of it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    #: keep only the prompt's last N tokens (-1: as many as the context holds), as vLLM's
    truncate_prompt_tokens: int | None = None
    #: for custom logits processors (:mod:`plinth.core.logits_processors`): a mapping with string keys
    extra_args: dict[str, Any] | None = None
    #: what a streamed request's outputs hold (:class:`RequestOutputKind`)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: vLLM's earlier name of ``structured_outputs`` (a ``GuidedDecodingParams``), taken as it
    guided_decoding: dataclasses.InitVar[Any] = None

    #: the default of the engine's ``max_logprobs`` (``--max-logprobs`` raises it)
    MAX_LOGPROBS = 20
    #: no position holds more alternatives than this, whatever the engine allows
    LOGPROBS_CEILING = 1 << 20
    MAX_LOGIT_BIAS = 100.0
    #: the most samples one request may ask for (each is a sequence of its own in the engine)
    MAX_N = 1024

    def __post_init__(self, guided_decoding: Any = None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise SamplingParamsError("guided_decoding", "give structured_outputs or guided_decoding (its "
                                                             "earlier name), not both")
            self.structured_outputs = guided_decoding
        self._normalize()
        self.validate(structured_name="structured_outputs" if guided_decoding is None else "guided_decoding")

    def _normalize(self) -> None:
        """The forms each field is accepted in (numpy numbers, one stop string, digit-string bias keys, ...) as
        the one the engine reads."""
        self._plain_numbers()
        if self.seed == -1:   # vLLM's "no seed"
            self.seed = None
        self._lists()
        self.logit_bias = _token_bias(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool | RequestOutputKind) \
                and self.output_kind in tuple(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        try:
            self.structured_outputs = structured.normalize(self.structured_outputs)
        except ValueError as exc:
            raise SamplingParamsError(structured.PARAM, str(exc)) from None

    _REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    _INT_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs",
                   "truncate_prompt_tokens")

    def _plain_numbers(self) -> None:
        """numpy (or other) scalars as Python floats and ints, as vLLM takes them (booleans stay refused)."""
        for names, kind, cast in ((self._REAL_FIELDS, numbers.Real, float), (self._INT_FIELDS, numbers.Integral, int)):
            for name in names:
                value = getattr(self, name)
                if type(value) not in _PLAIN_TYPES and isinstance(value, kind):
                    setattr(self, name, cast(value))

    def _lists(self) -> None:
        """``stop`` and ``stop_token_ids`` as lists (a single string or id accepted as one item); numpy ids in them
        and in ``allowed_token_ids`` as ints."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, numbers.Integral) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]   # (numpy ids become ints below)
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, Mapping):   # list() would take its keys
                raise SamplingParamsError(name, f"must be {'a string' if name == 'stop' else 'an integer'} or a list "
                                                f"of them, got an object ({type(value).__name__})")
            try:
                setattr(self, name, list(value if value is not None else []))
            except TypeError:
                raise SamplingParamsError(name, f"must be a list, got {type(value).__name__}") from None
        self.stop_token_ids = _plain_ids(self.stop_token_ids)
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, str | Mapping):
            try:
                self.allowed_token_ids = _plain_ids(list(self.allowed_token_ids))
            except TypeError:
                pass   # validate() names it

    def recheck(self) -> None:
        """:meth:`validate` again, for values changed after construction (the engine calls it when a request
        arrives: ``params.n = 0`` is refused there rather than never finishing).

        Raises:
            SamplingParamsError: naming the parameter.
        """
        self._normalize()   # in the forms the constructor takes
        self.validate()

    def validate(self, structured_name: str = "structured_outputs") -> None:
        """Raise :class:`SamplingParamsError` naming the first invalid parameter (``structured_name``: the name the
        constraint was given under, for messages)."""
        def check(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(param, msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and not isinstance(value, bool), name,
                  f"must be a number, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        problem = truncation_problem(self.truncate_prompt_tokens)
        check(problem is None, "truncate_prompt_tokens", problem or "")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
        check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(self.top_k >= -1, "top_k", f"must be -1 or 0 (no top-k) or a positive integer, got {self.top_k}")
        check(self.n <= self.MAX_N, "n", f"must be at most {self.MAX_N}, got {self.n}")
        check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature",
              f"must be a finite number >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty), "repetition_penalty",
              f"must be a finite number > 0, got {self.repetition_penalty}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                                          and self.max_tokens >= 1),
              "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
              f"must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(encodable_text(s) for s in self.stop), "stop", "must be valid Unicode text (not a lone UTF-16 "
              "surrogate)")
        check(self.detokenize or not self.stop, "stop", "stop strings are matched in the text: they need "
              "detokenize=True")
        check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative integers")
        ids = self.allowed_token_ids
        check(ids is None or (isinstance(ids, list) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)), "allowed_token_ids",
            f"must be a non-empty list of token ids (integers >= 0), got {ids!r}")
        words = self.bad_words
        check(words is None or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
              "bad_words", f"must be a list of non-blank strings, got {words!r}")
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
              f"must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {self.output_kind!r}")
        extra = self.extra_args
        check(extra is None or (isinstance(extra, dict) and all(isinstance(k, str) for k in extra)), "extra_args",
              f"must be a mapping with string keys, got {extra!r}"[:300])
        check(not (self.structured_outputs and self.min_tokens), "min_tokens",
              MIN_TOKENS_CONFLICT.format(structured_name))
        bound = self.MAX_LOGIT_BIAS
        bad = next(((t, v) for t, v in (self.logit_bias or {}).items() if not -bound <= v <= bound), None)
        check(bad is None, "logit_bias", f"values must be numbers in [-{bound:g}, {bound:g}], got {bad and bad[1]!r} "
              f"for token {bad and bad[0]}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= self.LOGPROBS_CEILING),
                  name, f"must be -1 (the whole vocabulary) or an integer in [0, {self.LOGPROBS_CEILING}], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _plain_ids(ids: list[Any]) -> list[Any]:
    """numpy (and other integral) ids as ints; other items as they are, for validation to name."""
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]


def _token_bias(bias: Any) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: float}`` (``None`` when empty); digit-string keys become ids.

    Raises:
        SamplingParamsError: not a mapping, a key that is not a token id, a value that is not a number.
    """
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"must be a mapping of token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
            if len(key.strip().lstrip("0")) > 18:
                raise SamplingParamsError("logit_bias", f"token id {key.strip()[:20]}... is too large for any "
                                          "vocabulary")
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise SamplingParamsError("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        token = int(token)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise SamplingParamsError("logit_bias", f"the bias of token {token} must be a number, got {value!r}")
        out[token] = float(value)
    return out or None


class FinishReason(str, enum.Enum):
    STOP = "stop"      # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"    # aborted by the user, a disconnect or an engine failure

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]

#: what JSON output says for a logprob of -inf (a token the processed logprobs modes drop; JSON has no infinity), as
#: vLLM's server
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    """A logprob as JSON output carries it: -inf as :data:`LOGPROB_FLOOR`."""
    return max(value, LOGPROB_FLOOR)


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float = dataclasses.field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass
class CompletionOutput:
    """One sampled sequence of a request (``n`` of them per request).

    ``text`` and ``token_ids`` are cumulative (everything so far).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None   # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None   # set when the engine failed the request
    lora_request: Any = None   # the request's plinth.lora.LoRARequest, if it named one
    #: a prompt given as embeddings: its positions (``prompt_token_ids`` is then empty); else 0
    num_prompt_embeds: int = 0

    @property
    def num_prompt_positions(self) -> int:
        """The prompt's positions: its tokens, or its embeddings."""
        return len(self.prompt_token_ids) + self.num_prompt_embeds


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. ``FINISHED_*`` are terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2          # back in the waiting queue after its blocks were taken
    FINISHED_STOPPED = 3   # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4    # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence inside the engine: its tokens, its progress and its KV blocks.

    A user request with ``n > 1`` becomes ``n`` of these (the engine gives each its own id);
    they share the prompt's KV blocks through the prefix cache.

    Args:
        request_id: unique among unfinished requests.
        prompt_token_ids: the prompt, at least one token.
        sampling_params: how to sample.
        eos_token_ids: the model's end-of-sequence ids (ignored with ``ignore_eos``).
        arrival_time: seconds since the epoch (default: now).
        max_tokens: the output limit; the scheduler resolves it against ``max_model_len``
            on ``add_request`` when left ``None``.
        default_max_tokens: the cap for a request without a limit (the model's ``max_new_tokens``): the rest
            of the context, at most this many.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 eos_token_ids: tuple[int, ...] | list[int] = (), arrival_time: float | None = None,
                 max_tokens: int | None = None, default_max_tokens: int | None = None):
        self.request_id = request_id
        self.priority = 0       # with the priority scheduling policy: lower is more important
        self.arrival_seq = 0    # the scheduler's arrival order (ties of priority)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.default_max_tokens = default_max_tokens
        self.output_token_ids: list[int] = []
        # prompt + output, grown in place: reading it costs nothing.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache (or will be after this step)
        self.num_cached_tokens = 0     # prompt tokens found in the prefix cache at first admission
        # tokens sampled by steps not read back yet (asynchronous scheduling): 0 or 1 between steps,
        # 2 while a new step is launched before the previous one is read back
        self.num_pending_tokens = 0
        self.block_ids: list[int] = []  # owned by the block manager
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics()
        self.matcher: Any = None   # structured outputs: the sequence's grammar matcher (plinth.core.structured)
        self.pooling: Any = None   # an embedding request's PoolState (plinth.core.pooling)
        self.bad_words_ids: list[list[int]] = []   # sampling_params.bad_words as token sequences (the engine's)
        #: per installed custom logits processor, whether it applies (asked once, on arrival); () for none
        self.logits_processors: tuple[bool, ...] = ()
        self.lora: Any = None      # the LoRA adapter it runs with (plinth.lora.adapter.LoRAAdapter), or None
        self.cache_salt: str | None = None   # shares cached KV blocks only with requests of the same salt
        self.adapter_waits = 0     # steps it waited for a slot for its adapter while others passed it
        self.draft_token_ids: list[int] = []   # speculative decoding: the drafts its scheduled step verifies
        #: image inputs (:class:`~plinth.multimodal.images.ImageItem`): the prompt positions their embeddings fill
        self.images: list[Any] = []
        #: the prompt was given as embeddings (:mod:`plinth.core.prompt_embeds`): its token ids are placeholders,
        #: which penalties and logits processors do not see
        self.prompt_is_embeds = False
        #: multimodal RoPE (Qwen2-VL): where the prompt's rotary positions depart from its indices
        #: (:class:`~plinth.multimodal.mrope.RopeLayout`), or ``None``
        self.rope_layout: Any = None
        #: ``[num_prompt_tokens]`` int64: each prompt token's segment (an encoder's text pair), or ``None``: all 0
        self.token_types: Any = None
        if arrival_time is not None:
            self.metrics.arrival_time = arrival_time

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position is computed, none taken from the prefix cache: its prompt logprobs, or its
        hidden states (a per-token pooling task), are wanted."""
        return self.sampling_params.prompt_logprobs is not None or (self.pooling is not None
                                                                    and self.pooling.kind == "all")

    @property
    def lora_id(self) -> int:
        """Its adapter's ``lora_int_id``; 0 for the base model."""
        return self.lora.lora_id if self.lora is not None else 0

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens. Read-only view by convention: do not mutate."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end the request: EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
        eos = () if self.sampling_params.ignore_eos else self.eos_token_ids
        return frozenset((*eos, *self.sampling_params.stop_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first ``num_output_tokens`` (a stop string found inside the
        tokens of one speculative step ends the output where it ends)."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self._all_token_ids[len(self._all_token_ids) - drop:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


def encodable_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates: JSON's ``\\ud800`` escapes decode to them), as
    tokenizers and output files need."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
