"""Dequantize-then-matmul kernels: run anywhere, the reference every other kernel is checked against.

Each call expands the layer's weight to the compute dtype and calls ``F.linear``; the layer keeps
only the packed form, so memory stays quantized while time is that of a float GEMM plus the
expansion. Activations stay in the compute dtype (no activation quantization), so for W8A8 methods
these kernels are the more accurate emulation of the checkpoint.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.quantization.formats import FP8Weights, IntWeights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.packing import pack_nibbles, unpack_nibbles


def permute_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x[:, perm]`` for act-order layers (those that hold a ``perm`` tensor)."""
    perm = getattr(layer, "perm", None)
    return x if perm is None else x.index_select(1, perm)


def perm_state(weights: IntWeights) -> dict[str, torch.Tensor]:
    return {} if weights.perm is None else {"perm": weights.perm.to(torch.int64)}


class DequantIntKernel(GemmKernel):
    """Integer weights (4 or 8 bits, any group size, act order) expanded per call."""

    name: ClassVar[str] = "dequant"
    priority: ClassVar[int] = 0

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int":
            return Support.no(f"dequant (int) runs integer weights, not {problem.weight_format!r}")
        if problem.bits not in (4, 8):
            return Support.no(f"{problem.bits}-bit codes unsupported (4 or 8)")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        codes = pack_nibbles(weights.q) if weights.bits == 4 else weights.q.contiguous()
        return {"qcodes": codes, "qscales": weights.scales.to(torch.float32).contiguous(),
                "qzeros": weights.zeros.to(torch.float32).contiguous(), **perm_state(weights)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        codes = unpack_nibbles(layer.qcodes) if self.problem.bits == 4 else layer.qcodes  # [N, K] uint8
        n, k = codes.shape
        groups = layer.qscales.shape[1]
        w = (codes.view(n, groups, k // groups).to(torch.float32) - layer.qzeros[..., None]) \
            * layer.qscales[..., None]                                                  # [N, G, g]
        return F.linear(permute_input(layer, x), w.reshape(n, k).to(x.dtype), bias)


class DequantFP8Kernel(GemmKernel):
    """FP8 weights (per-channel or block scales) expanded per call; activations unquantized."""

    name: ClassVar[str] = "dequant"
    priority: ClassVar[int] = 0

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "fp8":
            return Support.no(f"dequant (fp8) runs FP8 weights, not {problem.weight_format!r}")
        return Support.yes()

    def prepare(self, weights: FP8Weights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"fp8_weight": weights.weight.contiguous(), "fp8_scale": weights.scale.to(torch.float32)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        fp8 = FP8Weights(layer.fp8_weight, layer.fp8_scale, self.problem.block)
        return F.linear(x, fp8.dequantize(x.dtype), bias)
