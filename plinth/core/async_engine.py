"""An asyncio front for :class:`~plinth.core.engine.LLMEngine`, used by the HTTP server.

The engine is not thread safe and its steps block, so one background thread owns it: the
thread takes commands (add, abort) from a queue, runs ``step()`` while there is work, and
sleeps on an event when there is none. Each request has a :class:`_Mailbox` on the caller's
event loop; a step's outputs are handed over with one ``loop.call_soon_threadsafe`` per loop,
so the event loop never waits on the engine and the engine never waits on a client. Outputs are
cumulative, so a mailbox keeps only the newest unread one: a caller that stops reading (a client
that does not take its stream) holds one output, not one per step.

The interface is deliberately small (``generate``, ``abort``, ``stats``, ``shutdown``, plus the
read-only facts the server needs: tokenizer, limits, names), so the engine can later move to
its own process behind the same methods.

Failure handling: if ``step()`` raises, every in-flight request fails with
:class:`EngineDeadError` (never a hang), later requests fail at once, and ``is_healthy`` turns
False. The traceback goes to the log, not to the callers.

Ownership: a front built by :meth:`AsyncLLMEngine.from_config` (or with ``owns_engine=True``) owns
its engine and shuts it down when its loop ends (on :meth:`~AsyncLLMEngine.shutdown`, or after a
crash), which stops the engine's worker processes; a front given someone else's engine leaves it
running, so the caller can go on using it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from plinth.core.prompt_embeds import PromptEmbeds
from plinth.core.request import RequestOutput, RequestOutputKind, SamplingParams
from plinth.core.scheduler import RequestRejectedError
from plinth.errors import RequestFailedError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it crashed or was shut down); the request cannot complete."""


class EngineUnavailableError(EngineDeadError):
    """The engine loop had stopped before it took the request: refused as a whole, it never ran."""


class _Mailbox:
    """One request's unread news on its caller's event loop (used on that loop only): whether the engine has
    accepted it, and its newest output or the error that ended it. A newer output replaces an unread one
    (outputs are cumulative); an error is kept."""

    def __init__(self) -> None:
        self.accepted = False
        self.item: Any = None
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        if item is _ACCEPTED:
            self.accepted = True
        elif not isinstance(self.item, BaseException):
            self.item = item
        self._ready.set()

    async def take(self) -> Any:
        """The newest unread output or error (None when only the acceptance is new)."""
        await self._ready.wait()
        self._ready.clear()
        item, self.item = self.item, None
        return item


@dataclasses.dataclass
class _Sink:
    """Where the outputs of one request go: a mailbox living on one event loop."""

    loop: asyncio.AbstractEventLoop
    box: _Mailbox


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    sink: _Sink
    priority: int = 0
    lora_request: Any = None
    cache_salt: str | None = None
    multi_modal_data: Any = None
    token_type_ids: list[int] | None = None


_ACCEPTED = object()   # sent to a request's queue when the engine takes it


