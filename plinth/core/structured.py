"""Structured outputs: generation constrained to JSON, a regular expression, a choice or a grammar.

A request's ``structured_outputs`` names one constraint:

- ``{"json": SCHEMA}``: JSON matching a JSON schema (a dict or its JSON text);
- ``{"json_object": True}``: any JSON object;
- ``{"regex": PATTERN}``: text matching a regular expression (Rust ``regex`` syntax);
- ``{"choice": [STRING, ...]}``: exactly one of the strings;
- ``{"grammar": TEXT}``: a context-free grammar in Lark or llama.cpp's GBNF syntax.

The constraint is compiled by `llguidance <https://github.com/guidance-ai/llguidance>`_ into a matcher
per sequence. Before each sampling step the matcher gives the set of tokens that keep the text inside
the language (EOS once the text is complete); every other token's logit becomes ``-inf``, then the
usual sampling runs. After the step the sampled token advances the matcher; a matcher that can take no
further token ends the sequence (finish reason ``stop``). Requests are bounded (:data:`MAX_SPEC_CHARS`,
:data:`MAX_CHOICES`, :func:`limits`); most constraints beyond the limits fail when the request arrives (the
first mask is computed then), and a matcher that fails later (e.g. ``a{99999999}`` on its first token)
ends its sequence with finish reason ``abort``.

With a reasoning model (an engine given ``reasoning_parser``), the constraint starts after the thinking
(:class:`AfterReasoning`): the model thinks freely, then its answer is constrained.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
PARAM = "structured_outputs"
#: the longest schema (as JSON text), pattern, grammar or list of choices (characters in all) a request may give
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 10_000
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (a bad schema, pattern or grammar)."""


@dataclasses.dataclass
class StructuredOutputsParams:
    """One constraint in vLLM's class form (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``),
    the same as the dict of the field that is set. vLLM's options that tune its own backends' grammars
    (``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``, ``structural_tag``) are
    refused when set: llguidance's JSON takes the schema as written."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def as_dict(self) -> dict[str, Any]:
        unsupported = [name for name in ("disable_any_whitespace", "disable_additional_properties",
                                         "whitespace_pattern", "structural_tag") if getattr(self, name)]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} not supported (options of vLLM's grammar backends)")
        return {k: getattr(self, k) for k in KINDS if getattr(self, k) is not None}


#: vLLM's earlier name
GuidedDecodingParams = StructuredOutputsParams


def normalize(spec: Any) -> dict[str, Any] | None:
    """``spec`` checked for shape: ``None``, or a dict with exactly one of :data:`KINDS` (or the same as a
    :class:`StructuredOutputsParams`).

    Raises:
        ValueError: a message naming what is wrong (the caller adds the parameter's name).
    """
    if spec is None:
        return None
    if isinstance(spec, StructuredOutputsParams):
        spec = spec.as_dict()
    if not isinstance(spec, dict):
        raise ValueError(f"must be an object with one of {', '.join(KINDS)}, got {type(spec).__name__}")
    given = [k for k in KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}: expected one of {', '.join(KINDS)}")
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(KINDS)}" + (f", got {', '.join(given)}" if given else ""))
    kind = given[0]
    value = spec[kind]
    if kind == "json" and not isinstance(value, dict | str):
        raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(value).__name__}")
    if kind == "json_object" and value is not True:
        raise ValueError("json_object must be true")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise ValueError(f"{kind} must be a non-empty string")
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if kind == "choice" and len(value) > MAX_CHOICES:
        raise ValueError(f"choice has {len(value)} entries, more than {MAX_CHOICES}")
    try:
        size = (sum(map(len, value)) if kind == "choice" else len(value) if isinstance(value, str)
                else len(json.dumps(value, allow_nan=False)) if kind == "json" else 0)
    except (TypeError, ValueError) as e:   # a schema built in Python holding a set, a NaN key...
        raise ValueError(f"json must hold JSON values only: {e}") from e
    if size > MAX_SPEC_CHARS:
        raise ValueError(f"{kind} is {size} characters long, more than {MAX_SPEC_CHARS}")
    return {kind: value}


@functools.cache
def limits() -> Any:
    """llguidance's resource limits for request grammars: tighter than its defaults on the work done
    before the first token (a pathological pattern fails in milliseconds instead of seconds), and
    errors without backtraces."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, max_lexer_states=50_000, max_grammar_size=100_000,
                                     verbose_errors=False)


