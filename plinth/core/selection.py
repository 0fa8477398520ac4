"""Startup selection: pick the fastest correct candidate of each kind; remember the choice.

For one kind (attention backend now; a quantization method's GEMM kernel later):

1. the candidates are the plugin registrations of that kind, resolved lazily; one whose
   reference cannot be imported is unsupported, with the import error as its reason;
2. each is asked ``supports(...)``; every "no" keeps its reason;
3. with more than one left, each is checked against the kind's reference on small random
   inputs (an error above the dtype's tolerance rejects it, with the error figure) and then
   timed on the model's shapes (warm-up, device synchronisation, median of several runs);
   the fastest wins: the lowest sum of step times, or, for kinds with ``relative_steps``, the
   lowest geometric mean over steps of the time relative to the fastest candidate at that step
   (so that each step counts alike however long it takes);
4. the outcome is stored under ``plinth.config.cache_dir() / "selection"``, keyed by device,
   platform, torch/triton/plugin versions, dtype and shapes, so a later start with the same
   key reads it and times nothing (unless a candidate it found unsupported, or that raised then, runs now:
   what a candidate supports can depend on the moment, e.g. native kernels turned off for one run; see
   :func:`_untimed_now`). Modes (``DeviceConfig.selection``): ``cached`` (time on a cache miss),
   ``benchmark`` (always time), ``off`` (the highest-priority supported one);
5. a forced choice is validated: unknown or unsupported names are a :class:`SelectionError`.

What differs between kinds (how to ask ``supports``, how to check, how to time, what the key
holds) is a :class:`CandidateKind`; the algorithm here is shared.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from plinth.attention_backends import probe
from plinth.attention_backends.interface import AttentionBackend, AttentionSpec, Support
from plinth.attention_backends.probe import AttentionWorkload
from plinth.config import DeviceConfig
from plinth.core.selection_cache import SelectionCache, base_key
from plinth.core.selection_records import CandidateReport, SelectionResult
from plinth.errors import SelectionError
from plinth.plugins import PluginError, PluginManager, Registration, get_plugin_manager

__all__ = [
    "ATTENTION_ENV", "AttentionCandidates", "AttentionWorkload", "CandidateKind", "CandidateReport",
    "SelectionResult", "describe_platform", "select", "select_attention_backend",
]

logger = logging.getLogger(__name__)

#: untimed runs of every step before the timed ones, then timed runs whose median is kept
WARMUP_RUNS = 2
TIMED_RUNS = 5


class CandidateKind(Protocol):
    """What selection needs to know about one kind of candidate."""

    #: label used in logs, errors and cache file names, e.g. ``"attention_backend"``
    kind: str
    #: the candidate every other one is checked against (None: no correctness check)
    reference: str | None

    def validate(self, obj: Any) -> str:
        """Return ``""`` if a resolved registration is a usable class, else why not."""

    def supports(self, cls: Any) -> Support:
        """Ask the candidate whether it can run the model's shapes on this device."""

    def max_error(self, cls: Any, reference_cls: Any) -> float:
        """The candidate's error against the reference on small random inputs."""

    def tolerance(self) -> float:
        """The largest acceptable :meth:`max_error` for the model's dtype."""

    def step_runners(self, cls: Any) -> dict[str, Callable[[], float | None]]:
        """One callable per workload step (e.g. ``"prefill"``, ``"decode"``) on the model's real
        shapes; each call runs the step once. The selection loop times them by the host clock, unless
        a call returns its own measurement in milliseconds (e.g. device time from events)."""

    # Optional: ``relative_steps = True``: rank by the geometric mean relative time per step (module docstring).

    def synchronize(self) -> None:
        """Wait for the device (called around every timed run)."""

    def key(self) -> dict[str, Any]:
        """The kind's part of the cache key (dtype, shapes, workload); JSON-serialisable."""