@dataclasses.dataclass
class _Call:
    """A function of the engine run on the engine's thread between steps; its result or error goes to ``future``."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str
    sink: _Sink | None = None   # only the request this caller added (None: whichever holds the id)


class AsyncLLMEngine:
    """Runs an engine in a background thread and streams its outputs to asyncio callers.

    Args:
        engine: a constructed :class:`~plinth.core.engine.LLMEngine`; only the front's thread steps it
            from now on.
        owns_engine: shut the engine down (and stop its workers) when the loop ends.
    """

    def __init__(self, engine: Any, owns_engine: bool = False):
        self._engine = engine
        self._owns_engine = owns_engine
        self._update_lock: tuple[Any, asyncio.Lock] | None = None   # (its event loop, the lock of weight updates)
        self.tokenizer = engine.tokenizer
        self.images = engine.images   # image inputs' support (plinth.multimodal.images.ImageSupport), or None
        self.prompt_embeds: bool = bool(getattr(engine, "prompt_embeds", False))   # enable_prompt_embeds
        self.max_model_len: int = engine.max_model_len
        self.max_sequence_len: int = getattr(engine, "max_sequence_len", self.max_model_len)
        self.vocab_size: int | None = getattr(engine, "vocab_size", None)
        self.eos_token_ids: tuple[int, ...] = tuple(getattr(engine, "eos_token_ids", ()))
        self.default_sampling: dict[str, Any] = dict(getattr(engine, "default_sampling", None) or {})
        self.default_max_tokens: int | None = getattr(engine, "default_max_tokens", None)
        self.task: str = getattr(engine, "task", "generate")   # "embed", "classify": requests take PoolingParams
        self.classifier = getattr(engine, "classifier", None)   # a sequence classifier's head (its labels)
        self.encoder: bool = bool(getattr(engine, "encoder", False))   # an encoder-only model (BERT, ...)
        self.special_ids: frozenset[int] = frozenset(getattr(engine, "special_ids", ()))
        self.num_token_types: int = int(getattr(engine, "num_token_types", 0) or 0)   # (BERT's segments: 2)
        self.config: Any = getattr(engine, "config", None)     # the engine's resolved configuration
        self.max_logprobs: int = getattr(engine, "max_logprobs", 20)
        self.logprobs_as_logits: bool = getattr(engine, "logprobs_as_logits", False)
        self.served_model_name: str = engine.served_model_name
        self.served_model_aliases: tuple[str, ...] = tuple(getattr(engine, "served_model_aliases", ()))
        self.model_argument: str | None = getattr(engine, "model_argument", None)
        self.selection = engine.selection
        self.load_time_s: float = getattr(engine, "load_time_s", 0.0)
        self._commands: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._lock = threading.Lock()          # orders command submission against death/shutdown
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}     # engine-thread only
        self._holding = 0   # beam searches running (see holding())
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = self._read_stats()
        self._idle_work = callable(getattr(engine, "idle_work", None))   # until it reports none left
        self._platform = getattr(engine, "platform", None)
        if self._platform is not None:
            self._platform.hand_over_to_thread()
        self._thread = threading.Thread(target=self._run, name="plinth-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: Any) -> AsyncLLMEngine:
        from plinth.core.engine import LLMEngine

        return cls(LLMEngine(config), owns_engine=True)

    # ------------------------------------------------------------------------------- public API

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """The exception that stopped the engine loop, or ``None`` while it runs."""
        return self._dead

    def tokenize(self, text: str, add_special_tokens: bool = True, max_chars: int | None = None) -> list[int]:
        """Token ids of ``text`` with the model's tokenizer and the engine's checks (text that is not valid Unicode,
        or longer than the context could hold or than ``max_chars``: :class:`RequestRejectedError`)."""
        return self._engine.tokenize(text, add_special_tokens=add_special_tokens, max_chars=max_chars)

    def tokenize_pair(self, first: str, second: str, add_special_tokens: bool = True, max_chars: int | None = None,
                      max_tokens: int | None = None) -> tuple[list[int], list[int] | None]:
        """Two texts as a pair: token ids and token types (see ``LLMEngine.tokenize_pair``)."""
        return self._engine.tokenize_pair(first, second, add_special_tokens=add_special_tokens, max_chars=max_chars,
                                          max_tokens=max_tokens)

    @property
    def chars_per_token(self) -> int:
        """The most characters one token can stand for (see ``LLMEngine.chars_per_token``)."""
        return self._engine.chars_per_token

    def add_lora(self, lora_request: Any) -> Any:
        """Read and check a LoRA adapter for later requests, off the engine's thread (call it in a worker
        thread; see ``LLMEngine.add_lora``).

        Raises:
            RequestRejectedError: adapters are not enabled, or this one cannot be served.
        """
        return self._engine.add_lora(lora_request)

    def has_lora(self, lora_int_id: int) -> bool:
        """Whether the adapter is read already (see ``LLMEngine.has_lora``)."""
        return self._engine.has_lora(lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter (see ``LLMEngine.remove_lora``)."""
        return self._engine.remove_lora(lora_int_id)

    def lora_adapter(self, lora_int_id: int) -> Any:
        """The adapter if it is in memory, reading no file (see ``LLMEngine.lora_adapter``)."""
        return self._engine.lora_adapter(lora_int_id)

    def prepare_grammar(self, spec: dict[str, Any]) -> None:
        """Compile a structured-output constraint, off the engine's thread (call it in a worker thread
        before :meth:`generate`): the request then copies the prepared matcher.

        Raises:
            StructuredOutputError: the constraint does not compile.
        """
        self._engine.grammar_matcher(spec)

    @property
    def chat_template_source(self) -> str | None:
        """The chat template's text (``--chat-template`` or the model's), if there is one; of a model's named
        templates (``default``, ``tool_use``, ...) all of them, one after another."""
        template = self._engine.chat_template or getattr(self._engine.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(t for t in template.values() if isinstance(t, str))
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation formatted with the model's chat template (or ``--chat-template``)."""
        return self._engine.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        continue_final_message=continue_final_message,
                                        template_kwargs=template_kwargs)

    async def generate(self, request_id: str, prompt: str | Sequence[int] | PromptEmbeds, params: SamplingParams | Any,
                       priority: int = 0, lora_request: Any = None,
                       accepted: asyncio.Future[None] | None = None,
                       cache_salt: str | None = None, multi_modal_data: dict[str, Any] | None = None,
                       token_type_ids: list[int] | None = None) -> AsyncIterator[RequestOutput | Any]:
        """Queue a request and yield its outputs until it finishes.

        Outputs are cumulative, so when the caller falls behind only the newest one is
        yielded; a request whose ``SamplingParams.output_kind`` is ``DELTA`` gets what is new since the output
        it was given before (the prompt's logprobs in the first), one that is ``FINAL_ONLY`` the final output only.
        Leaving the loop early (or being cancelled) aborts the request. ``accepted``
        (if given) is resolved once the engine has taken the request, which may be long before
        its first output when the batch is full. ``cache_salt``, ``multi_modal_data``, ``token_type_ids``: see
        :meth:`LLMEngine.add_request`.

        Raises:
            RequestRejectedError, QueueFullError: from the engine, before anything is yielded.
            RequestFailedError: the engine ended the request with an error of its own (a custom logits processor
                failed on it), after the outputs before.
            EngineDeadError: the engine loop is not running.
        """
        if not isinstance(request_id, str):   # (refused here: the engine loop keys its streams by id)
            raise RequestRejectedError(f"a request id must be a string, got {type(request_id).__name__}",
                                       param="request_id")
        if multi_modal_data is not None and self.images is not None:
            from plinth.multimodal.images import PreparedImages, media_pool

            # (the image processor runs here, not in the loop; images the server processed already with a request's
            # own settings are taken as they are)
            if not isinstance(multi_modal_data, PreparedImages):
                multi_modal_data = await asyncio.get_running_loop().run_in_executor(
                    media_pool(), self.images.prepare, multi_modal_data)
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, _Mailbox())
        if not isinstance(prompt, str | PromptEmbeds):   # (a copy: the caller's list may change)
            prompt = list(prompt)
        self._submit(_Add(request_id, prompt, params, time.time(), sink, priority, lora_request, cache_salt,
                          multi_modal_data, token_type_ids))
        finished = False
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)
        delta = _Delta() if kind == RequestOutputKind.DELTA else None
        try:
            while True:
                item = await sink.box.take()
                if isinstance(item, BaseException):
                    finished = True   # nothing left to abort: rejected, or the engine is gone
                    raise item
                if accepted is not None and not accepted.done() and sink.box.accepted:
                    accepted.set_result(None)
                if item is None:
                    continue
                finished = item.finished
                if kind == RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                if delta is not None:
                    item = delta.next(item)
                    if item is None:
                        continue
                yield item
                if finished:
                    return
        finally:
            if not finished:   # this caller's request only: its add may yet be refused (an id in use)
                self._abort(_Abort(request_id, sink))

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its KV blocks are freed.

        Raises:
            TypeError: ``request_id`` is not a string.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        self._abort(_Abort(request_id))

    def _abort(self, command: _Abort) -> None:
        with self._lock:
            if self._dead is not None or self._stopping:
                return   # a stopped engine holds no live requests (shutdown aborts them all)
            self._commands.append(command)
        self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache between two steps (see ``LLMEngine.reset_prefix_cache``): ``False`` where
        running requests held cached blocks, which stay cached while they run.

        Raises:
            EngineUnavailableError: the engine is not running.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(lambda engine: engine.reset_prefix_cache(), future))
        return await asyncio.wrap_future(future)

    async def apply_model(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(model)`` on every rank's model, between two steps (see ``LLMEngine.apply_model``).

        Raises:
            EngineUnavailableError: the engine is not running; or what ``LLMEngine.apply_model`` raises.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(lambda engine: engine.apply_model(fn), future))
        return await asyncio.wrap_future(future)

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and on accelerators the weights) between two steps (see ``LLMEngine.sleep``).

        Raises:
            SleepModeError: sleep mode is off, requests are unfinished (also a beam search between its rounds), or
                the engine is asleep already.
            EngineUnavailableError: the engine is not running.
        """
        def sleep(engine: Any) -> None:
            if self._holding:
                from plinth.errors import SleepModeError

                raise SleepModeError(f"cannot sleep with {self._holding} beam search(es) running: let them finish "
                                     "or abort them first")
            engine.sleep(level)

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(sleep, future))
        await asyncio.wrap_future(future)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Marks work that spans several engine requests one after another (a beam search's rounds): ``sleep()``
        refuses while any runs, as it refuses while requests run."""
        with self._lock:
            self._holding += 1
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory of ``tags`` (default: all) again (see ``LLMEngine.wake_up``).

        Raises:
            SleepModeError: sleep mode is off, or an unknown tag.
            ConfigError: no room on the device for them now.
            EngineUnavailableError: the engine is not running.
        """
        def wake(engine: Any) -> None:
            engine.wake_up(tags)
            self._idle_work = callable(getattr(engine, "idle_work", None))   # (a new CPU cache to fault in)

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(wake, future))
        await asyncio.wrap_future(future)

    def is_sleeping(self) -> bool:
        """Whether any part of the engine sleeps."""
        return self._engine.is_sleeping()

    @property
    def sleep_mode(self) -> bool:
        """Whether the engine was started with sleep mode (``enable_sleep_mode``)."""
        return bool(self._engine.config.device.enable_sleep_mode)

    async def update_weights(self, weights: Any, reset_prefix_cache: bool = True) -> int:
        """New values for the model's weights, loaded between two steps (see ``LLMEngine.update_weights``).

        Raises:
            ModelLoadError: weights the model cannot take (nothing written, as ``LLMEngine.update_weights`` says).
            EngineUnavailableError: the engine is not running.
        """
        loop = asyncio.get_running_loop()
        if self._update_lock is None or self._update_lock[0] is not loop:
            self._update_lock = (loop, asyncio.Lock())
        async with self._update_lock[1]:   # updates apply in the order they were asked for
            if isinstance(weights, str | os.PathLike):   # a checkpoint read off the engine's thread
                weights = await asyncio.to_thread(self._engine.checkpoint_weights, weights)
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._submit(_Call(lambda engine: engine.update_weights(weights, reset_prefix_cache), future))
            return await asyncio.wrap_future(future)

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of its latest step (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    def shutdown(self, wait: bool = True, timeout_s: float = 10.0) -> None:
        """Abort every request still running (each gets a final output with finish reason
        ``abort``), stop the loop, and with ``wait`` join it for up to ``timeout_s`` seconds.

        An owned engine is shut down by the loop as it ends; when the loop is still stuck in a
        step after ``timeout_s``, it is shut down from here, which stops its workers (and so
        ends the step with an error)."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine loop did not stop within %.1f s%s", timeout_s,
                               "; stopping the engine's workers" if self._owns_engine else "")
                if self._owns_engine:
                    self._close_engine()
                    self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------- engine thread

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineUnavailableError(f"the engine is not running ({self._dead_reason()})")
            if self._stopping:
                raise EngineUnavailableError("the engine is shutting down")
            self._commands.append(command)
        self._wake.set()

    def _dead_reason(self) -> str:
        """Why the loop stopped: a shutdown, the engine's own failure (its workers'), or the loop's crash."""
        exc = self._dead
        if isinstance(exc, EngineDeadError):
            return str(exc) or "shut down"
        return f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        engine = self._engine
        try:
            if self._platform is not None:
                self._platform.enter_engine_thread()
            while True:
                self._drain_commands()
                if self._stopping:
                    break
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                else:
                    self._stats = self._read_stats()
                    # idle: background work in short pieces (each a few ms) until a command arrives
                    while self._idle_work and not self._wake.is_set():
                        self._idle_work = self._run_idle_work()
                    self._wake.wait()
                    self._wake.clear()
            self._stop_gracefully()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting callers
            logger.exception("the engine loop crashed; failing every in-flight request")
            self._fail_everything(exc)
        finally:
            if self._owns_engine:
                self._close_engine()

    def _run_idle_work(self) -> bool:
        """One piece of the engine's idle work; a failure there is logged and ends the idle work, not the loop."""
        try:
            return bool(self._engine.idle_work())
        except Exception:  # noqa: BLE001 - optional work: serving goes on without it
            logger.exception("the engine's idle work failed; doing no more of it")
            return False

    def _close_engine(self) -> None:
        """Shut the owned engine down (its workers stop); a failure here is logged, not raised."""
        try:
            self._engine.shutdown()
        except Exception:  # noqa: BLE001 - the loop is over either way; keep the reason in the log
            logger.exception("shutting the engine down failed")

    def _drain_commands(self) -> None:
        while self._commands:
            cmd = self._commands[0]   # popped only once handled, so a crash here still fails its caller
            if isinstance(cmd, _Abort):
                if cmd.sink is None or self._sinks.get(cmd.request_id) is cmd.sink:   # (ids: strings, checked)
                    try:
                        self._engine.abort_request(cmd.request_id)
                    except Exception:  # noqa: BLE001 - a bad id is nobody's request; the loop goes on
                        logger.exception("aborting request %r failed", cmd.request_id)
            elif isinstance(cmd, _Add) and cmd.request_id in self._sinks and self._engine.aborted_pending(
                    cmd.request_id):
                return   # an aborted request of that id ends with the next step: its caller gets that end first
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():   # (a caller that gave up cancelled it: not run)
                    try:
                        result = cmd.fn(self._engine)
                    except Exception as exc:  # noqa: BLE001 - the caller gets the error; the loop goes on
                        cmd.future.set_exception(exc)
                    else:
                        cmd.future.set_result(result)
            else:
                try:
                    self._engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                             priority=cmd.priority, lora_request=cmd.lora_request,
                                             cache_salt=cmd.cache_salt, multi_modal_data=cmd.multi_modal_data,
                                             token_type_ids=cmd.token_type_ids)
                except Exception as exc:  # noqa: BLE001 - a rejected request is reported to its caller
                    self._send({cmd.sink.loop: [(cmd.sink.box, exc)]})
                else:
                    self._sinks[cmd.request_id] = cmd.sink
                    self._send({cmd.sink.loop: [(cmd.sink.box, _ACCEPTED)]})
            self._commands.popleft()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, Any]]] = {}
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                failed = getattr(out, "error", None) if out.finished else None   # ended by an error of its own
                by_loop.setdefault(sink.loop, []).append((sink.box, RequestFailedError(failed) if failed else out))
        self._stats = self._read_stats()
        self._send(by_loop)

    @staticmethod
    def _send(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, Any]]]) -> None:
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                logger.debug("an event loop closed before its outputs arrived")

    def _read_stats(self) -> dict[str, Any]:
        return self._engine.stats()

    def _stop_gracefully(self) -> None:
        """Abort whatever is left, report it, and mark the engine stopped."""
        engine = self._engine
        live = list(self._sinks)
        if live:
            logger.info("shutting down: aborting %d unfinished request(s)", len(live))
            engine.abort_request(live)
            self._deliver(engine.step())
        self._fail_everything(EngineDeadError("the engine was shut down"))

    def _fail_everything(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            pending = list(self._commands)
            self._commands.clear()
        # nothing runs, waits or holds the cache any more (the gauges would keep the last step's figures)
        self._stats = {**self._stats, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine failed ({type(exc).__name__}); see the server log")
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, Any]]] = {}
        for sink in self._sinks.values():
            by_loop.setdefault(sink.loop, []).append((sink.box, error))
        refused = EngineUnavailableError(f"the engine stopped before it took the request ({error})")
        for sink in (c.sink for c in pending if isinstance(c, _Add)):   # never taken: refused as a whole
            by_loop.setdefault(sink.loop, []).append((sink.box, refused))
        self._sinks.clear()
        self._send(by_loop)
        for call in (c for c in pending if isinstance(c, _Call)):
            future = call.future   # (pending: not run yet, or running when the loop crashed; not if cancelled)
            if not future.done() and (future.running() or future.set_running_or_notify_cancel()):
                future.set_exception(refused)


