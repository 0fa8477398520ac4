"""``compressed-tensors``: checkpoints written by the ``compressed-tensors`` library (llm-compressor).

The ``quantization_config`` (``quant_method: "compressed-tensors"``) is read with the library's own
``QuantizationConfig``; every quantized linear layer must share one scheme. Supported schemes:

===================  ======================================================  =========================
format               tensors per layer                                       runs as
===================  ======================================================  =========================
``pack-quantized``   ``weight_packed`` int32 ``[N, K * b / 32]`` (b = 4, 8),   W4A16 / W8A16 integer
                     ``weight_scale`` ``[N, K / g]`` or ``[N, 1]``,           weights (group or channel)
                     ``weight_zero_point`` int32 ``[N * b / 32, K / g]``
                     (asymmetric only), ``weight_shape``
``int-quantized``    ``weight`` int8 ``[N, K]``, ``weight_scale``,            INT8 weights; with dynamic
(``naive-``)         ``weight_zero_point`` (asymmetric)                      per-token INT8 activations
                                                                             W8A8 (``torch_int_mm``)
``float-quantized``  ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale``    FP8 W8A8, as ``fp8``
                     ``[N, 1]`` (channel), one value (tensor) or blocks
===================  ======================================================  =========================

Codes are stored signed (``q`` in ``[-2**(b-1), 2**(b-1))``, packed with an offset of ``2**(b-1)``),
``w = (q - z) * s``; packed words are unpacked with the library's ``unpack_from_int32``. Static
activation scales (``input_scale``) are read and not used: activations are scaled per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.formats import FP8Weights, IntWeights
from plinth.quantization.fp8 import (
    FP8Method,
    create_fp8_checkpoint_weights,
    fp8_checkpoint_weights,
)
from plinth.quantization.int_method import IntWeightMethod
from plinth.quantization.interface import QuantContext
from plinth.quantization.params import PackedLayout, input_range, output_range, packed_parameter

PACKED = "pack-quantized"
INT = ("int-quantized", "naive-quantized")
FLOAT = "float-quantized"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One compressed-tensors scheme, reduced to what plinth needs."""

    format: str
    weight_type: str            # "int" or "float"
    bits: int
    strategy: str               # "group", "channel", "tensor", "block"
    group_size: int | None
    symmetric: bool
    block: tuple[int, int] | None
    activation: str | None      # None (weight-only), "int8_token", "fp8_token"
    static_input: bool          # input_scale (and input_zero_point) tensors present
    input_symmetric: bool = True   # static inputs without input_zero_point tensors


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def _scheme(group: Any, default_format: str | None) -> Scheme:
    weights, inputs = group.weights, group.input_activations
    fmt = _value(group.format) or default_format
    if weights is None:
        raise ConfigError("compressed-tensors: schemes without weight quantization are not supported")
    if group.output_activations is not None:
        raise ConfigError("compressed-tensors: output activation quantization is not supported")
    wtype, strategy = _value(weights.type), _value(weights.strategy)
    actorder = _value(weights.actorder)
    if actorder not in (None, "weight", "static"):
        raise ConfigError(f"compressed-tensors: activation ordering {actorder!r} is not supported "
                          f"(checkpoints with actorder 'weight' are)")
    activation, static, input_symmetric = None, False, True
    if inputs is not None:
        itype, istrategy = _value(inputs.type), _value(inputs.strategy)
        # FP8 block weights with dynamic FP8 inputs per group (llm-compressor's FP8_BLOCK scheme): the inputs are
        # scaled per token, as for DeepSeek-style FP8 block checkpoints (quant_method fp8)
        block_groups = itype == "float" and strategy == "block" and istrategy == "group" and inputs.dynamic
        if inputs.num_bits != 8 or itype != wtype or (istrategy not in ("token", "tensor") and not block_groups):
            raise ConfigError(f"compressed-tensors: input activations {itype}{inputs.num_bits} per {istrategy} "
                              f"are not supported (8-bit, per token or per tensor, of the weights' type; FP8 per "
                              f"group with FP8 block weights)")
        activation = "fp8_token" if itype == "float" else "int8_token"
        static = not inputs.dynamic
        input_symmetric = bool(inputs.symmetric)
    block = tuple(weights.block_structure) if strategy == "block" and weights.block_structure else None
    return Scheme(fmt, wtype, int(weights.num_bits), strategy, weights.group_size, bool(weights.symmetric),
                  block, activation, static, input_symmetric)


def _check_group_sizes(quant_config: dict[str, Any]) -> None:
    """Each scheme's ``group_size`` is an integer or null (the library's validator compares it with -1 as it is: a
    string raised a TypeError there)."""
    groups = quant_config.get("config_groups")
    for name, group in groups.items() if isinstance(groups, dict) else ():
        for role in ("weights", "input_activations", "output_activations"):
            args = group.get(role) if isinstance(group, dict) else None
            value = args.get("group_size") if isinstance(args, dict) else None
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"compressed-tensors: config_groups.{name}.{role}.group_size must be an integer "
                                  f"(or null), got {value!r}")


