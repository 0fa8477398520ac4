"""INT8 weight-only quantization made while loading a float checkpoint.

Every linear weight ``[N, K]`` is rounded to int8 with one scale per output channel,
``s[n] = max_k |w[n, k]| / 127``; activations stay in the compute dtype (W8A16). The layers hold
plinth's canonical :class:`~plinth.quantization.formats.IntWeights` (unsigned codes ``q + 128`` with
the zero point at 128), so plinth's dequantize kernel is the reference; this package adds a kernel
of its own (``int8pack_mm``), and plinth's startup selection picks between them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.quantization.formats import IntWeights
from plinth.quantization.interface import QuantContext, QuantizationMethod
from plinth.quantization.kernels.interface import GemmProblem
from plinth.quantization.layers import float_weight, take_row_absmax
from plinth.quantization.quantizers import random_int_weights


def quantize_per_channel(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> IntWeights:
    """``[N, K]`` float -> symmetric int8 codes (stored as ``q + 128``) and ``[N, 1]`` scales.

    ``row_absmax`` ``[N]``: each channel's ``max |w|`` over its whole row where ``weight`` is a tensor-parallel
    shard of the input features (the shards then get the unsharded weight's scales).
    """
    w = weight.detach().to(torch.float32)
    absmax = w.abs().amax(dim=1, keepdim=True) if row_absmax is None else row_absmax.to(torch.float32)[:, None]
    scales = (absmax / 127.0).clamp(min=1e-12)   # [N, 1]
    q = torch.round(w / scales).clamp(-127, 127) + 128
    return IntWeights(q.to(torch.uint8), scales, torch.full_like(scales, 128.0), bits=8,
                      group_size=w.shape[1], symmetric=True)


class Int8WeightOnly(QuantizationMethod):
    """``--quantization int8``: per-channel symmetric INT8 weights, float activations."""

    name = "int8"
    quantizes_float_checkpoints = True
    source_kinds = ("hf_dir", "dummy")

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> Int8WeightOnly:
        if quant_config is not None:
            raise ConfigError("int8 quantizes float checkpoints while loading; this checkpoint is already "
                              f"quantized ({quant_config.get('quant_method')!r})")
        return cls(ctx)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        # The checkpoint is a float one: load it as is, quantize in convert_weights (a row-parallel shard keeps
        # its rows' full maxima, so every tensor-parallel rank has the scales of one process).
        float_weight(layer, self.ctx.dtype, input_size, output_sizes, row_absmax=True)

    def convert_weights(self, layer: nn.Module) -> IntWeights:
        return quantize_per_channel(layer.weight, take_row_absmax(layer))

    def kernel_candidates(self) -> dict[str, str]:
        return {
            "dequant": "plinth.quantization.kernels.dequant:DequantIntKernel",  # the reference
            "int8pack_mm": "plinth_int8.kernels:Int8PackMMKernel",
        }

    def gemm_problem(self, shapes: tuple[tuple[int, int], ...]) -> GemmProblem:
        return GemmProblem(weight_format="int", dtype=self.ctx.dtype, device_type=self.ctx.device.type,
                           capability=self.ctx.capability, bits=8, group_size=None, symmetric=True,
                           shapes=shapes)

    def random_weights(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> IntWeights:
        return random_int_weights(n, k, 8, k, symmetric=True, act_order=False, device=device, generator=generator)
