"""The records of a selection: one report per candidate, one result per kind.

``SelectionResult.to_dict()`` is plain JSON-able data for the server and ``plinth plugins``;
``summary()`` is the one startup log line of a kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from plinth.errors import SelectionError


@dataclasses.dataclass
class CandidateReport:
    """What selection learned about one candidate.

    ``supported`` is the answer of ``supports`` (False also when it cannot be imported);
    a supported candidate with a non-empty ``reason`` was rejected (wrong results or a failure).
    ``times_ms`` maps a workload step (e.g. ``"prefill"``) to its median time. ``score`` (kinds that
    compare step by step) is the geometric mean over steps of the time relative to the fastest candidate
    at that step (1.0: fastest at every step); the lowest score wins, else the lowest :attr:`total_ms`.
    """

    name: str
    plugin: str
    supported: bool
    reason: str = ""
    max_error: float | None = None
    times_ms: dict[str, float] | None = None
    chosen: bool = False
    score: float | None = None

    @property
    def status(self) -> str:
        if self.chosen:
            return "chosen"
        if not self.supported:
            return "unsupported"
        return "rejected" if self.reason else ("slower" if self.times_ms else "supported")

    @property
    def total_ms(self) -> float | None:
        return sum(self.times_ms.values()) if self.times_ms else None

    @property
    def rank(self) -> float | None:
        """What the candidates are ordered by: :attr:`score` where given, else :attr:`total_ms`."""
        return self.score if self.score is not None else self.total_ms

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status}


@dataclasses.dataclass
class SelectionResult:
    """The outcome of one selection; ``to_dict()`` is what the server exposes."""

    kind: str
    winner: str
    winner_cls: Any
    candidates: list[CandidateReport]
    from_cache: bool
    elapsed_s: float
    how: str = ""  # "forced ...", "benchmark", "cache", "priority (selection off)", "only candidate"

    @property
    def runner_up(self) -> CandidateReport | None:
        timed = [c for c in self.candidates if c.rank is not None and not c.chosen and not c.reason]
        return min(timed, key=lambda c: c.rank) if timed else None

    def report(self, name: str) -> CandidateReport:
        return next(c for c in self.candidates if c.name == name)

    def instantiate(self, *args: Any) -> Any:
        """The winner's instance (``winner_cls(*args)``, see :func:`construct`)."""
        plugin = next((c.plugin for c in self.candidates if c.name == self.winner), None)
        return construct(self.winner_cls, self.kind.replace("_", " "), self.winner, plugin, *args)

    def summary(self) -> str:
        """One log line: winner, runner-up, times."""
        def fmt(c: CandidateReport) -> str:
            times = ", ".join(f"{k} {v:.3g} ms" for k, v in (c.times_ms or {}).items())
            if times and c.score is not None:
                times += f"; score {c.score:.3f}"
            return f"{c.name} ({times})" if times else c.name
        line = f"{self.kind}: {fmt(self.report(self.winner))} [{self.how}]"
        if (ru := self.runner_up) is not None:
            line += f"; runner-up {fmt(ru)}"
        for c in self.rejected:
            line += f"; {c.name} {c.reason}"
        return line + f"; {self.elapsed_s:.2f} s"

    @property
    def rejected(self) -> list[CandidateReport]:
        """Candidates that could run here but failed their check against the reference or crashed."""
        return [c for c in self.candidates if c.reason.startswith("rejected")]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "winner": self.winner, "from_cache": self.from_cache,
            "elapsed_s": self.elapsed_s, "how": self.how,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def construct(cls: Any, label: str, name: str, plugin: str | None, *args: Any) -> Any:
    """``cls(*args)`` for a chosen candidate (a platform, an attention backend, a GEMM kernel); a constructor that
    fails (a plugin's bug) is a SelectionError naming the candidate and its plugin."""
    try:
        return cls(*args)
    except Exception as exc:
        raise SelectionError(f"{label} {name!r} (plugin {plugin!r}) failed to start: {type(exc).__name__}: {exc}") \
            from exc
