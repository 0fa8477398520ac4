"""W8A8 INT8 through ``torch._int_mm``: dynamic per-token activation scales, symmetric per-channel weights."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.quantizers import quantize_int8_tokens

#: CUDA's int8 GEMM wants more than 16 rows; smaller batches are padded
_CUDA_MIN_ROWS = 17


class TorchIntMMKernel(GemmKernel):
    """INT8 x INT8 -> INT32 GEMM, rescaled by the token and channel scales."""

    name: ClassVar[str] = "torch_int_mm"
    priority: ClassVar[int] = 10

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int" or problem.bits != 8:
            return Support.no("runs 8-bit integer weights only")
        if problem.activation != "int8_token":
            return Support.no("for W8A8 checkpoints (dynamic per-token INT8 activations) only")
        if not problem.symmetric:
            return Support.no("needs symmetric weights (zero points at 128)")
        if problem.group_size is not None:
            return Support.no("needs per-channel weight scales")
        if problem.device_type not in ("cuda", "cpu"):
            return Support.no(f"torch._int_mm runs on cuda and cpu, not {problem.device_type!r}")
        for n, k in problem.shapes:
            if n % 8 or k % 8:
                return Support.no(f"shape N={n}, K={k}: both must be multiples of 8")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        signed = (weights.q.to(torch.int16) - 128).to(torch.int8)                # [N, K]
        return {"int8_weight_t": signed.t(),                                      # [K, N]
                "int8_scale_row": weights.scales.reshape(1, -1).to(torch.float32)}  # [1, N]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        xq, x_scale = quantize_int8_tokens(x)                                     # [M, K], [M, 1]
        if x.is_cuda and m < _CUDA_MIN_ROWS:
            xq = F.pad(xq, (0, 0, 0, _CUDA_MIN_ROWS - m))
        acc = torch._int_mm(xq, layer.int8_weight_t)[:m]                          # [M, N] int32
        out = (acc.to(torch.float32) * x_scale * layer.int8_scale_row).to(x.dtype)
        return out if bias is None else out + bias
