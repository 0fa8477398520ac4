"""The plugin's own GEMM kernel: torch's int8 weight matmul (``aten._weight_int8pack_mm``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support


class Int8PackMMKernel(GemmKernel):
    """``x @ (int8 w * per-channel scale).T`` in one fused op (CPU and Apple GPUs)."""

    name: ClassVar[str] = "int8pack_mm"
    priority: ClassVar[int] = 10

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int" or problem.bits != 8 or not problem.symmetric:
            return Support.no("runs symmetric 8-bit integer weights only")
        if problem.group_size is not None:
            return Support.no("needs one scale per output channel")
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return Support.no("this torch build has no aten._weight_int8pack_mm")
        if problem.device_type not in ("cpu", "mps"):
            return Support.no(f"aten._weight_int8pack_mm runs on cpu and mps, not {problem.device_type!r}")
        odd = sorted({k for _n, k in problem.shapes if k % 16})
        if problem.dtype == torch.bfloat16 and odd:
            # torch's bfloat16 CPU kernel reads past the end of such rows: wrong values, or a crash
            return Support.no(f"in bfloat16 needs input sizes that are multiples of 16, not {odd[0]}")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        signed = (weights.q.to(torch.int16) - 128).to(torch.int8).contiguous()   # [N, K]
        return {"int8_weight": signed, "int8_scales": weights.scales.reshape(-1).to(self.problem.dtype)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, layer.int8_weight, layer.int8_scales)   # [M, N]
        return out if bias is None else out + bias
