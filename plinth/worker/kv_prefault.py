"""Fault a CPU KV cache's memory in ahead of use, a chunk at a time, while the engine has nothing to run.

The CPU KV cache comes from calloc'd memory (see ``model_runner._zeros``) so that start-up does not write
gigabytes of zeros; its pages are then faulted in by the steps that first write them. Where fresh memory is
slow to fault in (a virtual machine whose host backs guest memory on first touch: 2.2 ms per MiB measured on
the 2-core reference machine against 0.12 ms for recycled pages) a serving run's prefill steps spent a fifth of
their time there. :class:`KVPrefaulter` moves that work into idle time: each :meth:`step` asks the kernel to
populate the next ``chunk_bytes`` of the cache (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), which maps
the pages writable without changing their contents, so it is safe whatever the cache holds. Blocks are
populated in ascending id order (the order the block manager first hands them out), every layer's keys and
values of a block range at once.

``PLINTH_CPU_KV_PREFAULT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["KVPrefaulter", "PREFAULT_ENV", "prefault_enabled"]

logger = logging.getLogger(__name__)

PREFAULT_ENV = "PLINTH_CPU_KV_PREFAULT"
MADV_POPULATE_WRITE = 23   # linux/mman.h
_PAGE = 4096


def prefault_enabled() -> bool:
    """``PLINTH_CPU_KV_PREFAULT`` is not ``0``/``false``/``no``/``off`` (default on)."""
    return os.environ.get(PREFAULT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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
    """Populates the memory of CPU KV-cache tensors block range by block range.

    Args:
        caches: the per-layer cache tensors (contiguous, on the CPU).
        num_blocks: blocks per layer; a cache's first dimension of this size is its block dimension (a cache
            without one is populated front to back, in even shares alongside the others).
        chunk_bytes: about how much one :meth:`step` populates (at 2.2 ms/MiB, 2 MiB is ~5 ms: what a request
            arriving meanwhile waits at most).
    """

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int, chunk_bytes: int = 2 << 20):
        self._madvise = _madvise()
        # per cache: (start address, lead stride, lead count, block bytes, end address)
        self._spans: list[tuple[int, int, int, int, int]] = []
        self.num_blocks = num_blocks
        for cache in caches:
            self._spans.append(self._span(cache, num_blocks))
        per_block = sum(count * block for _, _, count, block, _ in self._spans)
        self._blocks_per_step = max(1, chunk_bytes // max(per_block, 1))
        self._next = 0
        self.populated_bytes = 0
        self.done = self._madvise is None or not self._spans or num_blocks <= 0

    @staticmethod
    def _span(cache: torch.Tensor, num_blocks: int) -> tuple[int, int, int, int, int]:
        """How a cache's bytes split by block: block ``b`` of lead index ``i`` starts at
        ``start + i * lead_stride + b * block_bytes``."""
        if cache.device.type != "cpu" or not cache.is_contiguous():
            raise ValueError("KVPrefaulter populates contiguous CPU tensors")
        elem = cache.element_size()
        start = cache.data_ptr()
        end = start + cache.numel() * elem
        dim = next((i for i, n in enumerate(cache.shape) if n == num_blocks), None)
        if dim is None:   # no block dimension: the whole tensor as one lead of num_blocks even shares
            return start, 0, 1, -(-(end - start) // num_blocks), end
        lead = 1
        for n in cache.shape[:dim]:
            lead *= n
        block = cache.stride(dim) * elem
        return start, num_blocks * block, lead, block, end

    def step(self) -> bool:
        """Populate the next chunk; return whether any is left. A failing ``madvise`` (a kernel without
        ``MADV_POPULATE_WRITE``) ends the work quietly: the pages then fault in when first written."""
        if self.done:
            return False
        b0 = self._next
        b1 = min(self.num_blocks, b0 + self._blocks_per_step)
        for start, lead_stride, lead, block, end in self._spans:
            for i in range(lead):
                lo = start + i * lead_stride + b0 * block
                hi = min(start + i * lead_stride + b1 * block, end)
                if hi <= lo:
                    continue
                if not self._populate(lo, hi):
                    self.done = True
                    return False
        self._next = b1
        self.done = b1 >= self.num_blocks
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
