"""The CPU platform: always available, the fallback when no accelerator is."""

from __future__ import annotations

import ctypes
import logging
import os
import platform as _pyplatform
import threading
from pathlib import Path

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.interface import Platform

logger = logging.getLogger(__name__)

_PROC_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: a container's memory limit, which can be far below the host's RAM
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_CGROUP_USAGE = (Path("/sys/fs/cgroup/memory.current"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")                       # v2: "quota period" or "max period"
_CGROUP_CPU_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
THREADS_ENV = "PLINTH_CPU_THREADS"


def _cgroup_cpu_quota() -> float | None:
    """The container's CPU quota in cores (``None``: unlimited or unknown)."""
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (int(p.read_text().strip()) for p in _CGROUP_CPU_V1)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool (GNU OpenMP, if this process loaded it); True on success."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.restype = ctypes.c_int
    pause.argtypes = [ctypes.c_int]
    ok = pause(1) == 0    # omp_pause_soft: the threads go, the runtime stays
    logger.debug("released the OpenMP threads of %s: %s", threading.current_thread().name, ok)
    return ok


#: the most threads ``PLINTH_CPU_THREADS`` may ask for (more than any machine's cores; far more fail to start)
MAX_THREADS = 4096


def cpu_thread_count() -> int:
    """Threads for torch's CPU kernels: ``$PLINTH_CPU_THREADS``, else the CPUs this process may run on,
    capped by the cgroup CPU quota (one thread per core: more only contend).

    Raises:
        ConfigError: ``PLINTH_CPU_THREADS`` is not a positive integer.
    """
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        from plinth.config import ConfigError

        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_THREADS:
            raise ConfigError(f"{THREADS_ENV}={raw!r}: expected a positive integer up to {MAX_THREADS}")
        return int(raw)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota + 0.5)))
    return max(1, cpus)


def has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as torch detects it.

    torch's capability string (``torch.backends.cpu.get_cpu_capability()``) names the vector
    ISA torch dispatches to; the bfloat16 extensions are reported by its CPU probes.
    """
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if "AMX" in capability or "BF16" in capability:
        return True
    if not capability.startswith("AVX512"):
        return False  # AVX2 kernels (or non-x86) emulate bfloat16 through float32
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes, or ``{}`` where there is none."""
    try:
        text = _PROC_MEMINFO.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isascii() and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def _read_int(paths: tuple[Path, ...]) -> int | None:
    for path in paths:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isascii() and raw.isdigit():
            return int(raw)
        return None  # "max": no limit
    return None


def _cgroup_limit(physical: int) -> int | None:
    limit = _read_int(_CGROUP_LIMITS)
    return limit if limit is not None and limit < physical else None  # v1 reports "no limit" as a huge number


def _physical_total() -> int:
    info = _meminfo()
    if "MemTotal" in info:
        return info["MemTotal"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _physical_available() -> int:
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    try:
        import psutil  # optional: the portable answer where /proc is missing
    except ModuleNotFoundError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(psutil.virtual_memory().available)


class CpuPlatform(Platform):
    """Plain CPUs through torch's CPU kernels; tensor parallelism over gloo."""

    name = "cpu"
    priority = 0
    device_type = "cpu"
    dist_backend = "gloo"
    supports_graph_capture = False

    @classmethod
    def is_available(cls) -> Support:
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if has_fast_bf16():
            return (torch.bfloat16, torch.float32)
        return (torch.float32, torch.bfloat16)

    def total_memory(self, index: int = 0) -> int:
        """Physical RAM, or the container's memory limit when that is lower."""
        physical = _physical_total()
        limit = _cgroup_limit(physical)
        return physical if limit is None else limit

    def free_memory(self, index: int = 0) -> int:
        """RAM that can be allocated without swapping (``MemAvailable``), within the container's limit."""
        available = _physical_available()
        limit = _cgroup_limit(_physical_total())
        if limit is None:
            return available
        used = _read_int(_CGROUP_USAGE) or 0
        return max(0, min(available, limit - used))

    def set_device(self, index: int = 0) -> None:
        """Size torch's thread pool for this process (:func:`cpu_thread_count`), unless ``OMP_NUM_THREADS``
        was set and ``PLINTH_CPU_THREADS`` was not."""
        if os.environ.get("OMP_NUM_THREADS") and not os.environ.get(THREADS_ENV):
            return
        threads = cpu_thread_count()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def hand_over_to_thread(self) -> None:
        """Release this thread's OpenMP worker threads (``omp_pause_resource_all``): while they exist,
        the parallel regions of the thread that takes over the engine run about 3x slower (measured on
        2 cores: a [1, 576] x [576, 3072] GEMM 227 us instead of 65 us). A no-op without libgomp."""
        release_openmp_threads()

    def enter_engine_thread(self) -> None:
        """Size torch's thread pool on the engine thread too (OpenMP's thread count is per thread)."""
        self.set_device(0)

    def prepare_runner(self, runner: object, source: object, config: object) -> None:
        """Set up the CPU fast path on a built runner (prepacked/int4 GEMMs, compiled decode steps)."""
        from plinth.worker.cpu_path import accelerate_cpu_runner

        accelerate_cpu_runner(runner, source, config)

    def device_name(self, index: int = 0) -> str:
        for line in _cpuinfo_lines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
        return _pyplatform.processor() or "cpu"


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
