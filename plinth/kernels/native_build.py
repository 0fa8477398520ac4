"""Build and load plinth's native CPU kernels: torch-free C++ files with C entry points.

A kernel source (``csrc/*.cpp``) includes no torch headers, so one build takes about a second (a file
that includes torch's extension headers takes about a minute on two cores). It is compiled at first
use with the system C++ compiler (``$CXX``, else ``c++``) and OpenMP into
``plinth.config.cache_dir() / <name>``, under a file name that hashes the source, the shared headers of
``csrc/`` (``-I``), the compiler flags, the compiler's version and the CPU's feature flags (the build targets the host CPU); later processes
load that file without compiling, once its SHA-256 (written beside it by the build) matches: a damaged file
is built again. The built library links ``libgomp.so.1``, the same OpenMP runtime
torch's CPU build loads, so both share one thread pool.

:func:`build_and_open` never raises for a missing compiler or a failed build: it returns a
:class:`NativeBuild` whose ``reason`` says what went wrong, for callers to report or fall back on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from plinth.config import MARCH_ENV, MARCH_PATTERN, shared_mode

logger = logging.getLogger(__name__)

#: ``-fno-trapping-math``: no code here reads floating-point exception flags, so loops with a select between two
#: quotients (SiLU's sigmoid) may compute both and vectorise; it permits neither reassociation nor contraction, so
#: results are unchanged
CXX_FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: the CPU the builds target: ``-march=$PLINTH_CPU_MARCH``, default ``native`` (this machine's instruction
#: set). A portable value (``x86-64-v2``, ``armv8-a``) builds kernels that run on other CPUs of the family
#: too, without their AVX512 paths.
def cxx_flags() -> tuple[str, ...]:
    """The compiler flags of a build, or raise ValueError for a malformed ``$PLINTH_CPU_MARCH`` (an engine's
    configuration refuses one first: :func:`plinth.config.check_march`)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(MARCH_PATTERN, march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value")
    return (*CXX_FLAGS, f"-march={march}")
BUILD_TIMEOUT_S = 300
#: the shared headers every kernel source may include (``-I``); their text is part of every build's hash
INCLUDE_DIR = Path(__file__).parent / "csrc"


@dataclasses.dataclass(frozen=True)
class NativeBuild:
    """The loaded library, or why there is none."""

    library: ctypes.CDLL | None
    path: Path | None = None
    reason: str = ""
    seconds: float = 0.0     # time spent compiling (0 when an earlier build was loaded)


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX``, else ``c++``), or None when it is not on ``PATH``."""
    name = os.environ.get("CXX", "").strip() or "c++"
    return shutil.which(name)


@functools.cache
def cpu_signature() -> str:
    """The host CPU's model and feature flags (``-march=native`` builds are only valid there)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    return platform.machine() + "".join(sorted(set(lines)))


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return done.stdout.strip()


def library_path(cxx: str, source: Path, name: str) -> Path:
    """Where the build of ``source`` for this compiler and CPU lives."""
    from plinth.config import cache_dir

    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(cxx_flags()).encode(), compiler_version(cxx).encode(),
                 cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return Path(cache_dir()) / name / f"plinth_{name}_{digest.hexdigest()[:20]}.so"


def compile_library(cxx: str, source: Path, target: Path) -> str:
    """Compile ``source`` into ``target`` (atomically, so concurrent processes never load a partial file).

    Returns ``""`` or the reason the build failed.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the build directory {target.parent}: {exc}"
    try:
        done = subprocess.run([cxx, *cxx_flags(), f"-I{INCLUDE_DIR}", "-o", tmp, str(source)], capture_output=True,
                              text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            return f"{Path(cxx).name} failed (exit {done.returncode}): " + " | ".join(lines[-3:])
        with open(tmp, "rb") as f:   # on disk before it is named: a crash leaves no partial library in place
            os.fsync(f.fileno())
        digest = _file_digest(Path(tmp))
        os.chmod(tmp, shared_mode(0o755))   # mkstemp makes it private; the cache is shared like the model files
        os.replace(tmp, target)
        _write_atomically(_digest_path(target), digest)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{Path(cxx).name} could not run: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)   # readable as the library is (mkstemp makes it private)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _intact(target: Path) -> bool:
    """Whether ``target`` is the library a build wrote (its SHA-256 beside it): a truncated or damaged file is
    never handed to the dynamic loader (a truncated library kills the process there)."""
    try:
        return target.is_file() and _digest_path(target).read_text().strip() == _file_digest(target)
    except OSError:
        return False


def build_and_open(source: Path, name: str, abi_symbol: str, abi_version: int, what: str) -> NativeBuild:
    """Build ``source`` if no build for this host exists yet, load it and check its ABI.

    Args:
        source: the C++ file.
        name: the cache subdirectory and library name stem.
        abi_symbol: an exported ``int64_t f()`` returning the source's ABI version.
        abi_version: the version the Python side expects.
        what: a few words for the log (``"CPU paged-attention kernel"``).
    """
    import torch  # noqa: F401 (torch's OpenMP runtime must be loaded before the kernel's)

    if not source.is_file():
        return NativeBuild(None, reason=f"kernel source {source} is missing from the installation")
    cxx = compiler()
    if cxx is None:
        return NativeBuild(None, reason=f"no C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH)")
    try:
        target = library_path(cxx, source, name)
    except ValueError as exc:
        logger.warning("%s off: %s", what, exc)   # the user's own setting: said aloud
        return NativeBuild(None, reason=str(exc))
    seconds = 0.0
    if not _intact(target):   # never built, or a damaged or foreign file: built (again)
        if target.exists():
            logger.warning("rebuilding the %s: %s does not match its recorded checksum", what, target)
        logger.info("building the %s into %s", what, target.parent)
        t0 = time.perf_counter()
        if problem := compile_library(cxx, source, target):
            if os.environ.get(MARCH_ENV, "").strip():   # the build the user asked for failed: said aloud
                logger.warning("%s off: the build for %s=%s failed: %s", what, MARCH_ENV,
                               os.environ[MARCH_ENV].strip(), problem)
            return NativeBuild(None, target, f"kernel build failed: {problem}")
        seconds = time.perf_counter() - t0
        logger.info("%s built in %.1f s", what, seconds)
    try:
        lib = ctypes.CDLL(str(target))
        abi = getattr(lib, abi_symbol)
    except (OSError, AttributeError) as exc:
        return NativeBuild(None, target, f"cannot load {target}: {exc}")
    abi.restype = ctypes.c_int64
    if abi() != abi_version:
        return NativeBuild(None, target, f"{target} has ABI {abi()}, expected {abi_version}")
    return NativeBuild(lib, target, "", seconds)
