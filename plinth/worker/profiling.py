"""Kernel profiles of a window of steps, for finding where a step's device time goes.

``PLINTH_PROFILE_DIR=DIR`` turns it on in every process that runs the model (the engine's, or each
worker of a TP/PP group); ``PLINTH_PROFILE_STEPS=START:COUNT`` (default ``20:20``) picks the steps.
``torch.profiler`` records CPU and device activity over the ``COUNT`` steps from ``START`` (counted in
that process, from its first step), then writes ``DIR/rank{R}-pid{P}.json``: device time per step by
kernel name, busy and idle time per step, and the window's wall time; and a Chrome trace next to it.
The profiler slows the host side: use the per-kernel times, not the wall time, as figures.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from plinth.config import ConfigError

logger = logging.getLogger(__name__)

PROFILE_DIR_ENV = "PLINTH_PROFILE_DIR"
PROFILE_STEPS_ENV = "PLINTH_PROFILE_STEPS"


def _window() -> tuple[int, int]:
    raw = os.environ.get(PROFILE_STEPS_ENV, "20:20")
    try:
        start, count = (int(p) for p in raw.split(":"))
    except ValueError:
        start = count = -1
    if start < 0 or count < 1:
        raise ConfigError(f"{PROFILE_STEPS_ENV}={raw!r}: expected START:COUNT (e.g. 20:20, COUNT >= 1)")
    return start, count


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, 0.0, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class StepProfiler:
    """Call :meth:`before_step` and :meth:`after_step` around every step (or run it inside ``with profiler:``,
    which calls them, the latter also when the step raises); a no-op unless ``PLINTH_PROFILE_DIR`` is set.

    Args:
        rank: this process's rank (names the output file).
        sync: waits for the device (called at the window's ends, so its kernels are inside it).

    Raises:
        ConfigError: ``PLINTH_PROFILE_STEPS`` is malformed.
    """

    def __init__(self, rank: int, sync: Any):
        self.directory = os.environ.get(PROFILE_DIR_ENV) or None
        self.rank = rank
        self._sync = sync
        self._step = 0
        self._prof: Any = None
        self._t0 = 0.0
        self.start, self.count = _window() if self.directory else (0, 0)

    def __enter__(self) -> StepProfiler:
        self.before_step()
        return self

    def __exit__(self, *exc: object) -> None:
        self.after_step()

    def before_step(self) -> None:
        if self.directory is None or self._step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        self._sync()
        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after_step(self) -> None:
        self._step += 1
        if self._prof is None or self._step != self.start + self.count:
            return
        self._sync()
        wall_s = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        try:
            self._write(prof, wall_s)
        except OSError as exc:
            logger.warning("could not write the step profile to %s: %s", self.directory, exc)

    def _write(self, prof: Any, wall_s: float) -> None:
        from torch.autograd import DeviceType

        assert self.directory is not None
        out = Path(self.directory)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"rank{self.rank}-pid{os.getpid()}"
        intervals: list[tuple[float, float]] = []
        by_name: dict[str, list[float]] = {}
        for evt in prof.events():
            if evt.device_type != DeviceType.CUDA:
                continue
            s, e = evt.time_range.start, evt.time_range.end   # us
            intervals.append((s, e))
            entry = by_name.setdefault(evt.name, [0.0, 0])
            entry[0] += e - s
            entry[1] += 1
        n = self.count
        busy = union_us(intervals)
        kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])
        summary = {
            "rank": self.rank, "steps": n, "first_step": self.start,
            "wall_ms_per_step": wall_s * 1e3 / n, "device_busy_ms_per_step": busy / 1e3 / n,
            "device_idle_ms_per_step": (wall_s * 1e6 - busy) / 1e3 / n,
            "kernels": [{"name": name, "ms_per_step": total / 1e3 / n, "calls_per_step": calls / n}
                        for name, (total, calls) in kernels],
        }
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
        prof.export_chrome_trace(str(stem) + ".trace.json")
        logger.info("step profile written to %s.json (device busy %.3f ms per step)", stem,
                    summary["device_busy_ms_per_step"])
