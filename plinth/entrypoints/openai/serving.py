"""What the completion and chat handlers share: the engine front, metrics, checks, logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

from starlette.requests import Request

from plinth.core.async_engine import AsyncLLMEngine, EngineUnavailableError
from plinth.core.engine import MIN_CHARS_PER_TOKEN
from plinth.core.pooling import MAX_TRUNCATED_CHARS, PoolingParams, PoolingRequestOutput
from plinth.core.request import (
    Logprob,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    json_logprob,
    truncation_problem,
)
from plinth.core.scheduler import QueueFullError, RequestRejectedError
from plinth.core.structured import StructuredOutputError, grammar_of
from plinth.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_async
from plinth.entrypoints.openai.errors import APIError, bad_request
from plinth.entrypoints.openai.reasoning_parsers import ReasoningParser
from plinth.entrypoints.openai.streaming import unless_disconnected
from plinth.entrypoints.openai.tool_parsers import ToolParser
from plinth.errors import SleepModeError
from plinth.lora.request import LoRARequest
from plinth.metrics import ServerMetrics

T = TypeVar("T")

logger = logging.getLogger(__name__)

MAX_N = 128   # choices per prompt
MAX_CHOICES = 2048   # choices per request (prompts x n)
#: prompt text is refused before it is tokenized when it has more characters than the context's tokens times
#: the longest token of the vocabulary (at least this many; real text has a few characters per token)
MAX_CHARS_PER_TOKEN = MIN_CHARS_PER_TOKEN


@dataclasses.dataclass(frozen=True, eq=False)
class HeldLoRA(LoRARequest):
    """The adapter a request named, held from its arrival (``adapter``: the engine's copy, once in memory): a
    request accepted while the adapter was served finishes with it, though it is unloaded meanwhile."""

    adapter: Any = dataclasses.field(default=None, repr=False)


class LoRANameError(ValueError):
    """An adapter's name that cannot be served: empty, or ``taken`` by the base model or another adapter."""

    def __init__(self, message: str, taken: bool):
        super().__init__(message)
        self.taken = taken


#: what a server of each task is, what a route of each task needs, and the routes each task serves
_TASK_IS = {"generate": "generates text", "embed": "is an embedding model (--task embed)",
            "classify": "is a classifier (--task classify)"}
_TASK_NEEDS = {"generate": "a text generation model", "embed": "an embedding model served with --task embed",
               "classify": "a classifier served with --task classify"}
_TASK_ROUTES = {"generate": "/v1/chat/completions, /v1/completions or /v1/responses",
                "embed": "/v1/embeddings, /pooling, /v1/score or /v1/rerank",
                "classify": "/classify or /pooling (and /v1/score or /v1/rerank for a one-label cross-encoder)"}


@dataclasses.dataclass
class ServerContext:
    """Everything a handler needs, owned by one app (no module-level state)."""

    front: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str
    #: the ``--tool-call-parser`` class (tool_choice "auto"), if any
    tool_parser: type[ToolParser] | None = None
    #: the ``--reasoning-parser`` class, if any
    reasoning_parser: type[ReasoningParser] | None = None
    #: ``--return-tokens-as-token-ids``: logprob tokens as ``token_id:N`` unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    #: LoRA adapters served by name (``--lora-modules``, ``/v1/load_lora_adapter``): a request's ``model``
    loras: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    #: ``--allow-runtime-lora-updating``: the load/unload routes are on
    allow_lora_updates: bool = False
    #: ``--response-role``: the role of chat replies to requests with ``add_generation_prompt`` (the default)
    response_role: str = "assistant"
    #: ``--enable-force-include-usage``: every stream ends with a usage chunk, asked for or not
    force_include_usage: bool = False
    _lora_ids: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))
    _loading: set[str] = dataclasses.field(default_factory=set)   # adapter names being read
    _lora_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _token_text_cache: dict[int, tuple[str, bytes]] = dataclasses.field(default_factory=dict)
    #: engine requests of an HTTP request that was refused as a whole (another of its prompts was): counted by no
    #: request metric, like the refused one itself
    _refused: set[str] = dataclasses.field(default_factory=set)
    _special_ids: frozenset[int] | None = None   # the tokenizer's special token ids, read once
    # one tokenization at a time (a tokenizer call may set its truncation state), in a worker thread
    _tokenize_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's generation-config defaults (``SamplingParams`` keywords) for fields a request leaves unset."""
        return getattr(self.front, "default_sampling", None) or {}

    @property
    def default_max_tokens(self) -> int | None:
        """The model's ``max_new_tokens``: the most a request without ``max_tokens`` generates."""
        return getattr(self.front, "default_max_tokens", None)

    def default_room(self, num_prompt: int) -> int:
        """The output a request without ``max_tokens`` gets after ``num_prompt`` tokens: the rest of the context,
        at most the model's ``max_new_tokens``."""
        room = self.front.max_model_len - num_prompt
        cap = self.default_max_tokens
        return min(room, cap) if cap is not None and room >= 1 else room

    def check_task(self, task: str | tuple[str, ...], route: str) -> None:
        """Refuse a route the engine's task (text generation, embeddings, classification) does not serve."""
        tasks = (task,) if isinstance(task, str) else task
        mine = getattr(self.front, "task", "generate")
        if mine in tasks:
            return
        needs = " or ".join(_TASK_NEEDS[t] for t in tasks)
        raise bad_request(f"the model {self.model_name!r} {_TASK_IS[mine]}; {route} needs {needs}: use "
                          f"{_TASK_ROUTES[mine]}", "model", "model_not_supported")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to (``--served-model-name A B ...``), the reported one first."""
        return (self.model_name, *getattr(self.front, "served_model_aliases", ()))

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (``None``: the base model, or no name; an empty name
        is no name, as in vLLM).

        Raises:
            APIError: 404, no such model or adapter.
        """
        if not name or name in self.model_names or name == getattr(self.front, "model_argument", None):
            return None   # (the model argument as given: what vLLM serves it as without --served-model-name)
        lora = self.loras.get(name)
        if lora is None:
            adapters = f" and the LoRA adapters {', '.join(map(repr, self.loras))}" if self.loras else ""
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}{adapters}",
                           "not_found_error", "model", "model_not_found")
        held = getattr(self.front, "lora_adapter", None)
        return HeldLoRA(lora.lora_name, lora.lora_int_id, lora.lora_path,
                        adapter=held(lora.lora_int_id) if held is not None else None)

    def reply_model(self, lora: LoRARequest | None) -> str:
        """The ``model`` of a reply: the adapter's name for a request that named one (decided when it arrived,
        whatever is unloaded meanwhile), else the served name."""
        return lora.lora_name if lora is not None else self.model_name

    def add_lora(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name`` (read and checked by the engine; a fresh id, so a name
        loaded again after an unload reads its files again). With ``replace``, an adapter already served as
        ``name`` is replaced once the new one is read (requests that arrived before finish with the old one).
        Blocks while the adapter is read: call it in a worker thread while serving.

        Raises:
            LoRANameError: no name, or one taken (the base model's or, without ``replace``, another adapter's, or
                one being loaded).
            ValueError: the adapter cannot be served.
        """
        with self._lora_lock:
            if not name or name in self.model_names or (name in self.loras and not replace) or name in self._loading:
                whose = " by the served model" if name in self.model_names else "; unload that adapter first"
                raise LoRANameError(f"the model name {name!r} is taken{whose}" if name else "an adapter needs a name",
                                    taken=bool(name))
            self._loading.add(name)
            lora = LoRARequest(name, next(self._lora_ids), path)
        try:
            self.front.add_lora(lora)
            with self._lora_lock:
                old = self.loras.get(name)
                self.loras[name] = lora
            if old is not None:
                self.front.remove_lora(old.lora_int_id)
        finally:
            with self._lora_lock:
                self._loading.discard(name)
        return lora

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str = "max_tokens", min_tokens: int = 0, pooling: bool = False) -> None:
        """Refuse a prompt that, with its ``max_tokens`` (or ``min_tokens``), cannot fit in the model's context
        (``pooling``: an input to embed, which may fill the context: nothing comes after it)."""
        limit = self.front.max_model_len
        if pooling and num_prompt > limit:
            raise bad_request(f"the input has {num_prompt} tokens, but this model's maximum context length is {limit} "
                              f"tokens; shorten it", prompt_param, "context_length_exceeded")
        if not pooling and num_prompt >= limit:
            raise bad_request(
                f"the prompt has {num_prompt} tokens, but this model's maximum context length is {limit} "
                f"tokens (prompt plus output); shorten the prompt", prompt_param, "context_length_exceeded")
        if min_tokens > limit - num_prompt:
            raise bad_request(
                f"min_tokens is {min_tokens}, but after the prompt's {num_prompt} tokens this model's maximum "
                f"context length of {limit} tokens leaves room for {limit - num_prompt}", "min_tokens",
                "context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(
                f"the prompt has {num_prompt} tokens and {max_tokens_param} is {max_tokens}: "
                f"{num_prompt + max_tokens} tokens in all, but this model's maximum context length is {limit} "
                f"tokens; shorten the prompt or lower {max_tokens_param}", max_tokens_param,
                "context_length_exceeded")

    def truncated_text_limit(self) -> int:
        """The most characters of prompt text tokenized for a request with ``truncate_prompt_tokens`` (which keeps
        only the last tokens): what the context could hold, or :data:`MAX_TRUNCATED_CHARS` if more."""
        return max(self.front.chars_per_token * self.front.max_model_len, MAX_TRUNCATED_CHARS)

    def check_text(self, chars: int, param: str, truncating: bool = False) -> None:
        """Refuse ``chars`` characters of prompt text that cannot fit in the context: more than its tokens
        times the longest token of the vocabulary (before spending time tokenizing them). A request that keeps
        only its prompt's last tokens (``truncating``: ``truncate_prompt_tokens``) may send more, up to
        :meth:`truncated_text_limit`."""
        limit = self.front.max_model_len
        per_token = self.front.chars_per_token
        if truncating and chars > (most := self.truncated_text_limit()):
            raise bad_request(
                f"the prompt has {chars} characters; with truncate_prompt_tokens at most {most} are tokenized; "
                f"shorten the prompt", param, "context_length_exceeded")
        if not truncating and chars > per_token * limit:
            raise bad_request(
                f"the prompt has {chars} characters, more than {per_token} (the longest token) per token of this "
                f"model's maximum context length ({limit} tokens); shorten the prompt", param,
                "context_length_exceeded")

    async def tokenize(self, text: str, add_special_tokens: bool, param: str, truncating: bool = False) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread (a long prompt does not stall the server); the
        engine's refusals (text that is not valid Unicode, a lone UTF-16 surrogate) are 400s naming ``param``.
        ``truncating``: see :meth:`check_text`."""
        self.check_text(len(text), param, truncating)
        max_chars = self.truncated_text_limit() if truncating else None
        return await self._tokenized(param, lambda: self.front.tokenize(text, add_special_tokens=add_special_tokens,
                                                                        max_chars=max_chars))

    async def tokenize_pair(self, first: str, second: str, add_special_tokens: bool, param: str,
                            max_tokens: int | None = None) -> tuple[list[int], list[int] | None]:
        """Two texts tokenized together as a pair, cut to ``max_tokens`` (see ``LLMEngine.tokenize_pair``): token ids
        and token types, as :meth:`tokenize` (``truncating`` where ``max_tokens`` is given)."""
        self.check_text(len(first) + len(second), param, max_tokens is not None)
        max_chars = self.truncated_text_limit() if max_tokens is not None else None
        return await self._tokenized(param, lambda: self.front.tokenize_pair(
            first, second, add_special_tokens=add_special_tokens, max_chars=max_chars, max_tokens=max_tokens))

    async def _tokenized(self, param: str, tokenize: Callable[[], Any]) -> Any:
        def run() -> Any:
            with self._tokenize_lock:
                return tokenize()

        try:
            return await asyncio.to_thread(run)
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None) or param) from exc

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Refuse token ids outside the model's vocabulary."""
        vocab = self.front.vocab_size
        if vocab is None:   # the engine checks them when the request arrives
            return
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {vocab})", param)

    def note_ignored_fields(self, req: Any) -> None:
        """Log the request's fields plinth does not know (they are ignored, as vLLM does)."""
        ignored = req.ignored_fields()
        if ignored:   # names only (never values), shortened, quoted: client text cannot forge log lines
            shown = ", ".join(repr(name[:64]) for name in ignored[:20])
            more = f" and {len(ignored) - 20} more" if len(ignored) > 20 else ""
            logger.warning("request fields ignored (not supported): %s%s", shown, more)

    def token_namer(self, req: Any) -> Callable[[int], str]:
        """How the request's logprobs name tokens: ``token_id:N`` with ``return_tokens_as_token_ids`` (the
        request's, else the server's flag), else their text (:meth:`token_text`)."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids if as_ids is not None else self.return_tokens_as_token_ids:
            return lambda token_id: f"token_id:{token_id}"
        return self.token_text

    def truncated(self, ids: list[int], req: Any) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (all without it; -1: as many as the context
        holds, as vLLM takes it; an encoder's first ones, :func:`~plinth.core.pooling.kept_tokens`); 0, below -1 or
        beyond the context is a 400."""
        from plinth.core.pooling import kept_tokens

        keep = self.keep_tokens(req)
        if keep is None or len(ids) <= keep:
            return ids
        return kept_tokens(ids, keep, getattr(self.front, "encoder", False), getattr(self.front, "special_ids", ()))

    def keep_tokens(self, req: Any) -> int | None:
        """How many tokens ``req.truncate_prompt_tokens`` keeps (-1: the context; ``None``: no cut); 0, below -1
        or beyond the context is a 400."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return None
        check_truncation(keep, self.front.max_model_len)
        return self.front.max_model_len if keep == -1 else keep

    def prompt_logprobs(self, out: RequestOutput, k: int, name: Callable[[int], str]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: ``None`` for the first token, then for each prompt token its own
        log-probability and the ``k`` most likely, keyed by token id."""
        positions = list(out.prompt_logprobs or [])
        body: list[Any] = []
        for i, tid in enumerate(out.prompt_token_ids):
            pos = positions[i] if i < len(positions) else None
            if pos is None:
                body.append(None)
                continue
            keep = dict(self.top_logprobs(pos, k))
            entry = {}
            for t, lp in pos.items():
                if t == tid or t in keep:
                    entry[str(t)] = {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": name(t)}
            body.append(entry)
        return body

    @property
    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special token ids (what ``skip_special_tokens`` leaves out of a reply's text): its named
        ones and every added token marked special (SmolLM2's ``<file_sep>`` and the like)."""
        if self._special_ids is None:
            tok = self.front.tokenizer
            ids: set[int] = set()
            if tok is not None:
                ids.update(getattr(tok, "all_special_ids", ()) or ())
                added = getattr(tok, "added_tokens_decoder", None) or {}
                ids.update(i for i, t in added.items() if getattr(t, "special", False))
            self._special_ids = frozenset(ids)
        return self._special_ids

    def token_text(self, token_id: int) -> str:
        """The text of one token; a token that is only part of a UTF-8 character is written
        ``bytes:\\xNN...`` (as OpenAI does), so that distinct tokens never share a name."""
        return self._token_info(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (its UTF-8 text when they cannot be recovered)."""
        return self._token_info(token_id)[1]

    def _token_info(self, token_id: int) -> tuple[str, bytes]:
        cache = self._token_text_cache
        info = cache.get(token_id)
        if info is None:
            info = cache[token_id] = _describe_token(self.front.tokenizer, token_id)
        return info

    @staticmethod
    def top_logprobs(pos: PositionLogprobs, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely tokens at one position, as (token id, logprob), most likely first."""
        ranked = sorted(pos.items(), key=lambda kv: _rank_key(kv[1]))
        return [(tid, json_logprob(lp.logprob)) for tid, lp in ranked[:k]]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams | PoolingParams,
                       priority: int = 0, lora: LoRARequest | None = None,
                       accepted: asyncio.Future[None] | None = None, cache_salt: str | None = None,
                       multi_modal_data: dict[str, Any] | None = None, token_type_ids: list[int] | None = None,
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """``front.generate`` with metrics (an embedding engine takes PoolingParams); closing it aborts the engine
        request. ``accepted`` is resolved when the engine takes the request (see :func:`start`)."""
        await self._ensure_lora(lora)
        tracker = self.metrics.request()
        extra: dict[str, Any] = {} if multi_modal_data is None else {"multi_modal_data": multi_modal_data}
        if token_type_ids is not None:
            extra["token_type_ids"] = token_type_ids
        inner = self.front.generate(request_id, prompt_ids, params, priority, lora, accepted=accepted,
                                    cache_salt=cache_salt, **extra)
        error = False
        try:
            async for out in inner:
                tracker.observe(out)
                yield out
        except asyncio.CancelledError:
            raise
        except (RequestRejectedError, QueueFullError, SleepModeError, EngineUnavailableError):
            tracker.discard()   # refused on arrival (a client error, a full queue or a stopped engine: a 503): counted
            raise               # by no request metric
        except Exception:
            error = True
            raise
        finally:
            await inner.aclose()
            if request_id in self._refused:
                tracker.discard()
            else:
                tracker.close(error=error)

    def check_room(self, sequences: int, param: str) -> None:
        """Refuse (400) a request of ``sequences`` engine sequences at once that even an idle engine could never take:
        more than the running batch and a bounded waiting queue hold together (``--max-num-seqs`` +
        ``--max-waiting-requests``). A queue full of other requests is a 503 to retry; this one never fits."""
        scheduler = getattr(getattr(self.front, "config", None), "scheduler", None)
        cap = getattr(scheduler, "max_waiting_requests", None)
        if cap is None or not isinstance(getattr(scheduler, "max_num_seqs", None), int):
            return
        places = scheduler.max_num_seqs
        if sequences > places + cap:
            raise bad_request(f"the request needs {sequences} sequences at once, more than the running batch and the "
                              f"waiting queue hold together ({places} + {cap}); split it into smaller requests"
                              + (" or lower n" if param == "n" else ""), param)

    async def _ensure_lora(self, lora: LoRARequest | None) -> None:
        """The adapter in memory for the request: held since it arrived, in the engine's host cache, or read
        (again) off the engine's thread if it was evicted, and then held. One unloaded before it was held is a
        404, as if the request had arrived after the unload."""
        if lora is None or getattr(lora, "adapter", None) is not None:
            return
        in_memory = getattr(self.front, "lora_adapter", None)
        adapter = in_memory(lora.lora_int_id) if in_memory is not None else None
        if adapter is None:
            try:
                adapter = await asyncio.to_thread(self.front.add_lora, lora)
            except RequestRejectedError:
                served = self.loras.get(lora.lora_name)
                if served is None or served.lora_int_id != lora.lora_int_id:
                    raise APIError(404, f"the LoRA adapter {lora.lora_name!r} was unloaded", "not_found_error",
                                   "model", "model_not_found") from None
                raise
        if isinstance(lora, HeldLoRA):
            object.__setattr__(lora, "adapter", adapter)

    async def beam_search(self, request_id: str, starts: list[list[int]], params: BeamSearchParams,
                          lora: LoRARequest | None, priority: int = 0, cache_salt: str | None = None
                          ) -> list[BeamSearchOutput]:
        """:func:`beam_search_async` on the engine, counted in the metrics as one request per prompt
        (:meth:`~plinth.metrics.ServerMetrics.count_beam_search`); a search refused on arrival counts nothing."""
        self.check_room(len(starts) * params.beam_width, "n" if len(starts) == 1 else "prompt")
        if getattr(self.front, "logprobs_as_logits", False):
            raise bad_request("use_beam_search ranks beams by log-probabilities, and this server's logprobs are logits "
                              "(--logprobs-mode raw_logits or processed_logits)", "use_beam_search")
        await self._ensure_lora(lora)
        t0 = time.monotonic()
        outs: list[BeamSearchOutput] | None = None
        error = refused = False
        try:
            outs = await beam_search_async(self.front, request_id, starts, params, lora, priority, cache_salt)
            return outs
        except (RequestRejectedError, QueueFullError, SleepModeError, EngineUnavailableError):
            refused = True
            raise
        except Exception:
            error = True
            raise
        finally:
            if not refused:
                self.metrics.count_beam_search([len(s) for s in starts],
                                               None if outs is None else [o.sequences for o in outs], error,
                                               time.monotonic() - t0)


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (each byte drawn as one printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def check_truncation(keep: int, max_model_len: int) -> None:
    """Refuse a ``truncate_prompt_tokens`` of 0, below -1 or beyond the model's context (400s)."""
    problem = truncation_problem(keep)
    if problem is not None:
        raise bad_request(f"truncate_prompt_tokens {problem}", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens is {keep}, more than this model's context of {max_model_len} "
                          "tokens; give a smaller value (or -1: the context)", "truncate_prompt_tokens")


def _describe_token(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    if tokenizer is None:
        return str(token_id), str(token_id).encode()
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    if "\ufffd" not in text:
        # a SentencePiece word-start token ("\u2581the") decoded alone loses its space (the decoder strips the
        # text's first one), which it has within a text
        spaces = len(piece) - len(piece.lstrip("\u2581"))
        if spaces and not text.startswith(" " * spaces):
            text = " " * (spaces - (len(text) - len(text.lstrip(" ")))) + text
        return text, text.encode("utf-8")
    raw: bytes | None = None
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):          # SentencePiece byte fallback
        raw = bytes([int(piece[3:5], 16)])
    elif piece and all(ch in _byte_level_decoder() for ch in piece):   # byte-level BPE
        raw = bytes(_byte_level_decoder()[ch] for ch in piece)
    if raw is None or raw.decode("utf-8", errors="replace") != text:
        return text, text.encode("utf-8")
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _rank_key(lp: Logprob) -> tuple[int, float]:
    return (lp.rank if lp.rank is not None else 1 << 30, -lp.logprob)


def sampling_params(build: Any, renames: dict[str, str] | None = None, max_logprobs: int | None = None) -> SamplingParams:
    """Call ``build()`` and turn a :class:`SamplingParamsError` into a 400 naming the request field; log-probability
    counts above ``max_logprobs`` (the engine's) are 400s too."""
    try:
        params = build()
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if max_logprobs is not None and asked is not None and asked > max_logprobs:
                raise SamplingParamsError(name, f"must be at most {max_logprobs} (--max-logprobs), got {asked}")
    except SamplingParamsError as exc:
        param = (renames or {}).get(exc.param, exc.param)
        message = str(exc).replace(f"{exc.param}:", f"{param}:", 1)
        if exc.param in ("logprobs", "prompt_logprobs") and max_logprobs is not None:   # (a count beyond any
            message = f"{param}: must be at most {max_logprobs} (--max-logprobs)"       # engine: the engine's limit)
        raise bad_request(message, param) from exc
    if params.n > MAX_N:
        raise bad_request(f"n: must be at most {MAX_N}, got {params.n}", "n")
    return params


async def check_structured(ctx: ServerContext, req: Any, params: SamplingParams) -> None:
    """Compile the request's structured-output constraint in a worker thread (a large schema or grammar
    takes a while; the event loop keeps serving): one that does not compile is a 400 naming its field."""
    if params.structured_outputs is None:
        return
    asked = req.structured()
    field = asked[0] if asked is not None else "structured_outputs"
    spec = params.structured_outputs

    def compile_it() -> None:
        grammar_of(spec)
        prepare = getattr(ctx.front, "prepare_grammar", None)
        if prepare is not None:
            prepare(spec)

    try:
        await asyncio.to_thread(compile_it)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), field) from None


#: request fields that would change which tokens a sequence may take or where it stops (beam search has none of
#: them), with the values that ask for nothing
_BEAM_IGNORES = {name: (None, 0, [], {}, "") for name in ("stop", "stop_token_ids", "min_tokens", "bad_words",
                                                          "allowed_token_ids", "logit_bias", "presence_penalty",
                                                          "frequency_penalty", "vllm_xargs")} | {
    "repetition_penalty": (None, 1.0)}


def beam_search_params(req: Any, max_tokens: int | None, max_tokens_param: str, room: int,
                       max_logprobs: int = SamplingParams.MAX_LOGPROBS) -> BeamSearchParams:
    """The beam search a ``use_beam_search`` request asks for (``n`` beams; ``room``: the tokens the context
    leaves after the longest prompt, the default ``max_tokens``); what it cannot do is a 400."""
    if req.stream:
        raise bad_request("use_beam_search does not stream; set stream to false", "stream")
    if getattr(req, "logprobs", None) not in (None, False):
        raise bad_request("use_beam_search does not return logprobs", "logprobs")
    if req.prompt_logprobs is not None:
        raise bad_request("use_beam_search does not return prompt_logprobs", "prompt_logprobs")
    if req.structured() is not None or ("tools" in type(req).model_fields and req.tools):
        raise bad_request("use_beam_search cannot be combined with a structured-output constraint or tools",
                          "use_beam_search")
    for field, nothing in _BEAM_IGNORES.items():   # what the beams would not honour: refused rather than dropped
        if getattr(req, field, None) not in nothing:
            raise bad_request(f"use_beam_search does not take {field}", field)
    try:
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens if max_tokens is not None else room,
                                  ignore_eos=req.ignore_eos, length_penalty=req.length_penalty)
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width must be at most {max_logprobs // 2} on this server (2 x n candidates per "
                             f"round, and --max-logprobs is {max_logprobs}), got {params.beam_width}")
        return params
    except ValueError as exc:
        text = str(exc)
        param = ("length_penalty" if "length_penalty" in text else "n" if "beam_width" in text
                 else max_tokens_param)
        raise bad_request(text.replace("beam_width", "n (the beam width)"), param) from None


def check_choices(prompts: int, n: int) -> None:
    """Refuse a request for more than :data:`MAX_CHOICES` completions in all."""
    if prompts * n > MAX_CHOICES:
        raise bad_request(f"the request asks for {prompts} prompts x n={n} = {prompts * n} completions; at most "
                          f"{MAX_CHOICES} per request", "n" if n > 1 else "prompt")


async def collect(events: AsyncIterator[tuple[int, Any]], count: int) -> list[Any]:
    """The last output of each of ``count`` merged streams (see :func:`merge`)."""
    latest: list[Any] = [None] * count
    async for i, out in events:
        latest[i] = out
    return latest


class Started(NamedTuple):
    """Requests the engine has taken: their streams and each one's pending first output."""
    streams: list[AsyncIterator[Any]]
    firsts: list[asyncio.Future[Any]]


async def start(ctx: ServerContext, requests: Sequence[tuple[str, list[int], Any]], priority: int = 0,
                lora: LoRARequest | None = None, param: str | Sequence[str] = "prompt",
                cache_salt: str | None = None, multi_modal_data: dict[str, Any] | None = None,
                token_types: Sequence[list[int] | None] | None = None) -> Started:
    """Submit ``(request id, prompt ids, params)`` requests and wait until the engine has taken every
    one (not for their first tokens, which may come much later when the batch is full), so that a
    rejected prompt fails the whole request before a response starts. On any failure (or
    cancellation) every stream is closed, which aborts its engine request. ``param``: the client's field
    holding the prompts, or each request's (a refusal then names the refused one's). ``multi_modal_data``: the
    images of every request (a chat request's). ``token_types``: each request's ``token_type_ids`` (a cross-encoder's
    text pairs), or ``None``."""
    counts = [getattr(params, "n", 1) for _, _, params in requests]
    fields = [param] * len(requests) if isinstance(param, str) else list(param)
    ctx.check_room(sum(counts), "n" if max(counts, default=1) > 1 else fields[-1] if fields else "prompt")
    loop = asyncio.get_running_loop()
    accepted = [loop.create_future() for _ in requests]
    images = {"multi_modal_data": multi_modal_data} if multi_modal_data is not None else {}
    types = list(token_types) if token_types is not None else [None] * len(requests)
    streams = [ctx.generate(rid, ids, params, priority, lora, accepted=fut, cache_salt=cache_salt, **images,
                            **({"token_type_ids": kinds} if kinds is not None else {}))
               for (rid, ids, params), fut, kinds in zip(requests, accepted, types, strict=True)]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]   # type: ignore[arg-type]
    try:
        while True:
            failed = next((t for t in firsts if t.done() and (t.cancelled() or t.exception() is not None)), None)
            if failed is not None:
                try:
                    failed.result()   # raises its error
                except RequestRejectedError as exc:
                    if exc.param is None:
                        exc.param = fields[firsts.index(failed)]
                    raise
            waiting = [f for f, t in zip(accepted, firsts, strict=True) if not (f.done() or t.done())]
            if not waiting:
                return Started(streams, firsts)
            await asyncio.wait([*waiting, *(t for t in firsts if not t.done())],
                               return_when=asyncio.FIRST_COMPLETED)
    except BaseException as exc:
        refused = isinstance(exc, RequestRejectedError | QueueFullError | SleepModeError)   # a 400 or a 503
        ids = [rid for rid, _, _ in requests]
        if refused:
            ctx._refused.update(ids)
        try:
            await _close(Started(streams, firsts))
        finally:
            ctx._refused.difference_update(ids)
        raise


async def _close(started: Started) -> None:
    """Stop waiting for first outputs and close every stream (which aborts its engine request)."""
    for t in started.firsts:
        t.cancel()
    await asyncio.gather(*started.firsts, return_exceptions=True)
    for s in started.streams:
        await s.aclose()   # type: ignore[attr-defined]


class Merged:
    """Several started requests' outputs as ``(prompt index, output)``, each request's as they come
    (see :func:`merge`). :meth:`aclose` always closes (and so aborts) every stream, also when
    iteration never started, which an async generator's ``finally`` alone would miss."""

    def __init__(self, started: Started):
        self._started = started
        self._outputs = _merged(started)

    def __aiter__(self) -> Merged:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        try:
            await self._outputs.aclose()
        finally:
            await _close(self._started)


async def finish(raw: Request, events: Merged, work: Awaitable[T]) -> T:
    """``unless_disconnected(raw, work)`` for ``work`` that reads ``events``; ``events`` is closed afterwards
    whatever happened (a disconnect can cancel ``work`` before it ever started reading)."""
    try:
        return await unless_disconnected(raw, work)
    finally:
        await events.aclose()


def merge(started: Started) -> Merged:
    """Interleave several started requests' outputs; the caller closes the result when done with it
    (``SSEResponse(..., on_close=merged.aclose)``, or ``finally: await merged.aclose()``)."""
    return Merged(started)


async def _merged(started: Started) -> AsyncIterator[tuple[int, Any]]:
    """The outputs behind :class:`Merged` (whose ``aclose`` closes the streams once this has stopped)."""
    streams, firsts = started
    if len(streams) == 1:
        out = await firsts[0]
        yield 0, out
        if not out.finished:
            async for out in streams[0]:
                yield 0, out
        return
    # bounded: a reader that stops reading stops the pumps, and each request's mailbox then merges its outputs
    # (a caller that stops reading holds one output per request, not one per step)
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int) -> None:
        try:
            out = await firsts[i]
            await queue.put((i, out))
            if not out.finished:
                async for out in streams[i]:
                    await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))

    live = set(range(len(streams)))
    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live.discard(i)
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
