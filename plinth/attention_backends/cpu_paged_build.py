"""Build and load the native CPU paged-attention kernel (``csrc/cpu_paged_attention.cpp``).

The kernel is a torch-free C++ file with C entry points, so one build takes about a second (a file
that includes torch's extension headers takes about a minute on two cores). It is compiled at
first use with the system C++ compiler (``$CXX``, else ``c++``) and OpenMP, into
``plinth.config.cache_dir() / "cpu_paged"``, under a name that hashes the source, the compiler
flags, the compiler's version and the CPU's feature flags (the build targets the host CPU); later
processes load that file without compiling. The built library links ``libgomp.so.1``, the same
OpenMP runtime torch's CPU build loads, so both share one thread pool.

:func:`load_kernel` never raises for a missing compiler or a failed build: it returns a
:class:`KernelBuild` whose ``reason`` says what went wrong, for ``supports()`` to show.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: the ABI the Python side expects (``plinth_cpu_paged_abi()`` in the source)
ABI_VERSION = 1
BUILD_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """The loaded library, or why there is none."""

    library: ctypes.CDLL | None
    path: Path | None = None
    reason: str = ""
    seconds: float = 0.0     # time spent compiling (0 when an earlier build was loaded)


def _compiler() -> str | None:
    name = os.environ.get("CXX", "").strip() or "c++"
    return shutil.which(name)


def _cpu_signature() -> str:
    """The host CPU's model and feature flags (``-march=native`` builds are only valid there)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    return platform.machine() + "".join(sorted(set(lines)))


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return done.stdout.strip()


def library_path(cxx: str) -> Path:
    """Where the build for this source, compiler and CPU lives."""
    from plinth.config import cache_dir

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXX_FLAGS).encode(), _compiler_version(cxx).encode(),
                 _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return Path(cache_dir()) / "cpu_paged" / f"plinth_cpu_paged_{digest.hexdigest()[:20]}.so"


def _compile(cxx: str, target: Path) -> str:
    """Compile into ``target`` (atomically, so concurrent processes never load a partial file).

    Returns ``""`` or the reason the build failed.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the build directory {target.parent}: {exc}"
    try:
        done = subprocess.run([cxx, *CXX_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            return f"{Path(cxx).name} failed (exit {done.returncode}): " + " | ".join(lines[-3:])
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{Path(cxx).name} could not run: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    if lib.plinth_cpu_paged_abi() != ABI_VERSION:
        return None, f"{path} has ABI {lib.plinth_cpu_paged_abi()}, expected {ABI_VERSION}"
    fn = lib.plinth_cpu_paged_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_double] + [ctypes.c_int64] * 2
    return lib, ""


@functools.cache
def load_kernel() -> KernelBuild:
    """The kernel library, built on first use (once per process; later processes load the build).

    Returns:
        A :class:`KernelBuild`; ``library`` is None and ``reason`` says why when there is no
        C++ compiler or the build fails.
    """
    import torch  # noqa: F401 (torch's OpenMP runtime must be loaded before the kernel's)

    if not SOURCE.is_file():
        return KernelBuild(None, reason=f"kernel source {SOURCE} is missing from the installation")
    cxx = _compiler()
    if cxx is None:
        return KernelBuild(None, reason=f"no C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH)")
    target = library_path(cxx)
    seconds = 0.0
    if not target.is_file():
        logger.info("building the CPU paged-attention kernel into %s", target.parent)
        t0 = time.perf_counter()
        if problem := _compile(cxx, target):
            return KernelBuild(None, target, f"kernel build failed: {problem}")
        seconds = time.perf_counter() - t0
        logger.info("CPU paged-attention kernel built in %.1f s", seconds)
    lib, problem = _open(target)
    return KernelBuild(lib, target, problem, seconds)