def parse_config(quant_config: dict[str, Any]) -> tuple[Scheme, list[list[str]], list[str]]:
    """(the one scheme, each group's targets, the ignore list) of a ``quantization_config``.

    Raises:
        ConfigError: the library is missing, the config is invalid, or it holds several schemes,
            KV-cache quantization, sparsity or transforms.
    """
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as exc:
        raise ConfigError("compressed-tensors checkpoints need the compressed-tensors package "
                          "(pip install compressed-tensors)") from exc
    _check_group_sizes(quant_config)
    try:
        config = QuantizationConfig.model_validate(quant_config)
    except ValueError as exc:
        raise ConfigError(f"compressed-tensors: invalid quantization_config: {exc}") from exc
    for key in ("sparsity_config", "transform_config"):
        if quant_config.get(key):
            raise ConfigError(f"compressed-tensors: checkpoints with a {key} are not supported")
    if config.kv_cache_scheme is not None:
        raise ConfigError("compressed-tensors: checkpoints with KV-cache quantization (kv_cache_scheme) and their "
                          "calibrated scales are not supported; quantize the weights only and run with "
                          "--kv-cache-dtype fp8 (a scale of 1)")
    status = str(_value(config.quantization_status))
    if status != "compressed":
        raise ConfigError(f"compressed-tensors: quantization_status {status!r}: only compressed checkpoints load")
    schemes = {_scheme(g, _value(config.format)) for g in config.config_groups.values()}
    if len(schemes) != 1:
        raise ConfigError(f"compressed-tensors: {len(schemes)} different schemes in one checkpoint; plinth runs "
                          f"checkpoints whose quantized layers share one scheme")
    return schemes.pop(), [list(g.targets) for g in config.config_groups.values()], list(config.ignore or [])


def _matches(name: str, patterns: list[str]) -> bool:
    from compressed_tensors.utils.match import match_name

    # "Linear" names a module class: every linear layer plinth quantizes is one.
    return any(p == "Linear" or match_name(name, p) for p in patterns)


class _Targets:
    """Which checkpoint modules a compressed-tensors config quantizes."""

    def __init__(self, targets: list[list[str]], ignore: list[str]):
        self.targets, self.ignore = targets, ignore

    def __call__(self, name: str) -> bool:
        return any(_matches(name, t) for t in self.targets) and not _matches(name, self.ignore)