def _short(message: str) -> str:
    """An llguidance error as one line (no backtrace, at most 300 characters)."""
    line = " ".join(message.split("<backtrace>")[0].split()) or "unknown error"
    return line[:300]


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    import llguidance

    if kind == "regex" and (len(text) - len(text.rstrip("\\"))) % 2:   # (llguidance would drop the backslash)
        raise StructuredOutputError("invalid regex: it ends in an incomplete escape (a lone backslash)")
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":   # one lexeme (a grammar rule of N alternatives is limited to 2000 of them)
            grammar = llguidance.LLMatcher.grammar_from_regex("|".join(map(_regex_escape, json.loads(text))))
        else:
            grammar = llguidance.grammar_from("grammar", text)
    except Exception as exc:  # noqa: BLE001 - llguidance reports bad input with assorted exception types
        raise StructuredOutputError(f"invalid {kind}: {_short(str(exc))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=limits())
    if error and not error.startswith("WARNING"):
        raise StructuredOutputError(f"invalid {kind}: {_short(error)}")
    return grammar


def grammar_of(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a normalized ``spec`` (cached by its text).

    Raises:
        StructuredOutputError: the schema, pattern or grammar does not compile.
    """
    kind, value = next(iter(spec.items()))
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)   # key order matters: properties come in it
    elif kind == "choice":
        text = json.dumps(value)
    elif kind == "json_object":
        text = ""
    else:
        text = value
    return _grammar(kind, text)


class GrammarCompiler:
    """Matchers for one engine's tokenizer. The llguidance tokenizer (about a second to build for a
    49k vocabulary) is made on the first structured request.

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end a sequence.
    """

    #: matchers kept at their start state, by grammar (a request copies one instead of building it)
    PROTOTYPES = 32

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._prototypes: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                if not self.eos_token_ids:
                    raise StructuredOutputError("the model has no EOS token, so a constrained output cannot end")
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                      eos_token=self.eos_token_ids)
                except ValueError as exc:
                    raise StructuredOutputError(f"structured outputs need a fast tokenizer: {exc}") from None
            return self._ll_tokenizer

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh matcher for ``spec``: a copy of the grammar's prototype, built on first use (the costly
        part, which the server does in a worker thread before the request reaches the engine's thread).

        Raises:
            StructuredOutputError: the constraint does not compile.
        """
        import llguidance

        grammar = grammar_of(spec)
        with self._lock:
            prototype = self._prototypes.get(grammar)
            if prototype is not None:
                self._prototypes.move_to_end(grammar)
        if prototype is None:
            prototype = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits())
            if not prototype.is_error():
                prototype.compute_bitmask()   # most grammars beyond the limits fail here rather than mid-text
            if prototype.is_error():
                raise StructuredOutputError(f"invalid {next(iter(spec))}: {_short(prototype.get_error())}")
            with self._lock:
                self._prototypes[grammar] = prototype
                while len(self._prototypes) > self.PROTOTYPES:
                    self._prototypes.popitem(last=False)
        return prototype.deep_copy()


def allowed_tokens(matchers: Sequence[Any], vocab_size: int) -> np.ndarray:
    """``[len(matchers), vocab_size]`` bool: the tokens each matcher accepts next."""
    words = (vocab_size + 31) // 32
    bits = np.empty((len(matchers), words * 4), dtype=np.uint8)
    for i, m in enumerate(matchers):
        bits[i] = np.frombuffer(m.compute_bitmask(), dtype=np.uint8, count=words * 4)
    return np.unpackbits(bits, axis=1, bitorder="little")[:, :vocab_size].astype(bool)


@dataclasses.dataclass(frozen=True)
class ReasoningMarkers:
    """The single tokens around a reasoning model's thinking.

    Attributes:
        start: the token that opens the thinking at the start of a reply (``<think>``).
        end: the token that closes it (``</think>``).
        starts_in_thinking: the chat template opens the thinking in the prompt (DeepSeek-R1), so every reply
            begins inside it; otherwise a reply thinks only if its first token is ``start``.
    """

    start: int
    end: int
    starts_in_thinking: bool


class AfterReasoning:
    """A grammar matcher whose constraint starts after the thinking: while the reply thinks every token but
    EOS is allowed (the reply may not end before its constrained answer) and none reaches the grammar; the
    ``end`` token hands over to it. Without ``starts_in_thinking`` the first token may be the grammar's or
    ``start`` (which opens the thinking). The matcher interface the engine uses (``compute_bitmask``,
    ``consume_token``, ``is_stopped``, ``is_error``, ``get_error``, ``deep_copy``)."""

    _OPENING, _THINKING, _ANSWER = range(3)

    def __init__(self, inner: Any, markers: ReasoningMarkers, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 state: int | None = None):
        self.inner = inner
        self.markers = markers
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.state = (self._THINKING if markers.starts_in_thinking else self._OPENING) if state is None else state
        self._thinking_mask: bytes | None = None

    def _thinking_bits(self) -> bytes:
        """Every token but EOS."""
        if self._thinking_mask is None:
            bits = bytearray(b"\xff" * (((self.vocab_size + 31) // 32) * 4))
            for t in self.eos_token_ids:
                if t < self.vocab_size:
                    bits[t >> 3] &= ~(1 << (t & 7)) & 0xFF
            self._thinking_mask = bytes(bits)
        return self._thinking_mask

    @property
    def thinking(self) -> bool:
        return self.state == self._THINKING

    def compute_bitmask(self) -> bytes:
        if self.state == self._ANSWER:
            return self.inner.compute_bitmask()
        if self.state == self._THINKING:
            return self._thinking_bits()
        bits = bytearray(self.inner.compute_bitmask())
        bits[self.markers.start >> 3] |= 1 << (self.markers.start & 7)
        return bytes(bits)

    def consume_token(self, token: int) -> bool:
        if self.state == self._THINKING:
            if token == self.markers.end:
                self.state = self._ANSWER
            return True
        if self.state == self._OPENING:
            if token == self.markers.start:
                self.state = self._THINKING
                return True
            self.state = self._ANSWER
        return bool(self.inner.consume_token(token))

    def is_stopped(self) -> bool:
        return self.state == self._ANSWER and bool(self.inner.is_stopped())

    def is_error(self) -> bool:
        return bool(self.inner.is_error())

    def get_error(self) -> str:
        return str(self.inner.get_error())

    def deep_copy(self) -> AfterReasoning:
        return AfterReasoning(self.inner.deep_copy(), self.markers, self.vocab_size, self.eos_token_ids, self.state)


def reasoning_markers(tokenizer: Any, start: str, end: str, starts_in_thinking: bool) -> ReasoningMarkers | None:
    """The markers as single tokens of ``tokenizer``; ``None`` where either is not one token."""
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in (start, end)]
    if any(len(i) != 1 for i in ids):
        return None
    return ReasoningMarkers(ids[0][0], ids[1][0], starts_in_thinking)
