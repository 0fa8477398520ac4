"""Array helpers for building a step's batch without a Python loop over sequences."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def block_table_array(block_ids: Sequence[Sequence[int]], width: int, rows: int | None = None,
                      dtype: type = np.int64) -> np.ndarray:
    """Each sequence's first ``width`` block ids as one row of a ``[rows, width]`` array (0-padded).

    ``rows`` (default ``len(block_ids)``) may exceed the number of sequences: the extra rows are 0
    (the scratch block), as padding rows of a fixed-size batch need.
    """
    b = len(block_ids)
    rows = b if rows is None else rows
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=b)                 # [B]
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int64, count=int(lens.sum()))
    starts = np.zeros(b, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    take = np.minimum(lens, width)                                                   # [B]
    seq = np.repeat(np.arange(b), take)                                              # [N]
    col = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)       # [N]
    table = np.zeros((rows, width), dtype=dtype)
    table[seq, col] = flat[starts[seq] + col]
    return table