def _load_weight_shape(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """``weight_shape`` only confirms the shard's full ``[N, K]``."""
    _off, _size, _start, rows = output_range(layer, shard_id)
    cols = input_range(layer)[2]
    if [int(v) for v in loaded.reshape(-1).tolist()] != [rows, cols]:
        raise ModelLoadError(f"weight_shape {loaded.tolist()} does not match the layer's [{rows}, {cols}]")


def _absorb(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Static activation scales and zero points are read and not used (activations are scaled per token)."""


class CompressedTensorsMethod(IntWeightMethod):
    """Integer schemes (pack-quantized W4A16/W8A16, int-quantized INT8 W8A16/W8A8).

    ``from_config`` returns a :class:`CompressedTensorsFP8` instead for float-quantized checkpoints.
    """

    name = "compressed-tensors"

    def __init__(self, ctx: QuantContext, scheme: Scheme, targets: _Targets):
        super().__init__(ctx, bits=scheme.bits, group_size=scheme.group_size if scheme.strategy == "group" else None,
                         symmetric=scheme.symmetric, activation=scheme.activation)
        self.scheme = scheme
        self.targets = targets

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> Any:
        if quant_config is None:
            raise ConfigError("compressed-tensors reads checkpoints written by that library; it cannot quantize "
                              "float weights")
        scheme, targets, ignore = parse_config(quant_config)
        if scheme.format == FLOAT and scheme.weight_type == "float" and scheme.bits == 8:
            if scheme.strategy not in ("channel", "tensor", "block"):
                raise ConfigError(f"compressed-tensors: FP8 weights per {scheme.strategy} are not supported")
            return CompressedTensorsFP8(ctx, scheme, _Targets(targets, ignore))
        if scheme.weight_type != "int" or scheme.format not in (PACKED, *INT):
            raise ConfigError(f"compressed-tensors: format {scheme.format!r} with {scheme.weight_type} weights is "
                              f"not supported (pack-quantized, int-quantized, float-quantized)")
        if scheme.bits not in (4, 8) or (scheme.format in INT and scheme.bits != 8):
            raise ConfigError(f"compressed-tensors: {scheme.bits}-bit {scheme.format} weights are not supported "
                              f"(pack-quantized 4 or 8 bits, int-quantized 8 bits)")
        if scheme.strategy not in ("group", "channel"):
            raise ConfigError(f"compressed-tensors: integer weights per {scheme.strategy} are not supported "
                              f"(group, channel)")
        if scheme.activation == "fp8_token":
            raise ConfigError("compressed-tensors: integer weights with FP8 activations are not supported")
        return cls(ctx, scheme, _Targets(targets, ignore))

    def applies_to(self, name: str) -> bool:
        return self.targets(name)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        s, n, k = self.scheme, sum(output_sizes), input_size
        group = self.group_size
        if group is not None and k % group:
            raise ModelLoadError(f"input size {k} per rank is not a multiple of the group size {group}")
        groups = 1 if group is None else k // group
        scale_layout = PackedLayout(out_dim=0, in_dim=None if group is None else 1, in_per_elem=group or 1)
        if s.format == PACKED:
            per_word = 32 // s.bits
            packed_parameter(layer, "weight_packed", (n, k // per_word), torch.int32,
                             PackedLayout(out_dim=0, in_dim=1, in_per_elem=per_word))
            if not s.symmetric:
                packed_parameter(layer, "weight_zero_point", (n // per_word, groups), torch.int32,
                                 dataclasses.replace(scale_layout, out_per_elem=per_word))
            shape = nn.Parameter(torch.empty(2, dtype=torch.int64), requires_grad=False)
            shape.weight_loader = functools.partial(_load_weight_shape, layer)  # type: ignore[attr-defined]
            layer.register_parameter("weight_shape", shape)
        else:
            packed_parameter(layer, "weight", (n, k), torch.int8, PackedLayout(out_dim=0, in_dim=1))
            if not s.symmetric:
                packed_parameter(layer, "weight_zero_point", (n, groups), torch.int8, scale_layout)
        packed_parameter(layer, "weight_scale", (n, groups), torch.float32, scale_layout)
        if s.static_input:
            for name in ("input_scale",) if s.input_symmetric else ("input_scale", "input_zero_point"):
                # (the zero point is stored as an integer: an integer parameter takes it without a float check)
                param = nn.Parameter(torch.empty((), dtype=torch.int8 if name == "input_zero_point" else torch.float32),
                                     requires_grad=False)
                param.weight_loader = _absorb  # type: ignore[attr-defined]
                layer.register_parameter(name, param)

    def convert_weights(self, layer: nn.Module) -> IntWeights:
        s = self.scheme
        offset = 1 << (s.bits - 1)
        n, groups = layer.weight_scale.shape
        if s.format == PACKED:
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            k = layer.weight_packed.shape[1] * 32 // s.bits
            q = unpack_from_int32(layer.weight_packed.data, s.bits, torch.Size((n, k)))            # int8, signed
            zero = None if s.symmetric else unpack_from_int32(layer.weight_zero_point.data, s.bits,
                                                              torch.Size((n, groups)), packed_dim=0)
        else:
            q, zero = layer.weight.data, None if s.symmetric else layer.weight_zero_point.data
            k = q.shape[1]
        codes = (q.to(torch.int16) + offset).to(torch.uint8)
        zeros = torch.full((n, groups), float(offset), device=q.device) if zero is None \
            else zero.to(torch.float32) + offset
        return IntWeights(codes.contiguous(), layer.weight_scale.data.to(torch.float32).contiguous(), zeros,
                          s.bits, k // groups, symmetric=s.symmetric)


class CompressedTensorsFP8(FP8Method):
    """Float-quantized (FP8 E4M3) compressed-tensors checkpoints, run like ``fp8`` ones."""

    name = "compressed-tensors"
    quantizes_float_checkpoints = False
    block_scale_name = "weight_scale"

    def __init__(self, ctx: QuantContext, scheme: Scheme, targets: _Targets):
        super().__init__(ctx, from_checkpoint=True, block=scheme.block, static_input=scheme.static_input)
        self.scheme = scheme
        self.targets = targets

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> Any:
        return CompressedTensorsMethod.from_config(quant_config, ctx)

    def applies_to(self, name: str) -> bool:
        return self.targets(name)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        create_fp8_checkpoint_weights(layer, input_size, output_sizes, self.block, self.static_input)
        if self.block is not None:  # compressed-tensors names block scales weight_scale too
            layer.register_parameter(self.block_scale_name, layer._parameters.pop("weight_scale_inv"))

    def convert_weights(self, layer: nn.Module) -> FP8Weights:
        if self.block is not None:
            return FP8Weights(layer.weight.view(torch.float8_e4m3fn), layer.weight_scale.to(torch.float32), self.block)
        return fp8_checkpoint_weights(layer, None)
