"""Fault a CPU KV cache's memory in ahead of use, a chunk at a time, while the engine has nothing to run.

The CPU KV cache comes from calloc'd memory (see ``model_runner._zeros``) so that start-up does not write
gigabytes of zeros; its pages are then faulted in by the steps that first write them. Where fresh memory is
slow to fault in (a virtual machine whose host backs guest memory on first touch: 2.2 ms per MiB measured on
the 2-core reference machine against 0.12 ms for recycled pages) a serving run's prefill steps spent a fifth of
their time there. :class:`KVPrefaulter` moves that work into idle time: each :meth:`step` asks the kernel to
populate the next ``chunk_bytes`` of the cache (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), which maps
the pages writable without changing their contents, so it is safe whatever the cache holds. Blocks are
populated in ascending id order (the order the block manager first hands them out), every layer's keys and
values of them together.

``PLINTH_CPU_KV_PREFAULT=0`` turns it off (read by the model runner, as the CPU path's other switches).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["KVPrefaulter", "PREFAULT_ENV"]

logger = logging.getLogger(__name__)

PREFAULT_ENV = "PLINTH_CPU_KV_PREFAULT"
MADV_POPULATE_WRITE = 23   # linux/mman.h
_PAGE = 4096


def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class KVPrefaulter:
    """Populates the memory of CPU KV-cache tensors, one window of at most ``window_bytes`` per :meth:`step`.

    Each cache splits into regions by its block dimension (its first dimension of size ``num_blocks``: the
    keys and the values of the layout ``[2, num_blocks, ...]``; a cache without one is a single region). The
    windows are aligned to ``window_bytes`` in the address space, so where transparent huge pages back the
    cache (numpy asks for them on large arrays) a step faults in at most one 2 MiB page; they go region by
    region for window 0 of every region, then window 1, and so on: blocks in ascending order, every layer's
    keys and values of them together.

    Args:
        caches: the per-layer cache tensors (contiguous, on the CPU).
        num_blocks: blocks per layer.
        window_bytes: the most one :meth:`step` populates, a power of two multiple of 4 KiB (2 MiB: ~4.5 ms
            of fresh memory on the reference VM, what a request arriving meanwhile waits at most).
    """

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int, window_bytes: int = 2 << 20):
        if window_bytes < _PAGE or window_bytes & (window_bytes - 1):
            raise ValueError(f"window_bytes must be a power of two of at least {_PAGE}, got {window_bytes}")
        self._madvise = _madvise()
        self.window_bytes = window_bytes
        self._regions: list[tuple[int, int]] = []   # (start, end) addresses
        for cache in caches:
            self._regions.extend(self._split(cache, num_blocks))
        self._windows = max((-(-end // window_bytes) - start // window_bytes for start, end in self._regions),
                            default=0)
        self._window = 0   # the window index (from each region's first aligned window) ...
        self._region = 0   # ... and the region the next step populates
        self.populated_bytes = 0
        self.done = self._madvise is None or not self._regions

    @staticmethod
    def _split(cache: torch.Tensor, num_blocks: int) -> list[tuple[int, int]]:
        if cache.device.type != "cpu" or not cache.is_contiguous():
            raise ValueError("KVPrefaulter populates contiguous CPU tensors")
        start = cache.data_ptr()
        nbytes = cache.numel() * cache.element_size()
        dim = next((i for i, n in enumerate(cache.shape) if n == num_blocks), None)
        lead = 1
        for n in cache.shape[:dim] if dim is not None else ():
            lead *= n
        size = nbytes // lead
        return [(start + i * size, start + (i + 1) * size) for i in range(lead)] if nbytes else []

    def step(self) -> bool:
        """Populate the next window; return whether any is left. A failing ``madvise`` (a kernel without
        ``MADV_POPULATE_WRITE``) ends the work quietly: the pages then fault in when first written."""
        w = self.window_bytes
        while not self.done:
            start, end = self._regions[self._region]
            lo = max(start, (start // w + self._window) * w)
            hi = min(end, lo // w * w + w)
            self._region += 1
            if self._region == len(self._regions):
                self._region = 0
                self._window += 1
                self.done = self._window >= self._windows
            if lo < hi:
                if not self._populate(lo, hi):
                    self.done = True
                    return False
                break
        return not self.done

    def _populate(self, lo: int, hi: int) -> bool:
        # whole pages covering [lo, hi): the first and last are the tensor's own (mapped) pages
        a = lo // _PAGE * _PAGE
        b = -(-hi // _PAGE) * _PAGE
        assert self._madvise is not None
        if self._madvise(a, b - a, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            logger.debug("KV prefault stopped: madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(err))
            return False
        self.populated_bytes += hi - lo
        return True
