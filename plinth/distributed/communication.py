"""Collectives the model layers and the pipeline use, over this process's groups.

Layers call these only when their ``tp_size`` is above one, so a single-process model never
touches torch.distributed. TP all-reduces of small CUDA tensors (decode steps) go through the TP
group's custom all-reduce where one was set up (:mod:`plinth.distributed.custom_all_reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plinth.distributed.parallel_state import get_parallel_state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place; returns ``x``.

    Small CUDA tensors take the group's custom all-reduce (one kernel over peer memory) when it is
    set up; the rest, and every tensor without it, the group's backend (NCCL, gloo, ...).
    """
    state = get_parallel_state()
    if state.custom_all_reduce is not None:
        return state.custom_all_reduce.all_reduce(x)
    dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = sum over the TP group of x, plus residual``: what a decoder layer computes
    after a row-parallel projection. One launch of the custom all-reduce's peer kernel where it takes the
    tensors (bfloat16 decode rows), else the all-reduce, then ``norm(x, residual)``. Both round the same
    values the same way (the sum, then the residual add, then the norm); the norm's sum of squares may be
    added in another order than the Triton kernel's, so the last bit can differ (at hidden size 4096 they
    were equal bit for bit on an H200).

    Args:
        x: ``[T, H]`` this rank's partial sums (may be overwritten).
        residual: ``[T, H]`` the residual stream: the fused kernel updates it in place (the callers pass
            an intermediate of the forward pass, never a tensor they read again), the fallback returns a
            new tensor.
        norm: an :class:`~plinth.model_registry.layers.layernorm.RMSNorm` (``weight``, ``eps``), or a norm with
            ``is_rms_norm = False`` speaking its protocol (a LayerNorm: never the fused kernel).
    """
    comm = get_parallel_state().custom_all_reduce
    if comm is not None and x.dim() == 2 and getattr(norm, "is_rms_norm", True):   # the fused kernel is an RMSNorm
        fused = comm.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
    tp_all_reduce(x)
    return norm(x, residual)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` of the TP group's first rank (TP rank 0 of this stage) on every rank, in place (a no-op
    without a TP group); returns ``x``."""
    state = get_parallel_state()
    if state.tp_group is not None:
        dist.broadcast(x, src=state.layout.rank_of(state.layout.pp_rank, 0), group=state.tp_group)
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


def tp_warm_up(device: torch.device, dtype: torch.dtype, fingerprint: Sequence[int]) -> None:
    """Run the tensor-parallel collectives once, eagerly, on every rank of the TP group, and check that
    every rank describes the same work with ``fingerprint`` (e.g. the batch sizes of the decode graphs
    it will capture, in capture order).

    Called before CUDA graph capture: NCCL builds a communicator on its first collective, which must
    not happen inside a capture, and graphs holding collectives must be captured (and replayed) in
    the same order on every rank. Returns once the collectives have finished on this device.

    Raises:
        RuntimeError: the ranks' fingerprints differ.
    """
    state = get_parallel_state()
    probe = torch.ones(4, dtype=dtype, device=device)
    tp_all_reduce(probe)                                             # [4] == tp_size everywhere
    values = [int(v) for v in fingerprint]
    summary = torch.tensor([len(values), sum(values), sum(v * v for v in values), max(values, default=0)],
                           dtype=torch.int64, device=device)         # [4]: equal-shaped on every rank
    everyone = tp_all_gather(summary.unsqueeze(0), dim=0)            # [tp, 4]
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
    if not bool((everyone == everyone[0]).all()) or not bool((probe == state.layout.tp_size).all()):
        raise RuntimeError(f"tensor-parallel rank {state.layout.tp_rank}: the ranks disagree on the graphs to "
                           f"capture (count, sum, sum of squares, largest of each rank's batch sizes: "
                           f"{everyone.tolist()}); every rank must run the same configuration")
