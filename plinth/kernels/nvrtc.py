"""CUDA kernels compiled at run time with NVRTC and launched through the driver API.

``torch.cuda._compile_kernel`` compiles a source (NVRTC ships with PyTorch's CUDA wheels, so no
toolkit is needed) and loads it; the launches here go straight to ``cuLaunchKernel`` on torch's
current stream, so they are captured in CUDA graphs like any other kernel. The sources live in
``plinth/kernels/csrc/*.cu`` and include no headers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
#: ``CU_FUNC_ATTRIBUTE_NUM_REGS``, ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``
NUM_REGS, MAX_DYNAMIC_SHARED = 4, 8
#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
_PROGRAMMATIC_SERIALIZATION = 6
_PDL_ENV = "PLINTH_PDL"


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (its first int here)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]

_compile_lock = threading.Lock()
_LOADED: list[Any] = []   # loaded modules live as long as the process


@functools.lru_cache(maxsize=1)
def libcuda() -> Any:
    """The CUDA driver library with the signatures used here."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuFuncSetAttribute.restype = ctypes.c_int
    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    lib.cuFuncGetAttribute.restype = ctypes.c_int
    lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuDriverGetVersion.restype = ctypes.c_int
    if hasattr(lib, "cuLaunchKernelEx"):   # CUDA 12 drivers
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def cuda_index(device: torch.device) -> int:
    """``device``'s CUDA index (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _pdl_device(index: int) -> bool:
    if torch.version.hip is not None or torch.cuda.get_device_capability(index) < (9, 0):
        return False
    lib = libcuda()
    version = ctypes.c_int()
    # launches with programmatic serialization are captured into graphs from CUDA 12.3 drivers on
    return (hasattr(lib, "cuLaunchKernelEx") and lib.cuDriverGetVersion(ctypes.byref(version)) == 0
            and version.value >= 12030)


def dependent_launches(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch: Hopper or newer, a CUDA 12.3+
    driver, and ``PLINTH_PDL`` not ``0``."""
    if os.environ.get(_PDL_ENV, "1") == "0":
        return False
    return _pdl_device(cuda_index(device))


_PREFETCHING: set[int] = set()   # devices with kernels that stream weights before their dependency wait


def note_prefetching_kernels(device: torch.device) -> None:
    """Record that decode steps on ``device`` run kernels that read their weights before
    ``griddepcontrol.wait`` (the W4A16 GEMVs, once a layer is installed on one): the small Triton kernels around them
    are then launched as programmatic dependents too (:func:`plinth.kernels.ops.dependent_options`)."""
    _PREFETCHING.add(cuda_index(device))


def prefetching_kernels(device: torch.device) -> bool:
    """Whether :func:`note_prefetching_kernels` was called for ``device`` and dependent launches are on."""
    return cuda_index(device) in _PREFETCHING and dependent_launches(device)


def dependent_launch(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` may start before the kernel ahead of it ends
    (:func:`dependent_launches`, and a CUDA graph is being captured).

    Only in graphs: they replay decode steps, whose kernels read weights no kernel of the step writes,
    while an eager launch may directly follow the kernel that wrote its weights (packing at load time).
    A kernel so launched must read what earlier kernels write only after ``griddepcontrol.wait``.
    """
    return torch.cuda.is_current_stream_capturing() and dependent_launches(device)


def available() -> bool:
    """Whether this torch can compile kernels at run time (CUDA build with ``torch.cuda._compile_kernel``)."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")


def compile_function(source: str, name: str, device_index: int) -> int:
    """Compile ``source`` and return the CUfunction (as an int) of kernel ``name`` (a template instance
    such as ``"f<true, 4>"`` works), loaded on device ``device_index``.

    Raises:
        RuntimeError: NVRTC or the driver failed.
    """
    with _compile_lock, torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(source, name)
        _LOADED.append(kernel)
        func = getattr(kernel, "func", None)
        if func is None:
            raise RuntimeError("torch.cuda._compile_kernel returned no CUfunction handle (.func)")
        return int(func.value if hasattr(func, "value") else func)


def set_attribute(func: int, attribute: int, value: int, what: str) -> None:
    """``cuFuncSetAttribute``; ``what`` names the kernel in the error."""
    status = libcuda().cuFuncSetAttribute(ctypes.c_void_p(func), attribute, value)
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute({attribute}) failed for {what} (CUresult {status})")


def get_attribute(func: int, attribute: int) -> int:
    """``cuFuncGetAttribute`` (e.g. :data:`NUM_REGS`)."""
    value = ctypes.c_int()
    status = libcuda().cuFuncGetAttribute(ctypes.byref(value), attribute, ctypes.c_void_p(func))
    if status != 0:
        raise RuntimeError(f"cuFuncGetAttribute failed (CUresult {status})")
    return value.value


def launch(func: int, grid: int, block: int, shared: int, device: torch.device, args: list[Any],
           what: str, dependent: bool = False) -> None:
    """Launch ``func`` on ``device``'s current stream with ctypes ``args`` (a 1-D grid and block).

    ``dependent``: let it start while the previous kernel of the stream finishes (see
    :func:`dependent_launch`; the kernel must ``griddepcontrol.wait`` before reading its inputs).

    Raises:
        RuntimeError: the driver refused the launch (``what`` names the kernel).
    """
    index = cuda_index(device)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    with contextlib.ExitStack() as stack:
        if torch.cuda.current_device() != index:   # the function belongs to the device's context
            stack.enter_context(torch.cuda.device(index))
        if dependent:
            attribute = _LaunchAttribute(id=_PROGRAMMATIC_SERIALIZATION, value=1)
            config = _LaunchConfig((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), shared,
                                   stream, ctypes.pointer(attribute), 1)
            status = libcuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(func), params, None)
        else:
            status = libcuda().cuLaunchKernel(ctypes.c_void_p(func), grid, 1, 1, block, 1, 1, shared, stream,
                                              params, None)
    if status != 0:
        call = "cuLaunchKernelEx" if dependent else "cuLaunchKernel"
        raise RuntimeError(f"{call} failed for {what} (CUresult {status})")
