"""Tensor- and pipeline-parallel process groups of one worker process.

Layout: ``world_size = tp_size * pp_size`` ranks; rank ``r`` is tensor-parallel rank ``r % tp_size``
of pipeline stage ``r // tp_size``, so the ranks of one stage are neighbours (on one host they
share the fastest links). Each stage has a TP group; each TP rank index has a PP group (the same
TP rank across stages), which pipeline sends and receives use.

The state lives in one module-level object per process, :data:`_STATE`, set once by
:func:`init_parallel_state` when a worker starts and cleared by :func:`destroy_parallel_state`.
On CUDA devices it also holds the TP group's custom all-reduce for small tensors
(:mod:`plinth.distributed.custom_all_reduce`), set up with the groups.
Layers read it only through :mod:`plinth.distributed.communication`, and only when their
``tp_size`` (passed explicitly at construction) is above one; ranks and sizes are always
passed explicitly through :class:`~plinth.model_registry.interface.ModelContext`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Where one rank sits: pure arithmetic, no process groups."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank whose results reach the driver: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def prev_rank(self) -> int | None:
        """The same TP rank in the previous stage (``None`` on the first stage)."""
        return None if self.is_first_stage else self.rank_of(self.pp_rank - 1, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        """The same TP rank in the next stage (``None`` on the last stage)."""
        return None if self.is_last_stage else self.rank_of(self.pp_rank + 1, self.tp_rank)

    @staticmethod
    def output_rank(tp_size: int, pp_size: int) -> int:
        return (pp_size - 1) * tp_size


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """A worker's layout plus its process groups (``None`` where the group would hold one rank).

    ``custom_all_reduce`` is the TP group's :class:`~plinth.distributed.custom_all_reduce.CustomAllReduce`,
    or ``None`` (every TP all-reduce goes to the group's backend).
    """

    layout: ParallelLayout
    backend: str
    tp_group: Any
    pp_group: Any
    custom_all_reduce: Any = None


_STATE: ParallelState | None = None


def get_parallel_state() -> ParallelState:
    """This process's parallel state.

    Raises:
        RuntimeError: :func:`init_parallel_state` has not run in this process.
    """
    if _STATE is None:
        raise RuntimeError("tensor/pipeline parallelism is not initialised in this process "
                           "(plinth.distributed.parallel_state.init_parallel_state runs in each worker)")
    return _STATE


def parallel_state_or_none() -> ParallelState | None:
    return _STATE


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split, the first stages take the remainder
    (the last stage also runs the final norm and the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def init_parallel_state(layout: ParallelLayout, backend: str, store: Any, timeout_s: float,
                        device: torch.device | None = None) -> ParallelState:
    """Join the world's process group and create the TP and PP groups. Once per process.

    Args:
        layout: this rank's place.
        backend: the platform's torch.distributed backend (``gloo``, ``nccl``, ``xccl``, ...).
        store: a ``torch.distributed.Store`` every rank of the world reaches.
        timeout_s: the bound on every collective (a peer that never answers fails the call).
        device: this rank's device; a CUDA device with TP > 1 also sets up the TP group's custom
            all-reduce (collective over the TP group, falls back to the backend's on any failure).

    Raises:
        RuntimeError: the state is already set in this process.
        ConfigError: ``PLINTH_CUSTOM_ALL_REDUCE`` holds no switch value.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("the parallel state is already initialised in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.world_size, timeout=timeout)
    tp_group = pp_group = None
    # every rank creates every group, in the same order (torch.distributed requires it)
    for pp in range(layout.pp_size):
        ranks = [layout.rank_of(pp, t) for t in range(layout.tp_size)]
        group = dist.new_group(ranks, timeout=timeout) if layout.tp_size > 1 else None
        if pp == layout.pp_rank:
            tp_group = group
    for t in range(layout.tp_size):
        ranks = [layout.rank_of(p, t) for p in range(layout.pp_size)]
        group = dist.new_group(ranks, timeout=timeout) if layout.pp_size > 1 else None
        if t == layout.tp_rank:
            pp_group = group
    _STATE = ParallelState(layout, backend, tp_group, pp_group)
    if device is not None and tp_group is not None:
        from plinth.distributed.custom_all_reduce import create_custom_all_reduce

        _STATE = dataclasses.replace(_STATE, custom_all_reduce=create_custom_all_reduce(tp_group, device))
    logger.debug("rank %d (pid %d): tp %d/%d, pp %d/%d over %s", layout.rank, os.getpid(), layout.tp_rank,
                 layout.tp_size, layout.pp_rank, layout.pp_size, backend)
    return _STATE


def destroy_parallel_state() -> None:
    """Leave the process groups (safe to call when none were created)."""
    global _STATE
    if _STATE is not None and _STATE.custom_all_reduce is not None:
        _STATE.custom_all_reduce.close()   # its peer mappings go before the group does
    _STATE = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
