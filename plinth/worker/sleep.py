"""Sleep mode: an idle engine gives its device memory back, and takes it again on waking.

Reinforcement-learning loops run the trainer and the inference engine on the same accelerators in turns; while
the trainer runs, the engine's weights and KV cache would hold memory it needs. :meth:`ModelRunner.sleep
<plinth.worker.model_runner.ModelRunner.sleep>` frees the KV cache (its contents are lost: the engine forgets its
prefix cache) and, on an accelerator, the weights' device memory: level 1 copies them to host memory first, level 2
discards the checkpoint's parameters (the next weight update brings them). What is not a parameter (buffers,
rotary tables, LoRA slots, a kernel's own copies) is copied to host memory at either level, except what the model's
``transient_tensors()`` names (the Mamba layers' per-sequence states and prefix-cache states, which an idle engine
with its prefix cache forgotten does not need): freed, and zeros after waking.

The tensors keep their identity: each one's storage is resized to nothing and back (as FSDP frees parameters),
so every view of a weight, and every layer that holds it, sees the same tensor after waking; only the memory
address changes, so the decode steps that captured addresses (CUDA graphs, the CPU decode plan) are built again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SLEEP_TAGS", "OffloadedTensors", "device_storages"]

logger = logging.getLogger(__name__)

#: what :meth:`ModelRunner.wake_up` can wake, separately (vLLM's tags)
SLEEP_TAGS = ("weights", "kv_cache")

_MAX_DEPTH = 4


def _tensors_in(obj: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through containers and plain objects' attributes (not through modules: the
    caller walks every module), at most ``_MAX_DEPTH`` levels down."""
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, seen, depth + 1)
    elif isinstance(obj, list | tuple | set | frozenset):
        for value in obj:
            yield from _tensors_in(value, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith("plinth"):
        for value in vars(obj).values():
            yield from _tensors_in(value, seen, depth + 1)


def device_storages(model: torch.nn.Module, device: torch.device,
                    exclude: frozenset[int] = frozenset()) -> list[tuple[torch.UntypedStorage, bool]]:
    """Every distinct storage on ``device`` that ``model`` reaches (parameters, buffers, tensors its modules and
    their plain-object attributes hold), each with whether a parameter of the model uses it; not those whose
    data pointers ``exclude`` holds (the KV cache)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device == device}
    found: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for module in model.modules():
        for key, value in vars(module).items():
            if key in ("_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
                continue
            for t in _tensors_in(value, seen, 0):
                if t.device != device or t.is_sparse or t.layout != torch.strided:
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in found and ptr not in exclude:
                    found[ptr] = storage
    return [(s, ptr in params) for ptr, s in found.items()]


def _as_bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


_ALIGN = 512   # host copies start on this many bytes


class OffloadedTensors:
    """The device storages of a model, freed; kept in host memory unless ``discard_parameters`` and a parameter's.

    The host copies are slices of one buffer, ``host_pool`` when it is large enough (page-locked on CUDA: pinning
    host memory takes 0.3-0.6 s a GB, ten times the copy, so a runner that sleeps again passes the buffer of its
    last sleep: :attr:`pool`), else a new one.

    Args:
        model: the model.
        device: the accelerator whose memory is given back.
        discard_parameters: level 2: the parameters' values are not kept (zeros after :meth:`restore`).
        host_pool: a uint8 host buffer to hold the copies, if large enough.
        exclude: data pointers of storages left alone (the KV cache, freed on its own).
        scratch: data pointers of storages whose contents are not needed after waking (a model's per-sequence
            recurrent state): freed with no host copy, zeros after :meth:`restore`.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, discard_parameters: bool,
                 host_pool: torch.Tensor | None = None, exclude: frozenset[int] = frozenset(),
                 scratch: frozenset[int] = frozenset()):
        self.entries: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        self.skipped = 0
        kept: list[tuple[torch.UntypedStorage, int, bool]] = []
        for storage, is_param in device_storages(model, device, exclude):
            if not getattr(storage, "resizable", lambda: True)():
                self.skipped += 1
                continue
            kept.append((storage, storage.nbytes(),
                         not (discard_parameters and is_param) and storage.data_ptr() not in scratch))
        need = sum(-(-n // _ALIGN) * _ALIGN for _, n, keep in kept if keep)
        if host_pool is None or host_pool.numel() < need:
            host_pool = torch.empty(need, dtype=torch.uint8, pin_memory=device.type == "cuda")
        #: the host buffer of the copies (pass it to the next sleep)
        self.pool = host_pool
        offset = 0
        for storage, nbytes, keep in kept:
            host = None
            if keep:
                host = host_pool[offset: offset + nbytes]
                host.copy_(_as_bytes(storage, nbytes), non_blocking=True)
                offset += -(-nbytes // _ALIGN) * _ALIGN
            self.entries.append((storage, nbytes, host))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for storage, _, _ in self.entries:
            storage.resize_(0)
        if self.skipped:
            logger.info("sleep: %d storage(s) that cannot be resized stay in %s memory", self.skipped, device)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.entries)

    @property
    def host_bytes(self) -> int:
        return sum(n for _, n, host in self.entries if host is not None)

    def restore(self) -> None:
        """Allocate every storage again and copy its values back (zeros for discarded ones). When the device runs
        out of memory, the storages allocated so far are freed again (everything stays offloaded) and the error
        is raised."""
        done = []
        try:
            for storage, nbytes, _ in self.entries:
                storage.resize_(nbytes)
                done.append(storage)
        except BaseException:
            for storage in done:
                storage.resize_(0)
            raise
        for storage, nbytes, host in self.entries:
            target = _as_bytes(storage, nbytes)
            if host is None:
                target.zero_()
            else:
                target.copy_(host, non_blocking=True)
        if self.entries and self.entries[0][0].device.type == "cuda":
            torch.cuda.synchronize(self.entries[0][0].device)
        self.entries = []
