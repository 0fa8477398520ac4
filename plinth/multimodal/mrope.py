"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the rotary positions of a prompt with images.

Text tokens count one position each, as usual. An image's tokens (its merged patches, in rows) sit at three-component
positions (time, height, width) that all start where the text before them ends: ``(p, p + row, p + column)``; a
video's frame groups add their time to the first component. The text after an image or video resumes one past its
largest position component (``p + max(rows, columns)`` for an image), as the Qwen2-VL reference code, transformers
before 5.3 and vLLM place it (transformers 5.3 and later resume at ``p + max(rows, columns)`` after a video too, which
differs where a video's times pass its rows and columns), so it sits at fewer positions than the image has tokens:
from there on each token's rotary position is its index plus a *shift* (negative). Generated tokens take the last
shift. Text positions have three equal components, so they rotate as a plain RoPE does at the shifted position;
only image rows need the three components (:meth:`~plinth.model_registry.layers.rotary.RotaryEmbedding.cos_sin_3d`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class RopeLayout:
    """Where a sequence's rotary positions depart from its indices: from index ``starts[i]`` on, each token's
    position is its index plus ``values[i]`` (``starts[0] == 0``, increasing)."""

    starts: np.ndarray   # [S] int64
    values: np.ndarray   # [S] int64

    def shifts(self, start: int, count: int) -> np.ndarray:
        """``[count]`` int64: the shifts of indices ``[start, start + count)``."""
        if start >= self.starts[-1]:   # past the last image (decode steps): its shift throughout
            return np.full(count, self.values[-1], dtype=np.int64)
        idx = np.arange(start, start + count, dtype=np.int64)
        return self.values[np.searchsorted(self.starts, idx, side="right") - 1]


def image_positions(first: int, grid: tuple[int, int, int], merge: int,
                    time_scale: tuple[float, float] | None = None) -> np.ndarray:
    """``[t * (h / merge) * (w / merge), 3]`` int64: the positions of an image's tokens (time-major, then rows, then
    columns of merged patches) whose first sits at ``first``; ``grid`` is its (t, h, w) in patches. Frame group ``i``
    sits at time ``i``, or with ``time_scale`` ``(seconds a group, positions a second)`` (Qwen2.5-VL's videos) at
    ``int(i * seconds * positions)``, computed in float32 in that order, as the reference code does."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    times = np.arange(t)
    if time_scale is not None:
        seconds, rate = time_scale
        times = (times.astype(np.float32) * np.float32(seconds) * np.float32(rate)).astype(np.int64)
    tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1).astype(np.int64) + first


def layout(spans: Sequence[tuple[int, int, tuple[int, int, int]]
                          | tuple[int, int, tuple[int, int, int], tuple[float, float] | None]],
           merge: int) -> tuple[RopeLayout, list[np.ndarray]]:
    """The rotary layout of a prompt whose images and videos sit at ``spans`` (each ``(offset, length, grid)``, or
    with a video's time scale, ``(offset, length, grid, time_scale)``: see :func:`image_positions`; in order), and
    each one's ``[length, 3]`` positions.

    Raises:
        ValueError: an image's length is not its grid's count of merged patches, or spans overlap.
    """
    starts, values, positions = [0], [0], []
    pos, index = 0, 0   # the next text token's position and index
    for offset, length, grid, *scale in spans:
        if offset < index:
            raise ValueError(f"images overlap at prompt position {offset}")
        pos += offset - index                      # the text before the image
        rows = image_positions(pos, grid, merge, *scale)
        if len(rows) != length:
            raise ValueError(f"an image of grid {grid} has {len(rows)} merged patches, its prompt {length} positions")
        positions.append(rows)
        pos = int(rows.max()) + 1 if len(rows) else pos
        index = offset + length
        starts.append(index)
        values.append(pos - index)
    return RopeLayout(np.array(starts, dtype=np.int64), np.array(values, dtype=np.int64)), positions
