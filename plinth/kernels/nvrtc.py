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
import threading
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
#: ``CU_FUNC_ATTRIBUTE_NUM_REGS``, ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``
NUM_REGS, MAX_DYNAMIC_SHARED = 4, 8

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
    return lib


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
           what: str) -> None:
    """Launch ``func`` on ``device``'s current stream with ctypes ``args`` (a 1-D grid and block).

    Raises:
        RuntimeError: the driver refused the launch (``what`` names the kernel).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    with contextlib.ExitStack() as stack:
        if torch.cuda.current_device() != index:   # the function belongs to the device's context
            stack.enter_context(torch.cuda.device(index))
        status = libcuda().cuLaunchKernel(ctypes.c_void_p(func), grid, 1, 1, block, 1, 1, shared, stream, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernel failed for {what} (CUresult {status})")
