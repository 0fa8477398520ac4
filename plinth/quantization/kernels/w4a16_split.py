"""A W4A16 candidate that runs decode-sized inputs and prefill-sized inputs through different kernels.

torch's tiled int4 matmul (:class:`~plinth.quantization.kernels.int4pack.TorchInt4PackKernel`) streams
the weights fastest for one to four rows, but its time grows with the rows (on an H200, 34 us for the
Llama-3-8B gate/up product at one row, 80 us at eight, 138 us at sixteen); the Triton kernels
(:class:`~plinth.quantization.kernels.w4a16_triton.TritonW4A16Kernel`: a tensor-core kernel whose
time barely moves up to 16 rows, 50-55 us there, then the tiled GEMM) take everything longer. This
kernel keeps both layouts of every layer (twice the packed bytes: still half of bfloat16) and picks by
row count. Selection times it like any other candidate, so it is used only
where the pair beats each kernel alone.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.int4pack import TorchInt4PackKernel
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel

#: inputs of at most this many rows take torch's int4 matmul
DECODE_MAX_ROWS = 4


class SplitW4A16Kernel(GemmKernel):
    """``torch_int4pack`` for inputs of up to :data:`DECODE_MAX_ROWS` rows, ``triton_w4a16`` above."""

    name: ClassVar[str] = "w4a16_split"
    priority: ClassVar[int] = 25

    def __init__(self, problem: GemmProblem):
        super().__init__(problem)
        self.small = TorchInt4PackKernel(problem)
        self.large = TritonW4A16Kernel(problem)

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.device_type == "cpu":
            return Support.no("keeps two weight layouts for GPU decode and prefill; on CPU one kernel serves both")
        for part in (TorchInt4PackKernel, TritonW4A16Kernel):
            answer = part.supports(problem)
            if not answer:
                return Support.no(f"{part.name}: {answer.reason}")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {**self.small.prepare(weights), **self.large.prepare(weights)}

    def decode_tensors(self) -> frozenset[str]:
        return frozenset({"int4_packed", "int4_scales_zeros"})

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.small if x.shape[0] <= DECODE_MAX_ROWS else self.large
        return kernel.apply(layer, x, bias)
