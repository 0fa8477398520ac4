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
    """``-1`` (or missing) means one group per output channel (``None``).

    Raises:
        ConfigError: not an integer (a string, a bool, a float), or neither positive nor -1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise ConfigError(f"{method}: group_size must be a positive integer or -1, got {value!r}")
    return None if value == -1 else value


def config_bits(quant_config: dict[str, Any], keys: tuple[str, ...], allowed: tuple[int, ...], method: str) -> int:
    """The bit width under the first of ``keys`` present (4 where none is).

    Raises:
        ConfigError: not a JSON integer (null, a string, a bool, a float), or not one of ``allowed``."""
    key = next((k for k in keys if k in quant_config), keys[0])
    value = quant_config.get(key, 4)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{method}: {key} must be an integer ({' or '.join(map(str, allowed))} bits), got "
                          f"{value!r}")
    if value not in allowed:
        raise ConfigError(f"{method}: {value}-bit checkpoints are not supported "
                          f"({' and '.join(map(str, allowed))} bits are)")
    return value


def config_flag(quant_config: dict[str, Any], key: str, default: bool, method: str) -> bool:
    """A boolean setting, ``default`` where missing.

    Raises:
        ConfigError: present and not a JSON boolean (``"false"`` or ``0`` is not read as one)."""
    value = quant_config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{method}: {key} must be true or false, got {value!r}")
    return value


def skip_list(quant_config: dict[str, Any], method: str, keys: tuple[str, ...] = ("modules_to_not_convert",)
              ) -> tuple[str, ...]:
    """The module names of the first non-empty list under ``keys`` (layers kept in floating point).

    Raises:
        ConfigError: a value that is not a list of strings (a single string is refused, as transformers and vLLM
            would read it character by character)."""
    key = next((k for k in keys if quant_config.get(k)), None)
    if key is None:
        return ()
    value = quant_config[key]
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) for m in value):
        raise ConfigError(f"{method}: {key} must be a list of module names, got {value!r}")
    return tuple(value)


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
        config_bits(quant_config, ("bits", "w_bit"), (4,), "awq")
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"awq: version {version!r} is not supported; only the GEMM layout is (version 'gemm')")
        if not config_flag(quant_config, "zero_point", True, "awq"):
            raise ConfigError("awq: checkpoints without zero points (zero_point: false) are not supported")
        group = parse_group_size(quant_config.get("group_size", quant_config.get("q_group_size", 128)), "awq")
        return cls(ctx, group_size=group, skip=skip_list(quant_config, "awq"))

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
