"""Parameters of quantized layers in a checkpoint's packed layout, and how each one shards.

A packed parameter records which of its axes runs over the layer's output features and which over
its input features, and how many features one element covers along each (``PackedLayout``): AWQ's
``qweight`` ``[K, N / 8]`` has ``in_dim=0``, ``out_dim=1, out_per_elem=8``; GPTQ's ``scales``
``[K / g, N]`` have ``in_dim=0, in_per_elem=g``. With that, one loader handles every method under
tensor parallelism and for fused layers (QKV, gate/up): the output axis takes this rank's rows of
the shard at the shard's offset, the input axis this rank's slice for row-parallel layers, and every
cut must fall on an element boundary (otherwise the checkpoint cannot be sharded that way, and the
error says so).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from plinth.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """How a parameter's axes map onto the layer's ``[N_out, K_in]`` weight.

    Attributes:
        out_dim: the axis over output features (``None``: not split by outputs).
        in_dim: the axis over input features (``None``: not split by inputs).
        out_per_elem: output features per element along ``out_dim`` (bit packing).
        in_per_elem: input features per element along ``in_dim`` (bit packing, or the group size).
        per_tensor_ok: a one-element checkpoint tensor is one value for the whole shard (FP8
            per-tensor scales), broadcast over the shard's outputs.
        same_for_all_shards: every shard of a fused layer carries the same tensor (GPTQ ``g_idx``);
            the first is kept and the others must equal it.
        partial_last_ok: an axis taken whole may end inside its last element (FP8 block scales of a
            weight whose rows or columns are not a multiple of the block: ``ceil(N / bn)`` scales).
    """

    out_dim: int | None = None
    in_dim: int | None = None
    out_per_elem: int = 1
    in_per_elem: int = 1
    per_tensor_ok: bool = False
    same_for_all_shards: bool = False
    partial_last_ok: bool = False


def packed_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     layout: PackedLayout) -> nn.Parameter:
    """Register an (uninitialised) packed parameter on ``layer`` with its layout and loader."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.packed_layout = layout  # type: ignore[attr-defined]
    param.weight_loader = functools.partial(load_packed, layer)  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def output_range(layer: nn.Module, shard_id: Any) -> tuple[int, int, int, int]:
    """``(offset in the layer, rows on this rank, first row in the checkpoint tensor, rows in it)``."""
    from plinth.model_registry.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear

    if shard_id is not None:
        if not isinstance(layer, MergedColumnParallelLinear):
            raise ModelLoadError(f"shard {shard_id!r} given to a layer that is not fused")
        offset, size, start = layer._shard_offset_size(shard_id)
        return offset, size, start, layer._full_shard_rows(shard_id)
    n = sum(layer.output_sizes_per_partition)
    if isinstance(layer, ColumnParallelLinear):
        return 0, n, layer.tp_rank * n, n * layer.tp_size
    return 0, n, 0, n


def input_range(layer: nn.Module) -> tuple[int, int, int]:
    """``(first input feature of this rank, features on this rank, features in the checkpoint)``."""
    from plinth.model_registry.layers.linear import RowParallelLinear

    k = layer.input_size_per_partition
    if isinstance(layer, RowParallelLinear):
        return layer.tp_rank * k, k, layer.input_size
    return 0, k, k


def _cut(what: str, axis: int, per_elem: int, start: int, size: int, total: int,
         partial_last_ok: bool = False) -> tuple[int, int, int]:
    if partial_last_ok and start == 0 and size == total:
        whole = -(-total // per_elem)
        return 0, whole, whole
    for value in (start, size, total):
        if value % per_elem:
            raise ModelLoadError(
                f"cannot shard {what}: {value} features on axis {axis} are not a multiple of the "
                f"{per_elem} features one element holds (packing or group size vs tensor parallelism)"
            )
    return start // per_elem, size // per_elem, total // per_elem


def load_packed(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy this rank's part of checkpoint tensor ``loaded`` (of shard ``shard_id``) into ``param``.

    Raises:
        ModelLoadError: a shape that does not fit the layer, a dtype of the wrong kind (or, for an int32
            parameter, any dtype but int32), or a cut that does not fall on an element boundary.
    """
    layout: PackedLayout = param.packed_layout  # type: ignore[attr-defined]
    if loaded.is_floating_point() != param.is_floating_point():
        kind = "floating-point" if param.is_floating_point() else "integer"
        raise ModelLoadError(f"expected a {kind} tensor, checkpoint has {str(loaded.dtype).removeprefix('torch.')}")
    if param.dtype == torch.int32 and loaded.dtype != torch.int32:   # not cast: another width is another layout
        raise ModelLoadError(f"expected an int32 tensor (the published layout of packed words and g_idx), "
                             f"checkpoint has {str(loaded.dtype).removeprefix('torch.')}")
    src, dst = loaded, param.data
    if layout.out_dim is not None:
        offset, size, start, total = output_range(layer, shard_id)
        if layout.per_tensor_ok and src.numel() == 1:
            dst.narrow(layout.out_dim, offset, size).fill_(src.reshape(()).item())
            return
        if layout.per_tensor_ok:
            src = src.reshape(-1)
        c_start, c_size, c_total = _cut("the output axis", layout.out_dim, layout.out_per_elem, start, size, total,
                                       layout.partial_last_ok)
        p_offset = offset // layout.out_per_elem
        if src.dim() != dst.dim() or src.shape[layout.out_dim] != c_total:
            raise ModelLoadError(_mismatch(dst, layout.out_dim, c_total, src))
        src = src.narrow(layout.out_dim, c_start, c_size)
        dst = dst.narrow(layout.out_dim, p_offset, c_size)
    if layout.in_dim is not None:
        start, size, total = input_range(layer)
        c_start, c_size, c_total = _cut("the input axis", layout.in_dim, layout.in_per_elem, start, size, total,
                                       layout.partial_last_ok)
        if src.dim() != dst.dim() or src.shape[layout.in_dim] != c_total:
            raise ModelLoadError(_mismatch(dst, layout.in_dim, c_total, src))
        src = src.narrow(layout.in_dim, c_start, c_size)
    if tuple(src.shape) != tuple(dst.shape):
        raise ModelLoadError(f"shape mismatch: expected {tuple(dst.shape)}, checkpoint has {tuple(loaded.shape)}")
    if layout.same_for_all_shards and getattr(param, "loaded_once", False):
        if not torch.equal(dst, src.to(dst.dtype).to(dst.device)):
            raise ModelLoadError("the fused projections of this layer carry different tensors; plinth fuses "
                                 "them and needs them equal")
        return
    dst.copy_(src)
    param.loaded_once = True  # type: ignore[attr-defined]


def _mismatch(dst: torch.Tensor, axis: int, want: int, src: torch.Tensor) -> str:
    shape = list(dst.shape)
    shape[axis] = want
    return f"shape mismatch: expected {tuple(shape)}, checkpoint has {tuple(src.shape)}"
