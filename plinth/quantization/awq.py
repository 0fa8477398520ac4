"""``awq``: AWQ checkpoints (AutoAWQ's GEMM layout), 4-bit with group-wise zero points.

Per linear layer with ``K`` input and ``N`` output features and group size ``g``:

- ``qweight`` int32 ``[K, N / 8]``: eight output features per word, the code of output ``8j + AWQ_ORDER[i]``
  in bits ``4i .. 4i + 3`` (``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``);
- ``qzeros`` int32 ``[K / g, N / 8]``: zero points, packed the same way;
- ``scales`` float16 ``[K / g, N]``.

``w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. ``quantization_config``: ``{"quant_method": "awq",
"bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}`` (``w_bit``/``q_group_size`` are
accepted too); ``modules_to_not_convert`` names layers kept in floating point.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.formats import IntWeights
from plinth.quantization.int_method import IntWeightMethod
from plinth.quantization.interface import QuantContext
from plinth.quantization.packing import AWQ_ORDER, unpack_int32
from plinth.quantization.params import PackedLayout, packed_parameter


def parse_group_size(value: Any, method: str) -> int | None:
    """``-1`` (or missing) means one group per output channel (``None``)."""
    if value is None or int(value) == -1:
        return None
    if int(value) <= 0:
        raise ConfigError(f"{method}: group_size must be positive or -1, got {value!r}")
    return int(value)


def skip_list(quant_config: dict[str, Any]) -> tuple[str, ...]:
    return tuple(quant_config.get("modules_to_not_convert") or ())


def name_in(name: str, fragments: tuple[str, ...]) -> bool:
    """A checkpoint module name matches an entry of a skip list (a name or a dotted fragment of one)."""
    return any(name == f or f".{f}." in f".{name}." for f in fragments)


def group_params(layer: nn.Module, input_size: int, n: int, group: int | None, per_elem_out: int,
                 zeros_packed: bool, *, zeros_out_dim: int = 1) -> int:
    """Register ``qzeros`` and ``scales`` of an ``[K / g, ...]`` layout; return the number of groups."""
    if group is not None and input_size % group:
        raise ModelLoadError(f"input size {input_size} per rank is not a multiple of the group size {group}")
    groups = 1 if group is None else input_size // group
    in_dim = None if group is None else 0
    zeros_shape = (groups, n // per_elem_out) if zeros_packed else (groups, n)
    packed_parameter(layer, "qzeros", zeros_shape, torch.int32,
                     PackedLayout(in_dim=in_dim, in_per_elem=group or 1, out_dim=zeros_out_dim,
                                  out_per_elem=per_elem_out if zeros_packed else 1))
    packed_parameter(layer, "scales", (groups, n), torch.float32,
                     PackedLayout(in_dim=in_dim, in_per_elem=group or 1, out_dim=1))
    return groups


class AWQMethod(IntWeightMethod):
    """AWQ 4-bit; runs through the W4A16 kernels."""

    name = "awq"

    def __init__(self, ctx: QuantContext, *, group_size: int | None, skip: tuple[str, ...] = ()):
        super().__init__(ctx, bits=4, group_size=group_size, symmetric=False)
        self.skip = skip

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> AWQMethod:
        if quant_config is None:
            raise ConfigError("awq reads AWQ checkpoints; it cannot quantize float weights")
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        if bits != 4:
            raise ConfigError(f"awq: {bits}-bit checkpoints are not supported; AWQ runs 4-bit weights")
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"awq: version {version!r} is not supported; only the GEMM layout is (version 'gemm')")
        if not quant_config.get("zero_point", True):
            raise ConfigError("awq: checkpoints without zero points (zero_point: false) are not supported")
        group = parse_group_size(quant_config.get("group_size", quant_config.get("q_group_size", 128)), "awq")
        return cls(ctx, group_size=group, skip=skip_list(quant_config))

    def applies_to(self, name: str) -> bool:
        return not name_in(name, self.skip)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        n = sum(output_sizes)
        if any(size % 8 for size in output_sizes):
            raise ModelLoadError(f"awq packs 8 output features per word; output sizes {output_sizes} per rank "
                                 f"are not multiples of 8")
        packed_parameter(layer, "qweight", (input_size, n // 8), torch.int32,
                         PackedLayout(in_dim=0, out_dim=1, out_per_elem=8))
        group_params(layer, input_size, n, self.group_size, 8, zeros_packed=True)

    def convert_weights(self, layer: nn.Module) -> IntWeights:
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER).t().contiguous()     # [N, K]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER).t().to(torch.float32)  # [N, G]
        scales = layer.scales.data.t().to(torch.float32)
        return IntWeights(q, scales.contiguous(), zeros.contiguous(), 4, self.group_for(q.shape[1]))
