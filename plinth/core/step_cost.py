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
        """``(a, b, c)`` in seconds (per step, per prefill token, per decode), or None while the steps seen
        cannot tell them apart (too few, or no spread in prefill sizes) or the fit is not physical."""
        if self._since_fit >= self.refit_every or (self._coef is None and self._since_fit):
            self._since_fit = 0
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self._rows) < self.min_samples:
            return None
        data = np.asarray(self._rows)
        p, d, t = data[:, 0], data[:, 1], data[:, 2]
        if np.ptp(p) == 0:
            return None
        columns = [np.ones_like(p), p] + ([d] if np.ptp(d) > 0 else [])
        coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), t, rcond=None)
        a, b = float(coef[0]), float(coef[1])
        c = float(coef[2]) if len(coef) == 3 else 0.0
        if b <= 0:
            return None
        return max(a, 0.0), b, max(c, 0.0)

    def prefill_allowance(self, decodes: int, target_s: float) -> int | None:
        """The prefill tokens predicted to fit beside ``decodes`` decode sequences in ``target_s`` seconds
        (0 when the decodes alone take longer), or None while the model has no fit."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        return max(0, int((target_s - a - c * decodes) / b))