def _put_all(items: list[tuple[_Mailbox, Any]]) -> None:
    for box, item in items:
        box.put(item)


class _Delta:
    """Turns a request's cumulative outputs into deltas (``RequestOutputKind.DELTA``): each completion's new text,
    tokens and logprobs since the output handed out before (completions with nothing new are left out; the
    cumulative logprob stays cumulative), the prompt's logprobs in the first output only."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int, bool]] = {}   # index -> (text chars, tokens, finished) handed out
        self._first = True

    def next(self, out: RequestOutput) -> RequestOutput | None:
        """The delta of ``out`` (a cumulative output), or None when it holds nothing new."""
        parts = []
        for c in out.outputs:
            chars, tokens, done = self._sent.get(c.index, (0, 0, False))
            if len(c.text) == chars and len(c.token_ids) == tokens and c.finished == done:
                continue
            parts.append(dataclasses.replace(
                c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                logprobs=c.logprobs[tokens:len(c.token_ids)] if c.logprobs is not None else None))
            self._sent[c.index] = (len(c.text), len(c.token_ids), c.finished)
        if not parts and not out.finished and not self._first:
            return None
        delta = dataclasses.replace(out, outputs=parts,
                                    prompt_logprobs=out.prompt_logprobs if self._first else None)
        self._first = False
        return delta
