"""The CPU platform: always available, the fallback when no accelerator is."""

from __future__ import annotations

import os
import platform as _pyplatform
from pathlib import Path

import torch

from plinth.attention_backends.interface import Support
from plinth.platforms.interface import Platform

_PROC_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: a container's memory limit, which can be far below the host's RAM
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_CGROUP_USAGE = (Path("/sys/fs/cgroup/memory.current"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"))


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
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def _read_int(paths: tuple[Path, ...]) -> int | None:
    for path in paths:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
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
