"""Compile CUDA sources with NVRTC from its pip wheel, on any machine (no GPU needed)."""

from __future__ import annotations

import ctypes
import glob
import importlib.util

import pytest


def nvrtc() -> ctypes.CDLL:
    """NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel (a test dependency); skips the test without it."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-cuda-nvrtc-cu12 not installed")
    libs = sorted(glob.glob(f"{list(spec.submodule_search_locations)[0]}/lib/libnvrtc.so*"))
    libs = [p for p in libs if "builtins" not in p and ".alt." not in p]
    if not libs:
        pytest.skip("no libnvrtc in nvidia-cuda-nvrtc-cu12")
    return ctypes.CDLL(libs[0])


def compile_source(source: bytes, filename: str, name: str, arch: str) -> tuple[int, str]:
    """``(status, log)`` of compiling kernel ``name`` (a template instance works) of ``source`` for ``arch``
    with ``ptxas -v`` (the log reports registers and spills)."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, filename.encode(), 0, None, None) == 0
    assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace")
