"""The on-disk record of earlier selections: one JSON file per kind and key.

Files live in ``plinth.config.cache_dir() / "selection"`` and are named
``<kind>-<sha256 of the key>.json``; each holds its full key, so a hash collision or a stale
file is detected on read. Writes go to a temporary file in the same directory that is then
renamed over the target, so a reader never sees half a record, even with several engines
starting at once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from plinth import config
from plinth.plugins import PluginError, PluginManager, Registration

logger = logging.getLogger(__name__)

SUBDIR = "selection"
#: bump when the record format or the meaning of a key part changes
FORMAT_VERSION = 1
#: a record no start has read for this long is removed when another is written
UNUSED_DAYS = 90


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


#: environment switches that change which kernels a candidate runs or how fast (a record timed under one setting
#: says nothing about another); only these are read into keys, so no other variable (a secret) reaches the records
KERNEL_SWITCHES = (
    "PLINTH_CPU_AMX", "PLINTH_CPU_INT4", "PLINTH_CPU_INT4_MAX_ROWS", "PLINTH_CPU_INT8_ACT", "PLINTH_CPU_MARCH",
    "PLINTH_CPU_NATIVE_OPS", "PLINTH_CPU_PACKED", "PLINTH_CPU_PAGED_ATTENTION", "PLINTH_CPU_Q4_PANEL_MAX_ROWS",
    "PLINTH_CPU_Q8_HEAD_MAX_ROWS", "PLINTH_CPU_SDPA_PREFILL", "PLINTH_CPU_THREADS", "PLINTH_FUSED_OPS",
    "PLINTH_INT4_GROUP_SIZE", "PLINTH_PDL", "PLINTH_SKINNY_GEMM", "PLINTH_TRITON_INTERPRET", "PLINTH_W4A16_CUDA",
    "PLINTH_W4A16_GEMV", "PLINTH_W4A16_MMA", "PLINTH_W4A16_SILU", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY",
)


def base_key(platform: Any, pm: PluginManager, registrations: Mapping[str, Registration]) -> dict[str, Any]:
    """The key parts every kind shares: device, platform, library and candidate-plugin versions, the kernel
    switches set in the environment, the instruction set torch's CPU kernels use and torch's thread count."""
    candidates = {}
    for name, reg in registrations.items():
        record = pm.records.get(reg.plugin)
        candidates[name] = {
            "ref": reg.ref,
            "plugin": reg.plugin,
            "distribution": record.distribution if record else None,
            "version": record.version if record else None,
            # an implementation's own revision (``selection_revision``, e.g. of its native kernels): a new one
            # times the candidates again even where the package version did not change
            "revision": _revision(reg),
        }
    return {
        "format": FORMAT_VERSION,
        "plinth": _dist_version("plinth-llm"),
        "device": platform.device_name(),
        "platform": platform.name,
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "candidates": candidates,
        "switches": {name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _cpu_digest(),
        "threads": torch.get_num_threads(),
    }


@functools.cache
def _cpu_digest() -> str:
    """The host CPU's model and feature flags, hashed: two machines of one model name (a cluster's shared home)
    but other instruction sets (AMX or not) time their CPU candidates apart."""
    from plinth.kernels.native_build import cpu_signature

    return hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]


def _revision(reg: Any) -> Any:
    """``selection_revision`` of a registration's implementation, or None (also when it cannot be imported:
    selection reports that candidate as unsupported)."""
    try:
        return getattr(reg.load(), "selection_revision", None)
    except PluginError:   # an import failure is the selection's to report, not the key's
        return None


class SelectionCache:
    """The record for one ``kind`` and ``key`` in ``directory`` (default: the user cache)."""

    def __init__(self, directory: Path | str | None, kind: str, key: dict[str, Any]):
        self.directory = Path(directory) if directory is not None else config.cache_dir() / SUBDIR
        self.key = key
        blob = json.dumps(key, sort_keys=True, default=str)
        self.path = self.directory / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"
        self._key_json = json.loads(blob)  # the key as it reads back from disk

    def read(self) -> dict[str, Any] | None:
        """The stored record for this key, or None (missing, unreadable or for another key)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable selection record %s: %s", self.path, exc)
            return None
        if not isinstance(record, dict) or record.get("key") != self._key_json:
            return None
        with contextlib.suppress(OSError):   # in use: the pruning keeps it (where this user may touch it)
            os.utime(self.path)
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Store ``record`` (plus the key) atomically; a failure is logged, never raised."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({**record, "key": self._key_json}, f, indent=1, default=str)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, config.shared_mode(0o644))   # mkstemp makes it private; the cache is shared
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            logger.warning("could not store the selection in %s: %s", self.directory, exc)
            return
        self._prune()

    def _prune(self) -> None:
        """Remove records no start has read or written for :data:`UNUSED_DAYS` days (each new key, a new plinth or
        torch version, another model shape adds one), and temporary files writers killed mid-way left behind."""
        now = time.time()
        with contextlib.suppress(OSError):   # a cache that cannot be listed or cleaned is only not pruned
            for other in self.directory.iterdir():
                with contextlib.suppress(OSError):
                    age = now - other.stat().st_mtime
                    if (other.suffix == ".json" and age > UNUSED_DAYS * 86400) or (other.name.startswith(".tmp-")
                                                                                  and age > 3600):
                        other.unlink()
