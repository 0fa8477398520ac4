"""Custom logits processors: code of one's own that changes a step's logits before a token is chosen.

A processor is a :class:`LogitsProcessor` subclass installed on the engine (``LLM(model,
logits_processors=[MyProcessor])``, ``plinth serve --logits-processors NAME``). Every step, the sampler hands each
installed processor the logits of the rows it applies to, with what those rows' requests hold so far (prompt and
output token ids, and the request's ``SamplingParams.extra_args``: the server's ``vllm_xargs`` field), and samples
from what the processor returns::

    class NoDigits(LogitsProcessor):
        \"\"\"Bans the tokens listed in a request's extra_args["banned"].\"\"\"

        @classmethod
        def applies_to(cls, params):
            return bool((params.extra_args or {}).get("banned"))

        @classmethod
        def validate_params(cls, params):
            banned = params.extra_args["banned"]
            if not all(isinstance(t, int) for t in banned):
                raise ValueError("banned must be a list of token ids")

        def apply(self, logits, rows):
            for j, row in enumerate(rows):
                logits[j, list(row.extra_args["banned"])] = float("-inf")
            return logits

Where processors run: after the log-probabilities are taken (``logprobs`` report the model's raw distribution, as
vLLM's default) and before everything else the sampler does (structured-output masks, ``allowed_token_ids``,
``bad_words``, ``logit_bias``, ``min_tokens``, penalties, temperature and the filters), in the order they were
installed, on float32 logits. They run where the logits are: in the engine's process, or with worker processes
(tensor/pipeline parallel) in the process that samples, which builds its own instances, so a processor class must be
importable there (a module on the path, not ``__main__``).

Requests that a processor applies to run with synchronous steps (each step's tokens are on the host before the next
step is built), so that ``output_token_ids`` is always current. A request's rows carry its prompt, its tokens so far
and its ``extra_args``; with speculative decoding a step holds one row per verified position, each with the drafts
before it counted as output. Beam search rounds never run custom processors.

Processors are named by a plugin (hook ``plinth_logits_processors``), or given as ``"package.module:Class"`` (or
``"package.module.Class"``) or, from Python, as the class itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from plinth.errors import RequestFailedError, UserFacingError

__all__ = ["LogitsProcessor", "LogitsProcessorError", "ProcessorRow", "resolve_processors"]

logger = logging.getLogger(__name__)


class LogitsProcessorError(UserFacingError, ValueError):
    """A logits processor that cannot be found or is not a :class:`LogitsProcessor`, or one that failed."""


@dataclasses.dataclass(frozen=True)
class ProcessorRow:
    """One row a processor is given: the request (one sample of it, with ``n > 1``) as of this step."""

    request_id: str   # the engine's id of the sequence (``ID#i`` for sample ``i`` of an ``n > 1`` request)
    prompt_token_ids: Sequence[int]   # the request's own lists, read-only (copy them to keep them)
    output_token_ids: Sequence[int]
    extra_args: Mapping[str, Any]


class LogitsProcessor:
    """The base of custom logits processors.

    An instance is made per device the first time the sampler needs it, with the logits' width (``vocab_size``)
    and the ``device``; it lives as long as the engine. Subclasses implement :meth:`apply` and may narrow
    :meth:`applies_to` (default: every request) and check requests with :meth:`validate_params`.

    :meth:`apply` should be a function of its rows: after a call that raised, the sampler calls it again one row at a
    time (to find the rows it fails on), and nothing tells a processor that a request ended, so state kept per
    request (by ``request_id``) is the processor's to bound.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def applies_to(cls, params: Any) -> bool:
        """Whether this processor acts on requests with these ``SamplingParams`` (asked once, when the request
        arrives; the rows it does not apply to are never given to :meth:`apply`)."""
        return True

    @classmethod
    def validate_params(cls, params: Any) -> None:
        """Check a request's ``SamplingParams`` when it arrives (only for requests :meth:`applies_to` accepts).

        Raises:
            ValueError: the request cannot be served; the message reaches the caller (a server's client gets it
                as a 400 naming ``vllm_xargs``).
        """

    def apply(self, logits: torch.Tensor, rows: Sequence[ProcessorRow]) -> torch.Tensor:
        """The processed logits: ``logits`` is float32 ``[len(rows), vocab_size]``, ``logits[j]`` the row of
        ``rows[j]``; change it in place and return it, or return a new tensor of the same shape."""
        raise NotImplementedError


def resolve_processors(specs: Sequence[Any]) -> tuple[type[LogitsProcessor], ...]:
    """The classes that ``specs`` name: a class, a name a plugin registered, ``"package.module:Class"`` or
    ``"package.module.Class"``.

    Raises:
        LogitsProcessorError: a name that is not registered, a reference that does not import, or something that
            is not a :class:`LogitsProcessor` subclass.
    """
    return tuple(_resolve(spec) for spec in specs)


def _resolve(spec: Any) -> type[LogitsProcessor]:
    from plinth.plugins import PluginError, get_plugin_manager, resolve_ref

    where = ""
    found = spec
    if isinstance(spec, str):
        registered = get_plugin_manager().registrations("logits_processors")
        try:
            if spec in registered:
                where = f" (registered by plugin {registered[spec].plugin!r} as {registered[spec].ref})"
                found = registered[spec].load()
            elif ":" in spec or "." in spec:
                module, _, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
                found = resolve_ref(f"{module}:{attr}")
            else:
                raise LogitsProcessorError(f"logits processor {spec!r} is not registered (registered: "
                                           f"{', '.join(sorted(registered)) or 'none'}); give a name a plugin "
                                           "registers or 'package.module:Class'")
        except PluginError as exc:
            raise LogitsProcessorError(f"logits processor {spec!r}: {exc}") from None
    if not (isinstance(found, type) and issubclass(found, LogitsProcessor)):
        raise LogitsProcessorError(f"logits processor {spec!r}{where} is not a subclass of "
                                   f"plinth.core.logits_processors.LogitsProcessor (got {found!r})")
    return found


