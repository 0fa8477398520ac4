"""The records of a selection: one report per candidate, one result per kind.

``SelectionResult.to_dict()`` is plain JSON-able data for the server and ``plinth plugins``;
``summary()`` is the one startup log line of a kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class CandidateReport:
    """What selection learned about one candidate.

    ``supported`` is the answer of ``supports`` (False also when it cannot be imported);
    a supported candidate with a non-empty ``reason`` was rejected (wrong results or a failure).
    ``times_ms`` maps a workload step (e.g. ``"prefill"``) to its median time; ``weights`` (when the
    kind gives them) scale each step's time in :attr:`total_ms`, the score the fastest candidate wins on.
    """

    name: str
    plugin: str
    supported: bool
    reason: str = ""
    max_error: float | None = None
    times_ms: dict[str, float] | None = None
    chosen: bool = False
    weights: dict[str, float] | None = None

    @property
    def status(self) -> str:
        if self.chosen:
            return "chosen"
        if not self.supported:
            return "unsupported"
        return "rejected" if self.reason else ("slower" if self.times_ms else "supported")

    @property
    def total_ms(self) -> float | None:
        if not self.times_ms:
            return None
        weights = self.weights or {}
        return sum(t * weights.get(label, 1.0) for label, t in self.times_ms.items())

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
        timed = [c for c in self.candidates if c.total_ms is not None and not c.chosen and not c.reason]
        return min(timed, key=lambda c: c.total_ms) if timed else None

    def report(self, name: str) -> CandidateReport:
        return next(c for c in self.candidates if c.name == name)

    def summary(self) -> str:
        """One log line: winner, runner-up, times."""
        def fmt(c: CandidateReport) -> str:
            times = ", ".join(f"{k} {v:.3g} ms" for k, v in (c.times_ms or {}).items())
            return f"{c.name} ({times})" if times else c.name
        line = f"{self.kind}: {fmt(self.report(self.winner))} [{self.how}]"
        if (ru := self.runner_up) is not None:
            line += f"; runner-up {fmt(ru)}"
        return line + f"; {self.elapsed_s:.2f} s"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "winner": self.winner, "from_cache": self.from_cache,
            "elapsed_s": self.elapsed_s, "how": self.how,
            "candidates": [c.to_dict() for c in self.candidates],
        }
