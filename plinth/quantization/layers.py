"""What quantization methods need to know about the model's linear layers."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from plinth.model_registry.weights import default_dtype


def shard_ids(layer: nn.Module) -> tuple[Any, ...]:
    """The checkpoint shards a layer is loaded from: ``("q", "k", "v")``, ``(0, 1)`` or ``(None,)``."""
    for param in layer.parameters(recurse=False):
        shards = getattr(param, "expected_shards", None)
        if shards is not None:
            return tuple(shards)
    return (None,)


def checkpoint_names(model: nn.Module, module_name: str, layer: nn.Module) -> list[str]:
    """The checkpoint module names a layer is loaded from (``...self_attn.q_proj`` etc. for a fused QKV)."""
    out = []
    for shard in shard_ids(layer):
        param_name = f"{module_name}.weight"
        mapped = model.checkpoint_name(param_name, shard) if hasattr(model, "checkpoint_name") else param_name
        out.append(mapped.split(" (shard")[0].removesuffix(".weight"))
    return out


def use_plain_weights(layer: nn.Module, dtype: torch.dtype) -> None:
    """Give a layer that the method does not quantize a plain float ``weight`` again."""
    from plinth.model_registry.layers.linear import UnquantizedLinearMethod

    shards = shard_ids(layer)
    device = next(layer.parameters(recurse=False)).device
    for name in [n for n in layer._parameters if n != "bias"]:
        del layer._parameters[name]
    method = UnquantizedLinearMethod()
    with torch.device(device), default_dtype(dtype):
        method.create_weights(layer, layer.input_size_per_partition, layer.output_sizes_per_partition)
    layer.weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    if shards != (None,):
        layer.weight.expected_shards = shards  # type: ignore[attr-defined]
    layer.linear_method = method


def float_weight(layer: nn.Module, dtype: torch.dtype, input_size: int, output_sizes: list[int], *,
                 row_absmax: bool = False) -> nn.Parameter:
    """A float ``weight`` ``[sum(output_sizes), input_size]`` loaded like an unquantized one (methods that
    quantize float checkpoints while loading).

    ``row_absmax``: on a row-parallel shard (the layer's input features split across ranks) keep each output
    channel's ``max |w|`` over the whole checkpoint row while loading, for :func:`take_row_absmax`: per-channel
    scales made from it are the unsharded weight's, so every rank quantizes as one process would.
    """
    weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
    layer.register_parameter("weight", weight)
    if row_absmax and input_size != getattr(layer, "input_size", input_size):
        weight.weight_loader = functools.partial(_load_float_row_shard, layer)  # type: ignore[attr-defined]
    return weight


def _load_float_row_shard(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, *shard_id: Any) -> None:
    layer.__dict__["row_absmax"] = loaded.detach().abs().amax(dim=1).to(torch.float32)   # [N] over the full row
    layer.weight_loader(param, loaded, *shard_id)


def take_row_absmax(layer: nn.Module) -> torch.Tensor | None:
    """Each output channel's ``max |w|`` over the full checkpoint row ``[N]`` that :func:`float_weight` kept for a
    row-parallel shard (dropped from the layer), else ``None`` (the layer holds whole rows)."""
    return layer.__dict__.pop("row_absmax", None)