def check_request(processors: Sequence[type[LogitsProcessor]], params: Any) -> tuple[bool, ...]:
    """Which processors apply to a request (:meth:`~LogitsProcessor.applies_to`; none to the engine's own rounds
    that mark their parameters ``_no_logits_processors``, such as beam search's), each of those having checked it
    (:meth:`~LogitsProcessor.validate_params`).

    Raises:
        ValueError: from ``validate_params`` (refusing the request).
        RequestFailedError: a processor's own failure (any other exception, or any from ``applies_to``), named.
    """
    if getattr(params, "_no_logits_processors", False):
        return (False,) * len(processors)
    applies = []
    for cls in processors:
        try:
            wanted = bool(cls.applies_to(params))
        except Exception as exc:   # the processor's bug: the request fails, the engine lives on
            raise _failure(cls, exc) from exc
        if wanted:
            try:
                cls.validate_params(params)
            except ValueError:
                raise
            except Exception as exc:
                raise _failure(cls, exc) from exc
        applies.append(wanted)
    return tuple(applies)


def _failure(cls: type[LogitsProcessor], exc: Exception) -> RequestFailedError:
    logger.error("logits processor %s failed on a request's parameters", cls.__qualname__, exc_info=exc)
    return RequestFailedError(f"logits processor {cls.__qualname__} failed on this request: "
                              f"{type(exc).__name__}: {exc}")


class ProcessorSet:
    """The sampler's instances of the installed processors, one per device and logits width, made on first use."""

    def __init__(self, classes: Sequence[type[LogitsProcessor]]):
        self.classes = tuple(classes)
        self._instances: dict[tuple[torch.device, int, int], LogitsProcessor] = {}

    def apply(self, logits: torch.Tensor, groups: Sequence[tuple[tuple[int, ...], tuple[ProcessorRow, ...]]]
              ) -> dict[int, str]:
        """Run every processor on ``logits`` (float32 ``[B, V]``, changed in place): ``groups[k]`` gives processor
        ``k``'s row indices and rows (an empty group skips it).

        Returns the rows a processor failed on, each with what failed (the engine ends their requests with it; the
        traceback goes to the log): a processor that cannot be made fails all its rows; one whose ``apply`` raises
        or returns something else than a tensor of its rows' shape is called again one row at a time, and fails
        the rows it fails on alone; a row it returns with a NaN, a +inf or no finite logit fails.
        """
        failed: dict[int, str] = {}
        for k, (index, rows) in enumerate(groups):
            if not index:
                continue
            name = self.classes[k].__qualname__
            try:
                proc = self._instance(k, logits)
            except Exception as exc:   # its constructor's bug: its rows fail, the engine lives on
                logger.exception("logits processor %s could not be made", name)
                failed.update(dict.fromkeys(index, f"logits processor {name} could not be made: "
                                                   f"{type(exc).__name__}: {exc}"))
                continue
            whole = len(index) == logits.shape[0]   # (indices are increasing: every row, in order)
            out, error = _call(proc, logits.clone() if whole else logits[list(index)], rows)
            if out is None and len(index) > 1:   # which rows does it fail on? (others' requests go on)
                parts = [_call(proc, logits[i:i + 1].clone(), rows[j:j + 1]) for j, i in enumerate(index)]
                failed.update({i: f"logits processor {name} failed: {e}" for i, (_, e) in zip(index, parts,
                                                                                              strict=True) if e})
                kept = [(i, o) for i, (o, _) in zip(index, parts, strict=True) if o is not None]
                index = tuple(i for i, _ in kept)
                out = torch.cat([o for _, o in kept]) if kept else None
            elif out is None:
                failed[index[0]] = f"logits processor {name} failed: {error}"
            if out is None:
                continue
            bad = (torch.isnan(out).any(dim=1) | torch.isposinf(out).any(dim=1)
                   | torch.isneginf(out).all(dim=1)).nonzero().flatten().tolist()
            for j in bad:
                failed.setdefault(index[j], f"logits processor {name} failed: apply returned a row with a NaN, a "
                                            "+inf or no finite logit")
            if bad:   # those rows keep their logits (the next processors and the sampler see no NaN)
                keep = [j for j in range(len(index)) if j not in set(bad)]
                index, out = tuple(index[j] for j in keep), out[keep]
            if len(index) == logits.shape[0]:
                logits.copy_(out)
            elif index:
                logits[list(index)] = out
        return failed

    def _instance(self, k: int, logits: torch.Tensor) -> LogitsProcessor:
        key = (logits.device, logits.shape[1], k)
        proc = self._instances.get(key)
        if proc is None:
            proc = self._instances[key] = self.classes[k](vocab_size=logits.shape[1], device=logits.device)
        return proc


def _call(proc: LogitsProcessor, part: torch.Tensor, rows: Sequence[ProcessorRow]
          ) -> tuple[torch.Tensor | None, str | None]:
    """``proc.apply(part, rows)`` as float32 on ``part``'s device, or ``(None, what failed)`` (logged)."""
    try:
        out = proc.apply(part, rows)
        if not isinstance(out, torch.Tensor) or out.shape != part.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise LogitsProcessorError(f"apply returned {got}, not a tensor of shape {tuple(part.shape)}")
        return out.to(part.device, part.dtype), None
    except Exception as exc:   # the processor's bug ends its own rows' requests, not the engine
        logger.exception("logits processor %s failed on %d row(s)", type(proc).__qualname__, len(rows))
        return None, f"{type(exc).__name__}: {exc}"
