"""How long an engine step takes, fitted online: what bounds prefill chunks under an ITL target.

A step's wall time is close to ``a + b * prefill_tokens + c * decodes`` for one model on one machine
(the GEMMs grow with the rows, attention with the sequences). :class:`StepCostModel` fits ``a, b, c``
by least squares over the last steps and says how many prefill tokens fit next to a given number of
decodes in a time budget. The scheduler asks it when sequences are decoding, so that new prompts are
prefilled in chunks that do not stall the running streams (``SchedulerConfig.itl_target_ms``).
"""

from __future__ import annotations

import collections

import numpy as np


class StepCostModel:
    """Least-squares step time ``a + b * prefill_tokens + c * decodes`` over the last ``window`` steps.

    Args:
        window: steps kept for the fit.
        min_samples: steps needed before the model answers.
        refit_every: observations between two fits.
    """

    def __init__(self, window: int = 128, min_samples: int = 8, refit_every: int = 4):
        self._rows: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=window)
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._since_fit = 0
        self._coef: tuple[float, float, float] | None = None

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """Record one step: its prefill tokens, its decode sequences and its wall time."""
        if seconds > 0 and prefill_tokens + decodes > 0:
            self._rows.append((float(prefill_tokens), float(decodes), float(seconds)))
            self._since_fit += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` in seconds (per step, per prefill token, per decode), or None until the steps seen
        tell them apart (enough of them, with a spread of prefill sizes). A refit that cannot (a window of
        decode-only steps, say) keeps the last good fit."""
        if self._since_fit >= self.refit_every or (self._coef is None and self._since_fit):
            self._since_fit = 0
            self._coef = self._fit() or self._coef
        return self._coef

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self._rows) < self.min_samples:
            return None
        data = np.asarray(self._rows)
        if not np.isfinite(data).all() or np.ptp(data[:, 0]) == 0:
            return None
        keep = np.ones(len(data), dtype=bool)
        for _ in range(2):   # fit, drop the outliers (a step that compiled or was preempted by the OS), refit
            coef = _nonnegative_fit(data[keep])
            if coef is None:
                return None
            a, b, c = coef
            resid = data[:, 2] - (a + b * data[:, 0] + c * data[:, 1])
            spread = np.median(np.abs(resid[keep] - np.median(resid[keep])))
            inliers = np.abs(resid) <= 4 * spread + 1e-4 * np.median(data[:, 2])
            if inliers.sum() < self.min_samples or (inliers == keep).all() or np.ptp(data[inliers, 0]) == 0:
                break
            keep = inliers
        return coef

    def prefill_allowance(self, decodes: int, target_s: float) -> int | None:
        """The prefill tokens predicted to fit beside ``decodes`` decode sequences in ``target_s`` seconds
        (0 when the decodes alone take longer), or None while the model has no fit."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        return max(0, int((target_s - a - c * decodes) / b))


def _nonnegative_fit(data: np.ndarray) -> tuple[float, float, float] | None:
    """Least squares of ``t = a + b p + c d`` with ``a, c >= 0`` and ``b > 0`` (a negative term is dropped and
    the rest refitted; ``b`` must stay), or None. ``data`` rows are ``(p, d, t)``."""
    p, d, t = data[:, 0], data[:, 1], data[:, 2]
    terms = {"a": np.ones_like(p), "b": p, "c": d}
    if np.ptp(d) == 0:
        terms.pop("c")
    while True:
        names = list(terms)
        sol, *_ = np.linalg.lstsq(np.stack([terms[n] for n in names], axis=1), t, rcond=None)
        fitted = dict(zip(names, (float(v) for v in sol), strict=True))
        if not all(np.isfinite(v) for v in fitted.values()):
            return None
        negative = [n for n in ("a", "c") if n in fitted and fitted[n] < 0]
        if negative:
            terms.pop(negative[0])
            continue
        if fitted["b"] <= 1e-9:
            return None
        return fitted.get("a", 0.0), fitted["b"], fitted.get("c", 0.0)
