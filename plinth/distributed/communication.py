"""Collectives the model layers and the pipeline use, over this process's groups.

Layers call these only when their ``tp_size`` is above one, so a single-process model never
touches torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plinth.distributed.parallel_state import get_parallel_state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place; returns ``x``."""
    dist.all_reduce(x, group=get_parallel_state().tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along ``dim`` (rank order)."""
    state = get_parallel_state()
    parts = [torch.empty_like(x) for _ in range(state.layout.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send_async(x: torch.Tensor) -> dist.Work:
    """Start sending ``x`` to the same TP rank of the next stage; wait on the returned work
    before reusing ``x``."""
    layout = get_parallel_state().layout
    assert layout.next_rank is not None, "the last stage sends nothing"
    work = dist.isend(x.contiguous(), dst=layout.next_rank)
    assert work is not None
    return work


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive a tensor of a known shape from the same TP rank of the previous stage."""
    layout = get_parallel_state().layout
    assert layout.prev_rank is not None, "the first stage receives nothing"
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=layout.prev_rank)
    return out