def _resolve(kind: CandidateKind, reg: Registration) -> tuple[Any, CandidateReport]:
    report = CandidateReport(reg.name, reg.plugin, supported=False)
    try:
        cls = reg.load()
    except PluginError as exc:
        report.reason = f"unsupported: {exc}"
        return None, report
    if problem := kind.validate(cls):
        report.reason = problem
        return None, report
    priority = getattr(cls, "priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        report.reason = f"unsupported: {reg.ref} has priority {priority!r}, not an integer"
        return None, report
    try:
        support = kind.supports(cls)
    except Exception as exc:  # supports() must not raise; the plugin bug becomes the reason
        report.reason = f"supports() raised {type(exc).__name__}: {exc}"
        return None, report
    if not isinstance(support, Support):
        report.reason = f"supports() returned {support!r}, not a Support"
        return None, report
    report.supported = bool(support)
    report.reason = "" if support else (support.reason or "unsupported (no reason given)")
    return cls, report


def _label(kind: CandidateKind) -> str:
    return kind.kind.replace("_", " ")


def _by_priority(classes: Mapping[str, Any]) -> str:
    order = list(classes)
    return max(order, key=lambda n: (getattr(classes[n], "priority", 0), -order.index(n)))


def select(
    kind: CandidateKind,
    registrations: Mapping[str, Registration],
    *,
    mode: str,
    platform: Any,
    pm: PluginManager,
    forced: str | None = None,
    forced_source: str = "forced",
    cache_dir: Path | None = None,
    reference_registrations: Mapping[str, Registration] | None = None,
) -> SelectionResult:
    """Choose one of ``registrations`` (see the module docstring).

    ``reference_registrations`` is where the reference is looked up when it is not itself a
    candidate (default: ``registrations``).

    Raises:
        SelectionError: the forced name is unknown (the message lists the known ones) or
            unsupported (with its reason); or no candidate can run.
    """
    start = time.perf_counter()
    if forced:
        if forced not in registrations:
            raise SelectionError(f"unknown {_label(kind)} {forced!r} ({forced_source}); known: "
                                 f"{', '.join(registrations) or 'none'}")
        cls, report = _resolve(kind, registrations[forced])
        if cls is None or not report.supported:
            raise SelectionError(f"{_label(kind)} {forced!r} ({forced_source}) cannot run here: {report.reason}")
        report.chosen = True
        return _done(SelectionResult(kind.kind, forced, cls, [report], False, 0.0, f"forced, {forced_source}"),
                     start)

    resolved = {name: _resolve(kind, reg) for name, reg in registrations.items()}
    reports = [r for _cls, r in resolved.values()]
    usable = {name: cls for name, (cls, r) in resolved.items() if r.supported}
    if not usable:
        reasons = "; ".join(f"{r.name}: {r.reason}" for r in reports) or "no candidates are registered"
        raise SelectionError(f"no {_label(kind)} can run here: {reasons}")
    if len(usable) == 1 or mode == "off":
        winner = _by_priority(usable)
        how = "only candidate" if len(usable) == 1 else "priority (selection off)"
        return _finish(kind, winner, usable, reports, False, how, start)

    cache = SelectionCache(cache_dir, kind.kind, {
        **base_key(platform, pm, registrations), **kind.key()})
    untimed: list[str] = []
    if mode == "cached":
        hit = cache.read()
        cached = _cached_reports(hit)
        if cached is not None:
            retried = hit.get("failed_again") if isinstance(hit.get("failed_again"), list) else []
            untimed = [name for name in _untimed_now(cached, usable) if name not in retried]
        if hit is not None and cached is not None and hit.get("winner") in usable and not untimed:
            return _finish(kind, hit["winner"], usable, cached, True, "cache", start)
        if untimed:
            logger.info("cached %s choice %r was made without %s (unsupported or failing then); timing again",
                        _label(kind), hit.get("winner"), ", ".join(untimed))
        elif hit is not None:
            logger.info("cached %s choice %r is unusable; timing again", _label(kind), hit.get("winner"))
    winner = _benchmark(kind, reference_registrations or registrations, usable, reports)
    result = _finish(kind, winner, usable, reports, False, "benchmark", start)
    # a candidate timed again because it raised before, and raising again, is not timed a third time: the
    # record is trusted (a candidate that always fails must not turn the record off)
    failed_again = [r.name for r in reports if r.name in untimed and r.reason.startswith(_FAILED)]
    cache.write({"winner": winner, "candidates": [dataclasses.asdict(r) for r in reports],
                 "failed_again": failed_again})
    return result


#: how the report of a candidate that raised begins
_FAILED = "rejected: failed"


def _untimed_now(cached: list[CandidateReport], usable: Mapping[str, Any]) -> list[str]:
    """The candidates that can run now but that a cache record found unsupported (or does not name), or that
    raised while it checked or timed them: its choice was made without them. What a candidate supports, and
    whether it runs, can depend on the moment (an environment variable that turns native kernels off, a
    compiler that failed once, memory another process held), so such a record is not trusted. (A candidate
    rejected for its error against the reference stays rejected.)"""
    timed_then = {r.name for r in cached if r.supported and not r.reason.startswith(_FAILED)}
    return [name for name in usable if name not in timed_then]


def _cached_reports(record: dict[str, Any] | None) -> list[CandidateReport] | None:
    """A cache record's candidate reports; ``None`` (and a warning) for a record of another format, or one edited
    by hand or damaged, whose fields are not what this version writes or whose winner is not among them."""
    if record is None:
        return None
    try:
        fields = {f.name for f in dataclasses.fields(CandidateReport)}
        # fields a record of another plinth version carries and this one does not know are dropped
        reports = [CandidateReport(**{k: v for k, v in r.items() if k in fields}) for r in record["candidates"]]
        problem = next((p for p in map(_report_problem, reports) if p), None)
        if problem is None and record.get("winner") not in {r.name for r in reports}:
            problem = f"its winner {record.get('winner')!r} is not among its candidates"
    except (KeyError, TypeError, AttributeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        logger.warning("ignoring malformed selection record: %s", problem)
        return None
    return reports


def _report_problem(report: CandidateReport) -> str | None:
    """What is wrong with a report read from a cache record (``None``: nothing)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    wrong = [name for name, ok in (
        ("name", isinstance(report.name, str)), ("plugin", isinstance(report.plugin, str)),
        ("supported", isinstance(report.supported, bool)), ("reason", isinstance(report.reason, str)),
        ("max_error", report.max_error is None or number(report.max_error)),
        ("times_ms", report.times_ms is None or (isinstance(report.times_ms, dict)
                                                 and all(number(v) for v in report.times_ms.values()))),
        ("chosen", isinstance(report.chosen, bool)), ("score", report.score is None or number(report.score)),
    ) if not ok]
    return f"candidate {report.name!r} has a malformed {', '.join(wrong)}" if wrong else None


def _benchmark(kind: CandidateKind, all_registrations: Mapping[str, Registration], usable: dict[str, Any],
               reports: list[CandidateReport]) -> str:
    """Check then time every usable candidate; fill their reports; return the fastest correct one."""
    by_name = {r.name: r for r in reports}
    ref_cls = usable.get(kind.reference) if kind.reference else None
    if kind.reference and ref_cls is None and kind.reference in all_registrations:
        ref_cls, ref_report = _resolve(kind, all_registrations[kind.reference])
        ref_cls = ref_cls if ref_report.supported else None  # a reference outside the candidates
    if kind.reference and ref_cls is None:
        logger.warning("reference %s %r cannot run; candidates are timed without a correctness check",
                       kind.kind, kind.reference)
    tol = kind.tolerance()
    runners: dict[str, dict[str, Callable[[], float | None]]] = {}
    for name, cls in usable.items():
        report = by_name[name]
        try:
            if ref_cls is not None and cls is not ref_cls:
                report.max_error = err = kind.max_error(cls, ref_cls)
                if not err <= tol:  # NaN fails too
                    report.reason = f"rejected: max error {err:.3g} exceeds tolerance {tol:.3g} vs {kind.reference}"
                    continue
            elif ref_cls is not None:
                report.max_error = 0.0
            runners[name] = kind.step_runners(cls)
        except Exception as exc:  # a crashing candidate loses; the others still compete
            report.reason = f"{_FAILED} its check: {type(exc).__name__}: {exc}"
    for name, times in _time_interleaved(kind, runners).items():
        if isinstance(times, str):
            by_name[name].reason = times
        else:
            by_name[name].times_ms = times
    timed = [r for r in reports if r.name in usable and r.times_ms and not r.reason]
    if not timed:
        reasons = "; ".join(f"{r.name}: {r.reason or 'no steps timed'}" for r in reports if r.name in usable)
        raise SelectionError(f"every {_label(kind)} failed its check: {reasons}")
    if getattr(kind, "relative_steps", False):
        _relative_scores(timed)
    return min(timed, key=lambda r: r.rank).name


def _relative_scores(timed: list[CandidateReport]) -> None:
    """Each report's score: the geometric mean over the steps every candidate ran of its time over the
    fastest time at that step (1.0: fastest everywhere). Geometric, so that the order of two candidates
    does not depend on a third one's times."""
    labels = [label for label in timed[0].times_ms if all(label in r.times_ms for r in timed)]
    best = {label: max(min(r.times_ms[label] for r in timed), 1e-9) for label in labels}
    for r in timed:
        r.score = math.exp(statistics.fmean(math.log(max(r.times_ms[label], 1e-9) / best[label])
                                            for label in labels)) if labels else None


def _time_interleaved(kind: CandidateKind, runners: dict[str, dict[str, Callable[[], float | None]]],
                      warmup: int = WARMUP_RUNS, repeats: int = TIMED_RUNS) -> dict[str, dict[str, float] | str]:
    """Median milliseconds per candidate and step; candidates take turns, so that load from
    other processes slows all of them alike. A candidate that raises gets the error text."""
    samples: dict[str, dict[str, list[float]]] = {n: {label: [] for label in r} for n, r in runners.items()}
    failed: dict[str, str] = {}
    for i in range(warmup + repeats):
        for name, steps in runners.items():
            if name in failed:
                continue
            for label, run in steps.items():
                try:
                    kind.synchronize()
                    start = time.perf_counter()
                    measured = run()
                    kind.synchronize()
                except Exception as exc:  # a crashing candidate loses; the others still compete
                    failed[name] = f"{_FAILED} while timing {label}: {type(exc).__name__}: {exc}"
                    break
                if i >= warmup:
                    wall = (time.perf_counter() - start) * 1e3
                    samples[name][label].append(measured if isinstance(measured, float) else wall)
    return {n: failed.get(n) or {label: statistics.median(v) for label, v in s.items()} for n, s in samples.items()}


def _finish(kind: CandidateKind, winner: str, usable: dict[str, Any], reports: list[CandidateReport],
            from_cache: bool, how: str, start: float) -> SelectionResult:
    for r in reports:
        r.chosen = r.name == winner
    return _done(SelectionResult(kind.kind, winner, usable[winner], reports, from_cache, 0.0, how), start)


def _done(result: SelectionResult, start: float) -> SelectionResult:
    result.elapsed_s = time.perf_counter() - start
    # a candidate that fails its check is a broken kernel or backend: its author needs to see why
    logger.log(logging.WARNING if result.rejected and not result.from_cache else logging.INFO, "%s", result.summary())
    return result


def restrict(registrations: Mapping[str, Registration], names: Collection[str] | None,
             kind: str) -> dict[str, Registration]:
    """Keep only ``names`` (all when None). Raises SelectionError for an unknown name."""
    if names is None:
        return dict(registrations)
    unknown = [n for n in names if n not in registrations]
    if unknown:
        raise SelectionError(f"unknown {kind.replace('_', ' ')} {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(registrations)}")
    return {n: r for n, r in registrations.items() if n in names}


# -- attention backends ---------------------------------------------------------------------

ATTENTION_ENV = "PLINTH_ATTENTION_BACKEND"
ATTENTION_REFERENCE = "torch_sdpa"
#: largest accepted error against the reference (relative to the output's magnitude when > 1);
#: float32 leaves room for TF32 matmuls, half types for a few units in the last place
ATTENTION_TOLERANCE = {
    torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2,
}


@dataclasses.dataclass
class AttentionCandidates:
    """The attention-backend :class:`CandidateKind` for one model's :class:`AttentionSpec`."""

    spec: AttentionSpec
    platform: Any  # plinth.platforms.interface.Platform
    workload: AttentionWorkload = dataclasses.field(default_factory=AttentionWorkload)
    kind: str = "attention_backend"
    reference: str | None = ATTENTION_REFERENCE
    _reference_out: tuple[Any, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    def validate(self, obj: Any) -> str:
        if isinstance(obj, type) and issubclass(obj, AttentionBackend):
            return ""
        return f"unsupported: {obj!r} is not a subclass of plinth.attention_backends.interface.AttentionBackend"

    def supports(self, cls: Any) -> Support:
        return cls.check(self.spec, self.platform.device_type)

    def max_error(self, cls: Any, reference_cls: Any) -> float:
        if self._reference_out is None or self._reference_out[0] is not reference_cls:
            self._reference_out = (reference_cls, probe.run_steps(reference_cls, self.spec, self.platform.device()))
        return probe.max_error(cls, self._reference_out[1], self.spec, self.platform.device())

    def tolerance(self) -> float:
        return ATTENTION_TOLERANCE.get(self.spec.dtype, 5e-2)

    def step_runners(self, cls: Any) -> dict[str, Callable[[], None]]:
        return probe.step_runners(cls, self.spec, self.workload, self.platform.device())

    def synchronize(self) -> None:
        self.platform.synchronize()

    def key(self) -> dict[str, Any]:
        spec = {f.name: getattr(self.spec, f.name) for f in dataclasses.fields(self.spec)}
        spec["dtype"] = str(self.spec.dtype).removeprefix("torch.")
        spec["kv_cache_dtype"] = str(self.spec.cache_dtype).removeprefix("torch.")
        return {"dtype": spec["dtype"], "spec": spec, "workload": dataclasses.asdict(self.workload)}


def select_attention_backend(
    spec: AttentionSpec,
    platform: Any,
    device_config: DeviceConfig,
    *,
    pm: PluginManager | None = None,
    cache_dir: Path | str | None = None,
    workload: AttentionWorkload | None = None,
    candidates: Collection[str] | None = None,
) -> SelectionResult:
    """Choose the attention backend for ``spec`` on ``platform``.

    Args:
        spec: the model's attention shapes and dtype.
        platform: the selected :class:`~plinth.platforms.interface.Platform` instance.
        device_config: ``attention_backend`` forces a backend (else ``$PLINTH_ATTENTION_BACKEND``);
            ``selection`` is the mode (``cached``, ``benchmark`` or ``off``).
        pm: the plugin manager (default: the process-wide one).
        cache_dir: where selection records live (default: ``plinth.config.cache_dir() / "selection"``).
        workload: the shapes to time (default: :class:`AttentionWorkload()`; an engine passes
            ``AttentionWorkload.for_engine(...)``); part of the cache key.
        candidates: consider only these backend names (default: every registered one); the
            reference is still used for the correctness check.

    Returns:
        The :class:`SelectionResult`; ``winner_cls`` is the backend class to instantiate.

    Raises:
        SelectionError: a forced or listed backend is unknown or cannot run, or none can.
    """
    pm = pm if pm is not None else get_plugin_manager()
    forced, source = device_config.attention_backend, "--attention-backend"
    if not forced:
        forced, source = os.environ.get(ATTENTION_ENV, "").strip() or None, f"set by {ATTENTION_ENV}"
    regs = pm.registrations("attention_backends")
    kind = AttentionCandidates(spec, platform, workload or AttentionWorkload())
    return select(
        kind, regs if forced else restrict(regs, candidates, kind.kind), mode=device_config.selection,
        platform=platform, pm=pm, forced=forced, forced_source=source,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        reference_registrations=regs,
    )


# -- platforms (chosen by priority in plinth.platforms.selection; reported the same way) -------


def describe_platform(platform: Any, pm: PluginManager | None = None) -> SelectionResult:
    """The platform choice as a :class:`SelectionResult`, for the startup log and reports."""
    from plinth.platforms.selection import platform_report

    reports = [
        CandidateReport(s.name, s.plugin, supported=s.available, reason=s.reason, chosen=s.name == platform.name)
        for s in platform_report(pm if pm is not None else get_plugin_manager())
    ]
    result = SelectionResult("platform", platform.name, type(platform), reports, False, 0.0,
                             f"priority {platform.priority}, device {platform.device_name()}")
    logger.info("%s", result.summary())
    return result
