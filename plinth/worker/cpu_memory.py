"""Faulting in the CPU KV cache's pages off the step path.

The CPU KV cache comes from calloc'd memory (:func:`plinth.worker.model_runner._zeros`): no start-up time,
but every page is zeroed by the OS on its first write, inside whichever step writes it first (a fresh
server's 500-token prefill spent ~4-6% of its time in those faults). :func:`populate_in_background` has a
low-priority thread ask the kernel to fault the pages in ahead of use (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+); where the call is not supported nothing changes. ``PLINTH_CPU_KV_POPULATE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

POPULATE_ENV = "PLINTH_CPU_KV_POPULATE"
#: ``MADV_POPULATE_WRITE`` (Linux 5.14)
_MADV_POPULATE_WRITE = 23
#: bytes per ``madvise`` call: each holds the process's memory-map lock for reading, so short calls let
#: other threads map memory in between (and a stop request is seen quickly)
_SLICE = 16 << 20


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    lib.mincore.restype = ctypes.c_int
    return lib


def _page_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, length)`` of the whole pages inside the tensor's bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // page) * page
    return first, max(0, (end // page) * page - first)


def populate(tensors: Sequence[torch.Tensor], stop: threading.Event | None = None) -> bool:
    """Fault in the pages of CPU tensors now; False where the kernel does not support it, on a stop request,
    or once a tensor is gone."""
    return _populate([weakref.ref(t) for t in tensors], stop)


def _populate(refs: list[weakref.ref], stop: threading.Event | None) -> bool:
    """:func:`populate` over weak references: a tensor is held only during its own ``madvise`` calls."""
    lib = _libc()
    if lib is None:
        return False
    for ref in refs:
        tensor = ref()
        if tensor is None:
            return False
        address, length = _page_range(tensor)
        del tensor
        for offset in range(0, length, _SLICE):
            tensor = ref()   # held during the call: the memory stays mapped
            if tensor is None or (stop is not None and stop.is_set()):
                return False
            status = lib.madvise(address + offset, min(_SLICE, length - offset), _MADV_POPULATE_WRITE)
            del tensor
            if status != 0:
                logger.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d); KV pages fault in on first use",
                             ctypes.get_errno())
                return False
    return True


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the tensor's whole pages that are in memory (``mincore``); 0.0 where unsupported."""
    lib = _libc()
    address, length = _page_range(tensor)
    if lib is None or length == 0:
        return 0.0
    page = os.sysconf("SC_PAGE_SIZE")
    flags = (ctypes.c_ubyte * (length // page))()
    if lib.mincore(address, length, flags) != 0:
        return 0.0
    return sum(f & 1 for f in flags) / len(flags)


def populate_in_background(tensors: Sequence[torch.Tensor]) -> tuple[threading.Thread, threading.Event] | None:
    """Start a daemon thread at the lowest scheduling priority that faults in the tensors' pages; returns it
    and its stop event, or None when turned off (``PLINTH_CPU_KV_POPULATE=0``) or not on Linux."""
    if os.environ.get(POPULATE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return None
    refs = [weakref.ref(t) for t in tensors if t.device.type == "cpu" and t.numel() > 0]
    if not refs:
        return None
    stop = threading.Event()

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # this thread only (Linux)
        except OSError as exc:   # the work is the same at normal priority
            logger.debug("could not lower the KV populate thread's priority: %s", exc)
        _populate(refs, stop)

    thread = threading.Thread(target=run, name="plinth-kv-populate", daemon=True)
    thread.start()
    return thread, stop
