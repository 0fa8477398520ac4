"""W8A8 FP8 through ``torch._scaled_mm``: dynamic per-token activation scales, per-channel weight scales.

Each call quantizes the activations to E4M3 with one scale per row (one fused Triton kernel on GPUs,
:func:`plinth.kernels.ops.quantize_rows`; or the RMSNorm or SiLU-and-mul kernel before the layer wrote them
so, :attr:`ScaledMMFP8Kernel.input_quant`), then runs the FP8 tensor-core
GEMM with row-wise scales on both sides (CUDA compute capability 8.9 and newer: Ada, Hopper, ...).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plinth.kernels import ops
from plinth.quantization.formats import FP8Weights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.quantizers import FP8_MAX, quantize_fp8_tokens

_MIN_CAPABILITY = (8, 9)


class ScaledMMFP8Kernel(GemmKernel):
    """FP8 E4M3 weights and per-token FP8 activations on FP8 tensor cores."""

    name: ClassVar[str] = "fp8_scaled_mm"
    priority: ClassVar[int] = 20
    input_quant: ClassVar[ops.RowQuant] = ops.RowQuant(torch.float8_e4m3fn, FP8_MAX)

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "fp8":
            return Support.no("runs FP8 weights only")
        if problem.device_type != "cuda":
            return Support.no(f"torch._scaled_mm FP8 GEMMs need an NVIDIA GPU, not {problem.device_type!r}")
        if getattr(torch.version, "hip", None):
            return Support.no("ROCm uses the float8_e4m3fnuz format, not float8_e4m3fn")
        if problem.capability is None or problem.capability < _MIN_CAPABILITY:
            return Support.no(f"needs FP8 tensor cores (compute capability 8.9 or newer), this GPU has "
                              f"{problem.capability}")
        if problem.block is not None:
            return Support.no("block-wise weight scales need a block-scaled kernel; only per-channel scales run here")
        if problem.dtype != torch.bfloat16:
            return Support.no(f"row-wise scaled FP8 GEMMs output bfloat16, not {problem.dtype}")
        for n, k in problem.shapes:
            if n % 16 or k % 16:
                return Support.no(f"shape N={n}, K={k}: both must be multiples of 16")
        return Support.yes()

    def prepare(self, weights: FP8Weights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {
            "fp8_weight_t": weights.weight.t(),                                   # [K, N], column-major
            "fp8_scale_row": weights.scale.to(torch.float32).reshape(1, -1).contiguous(),  # [1, N]
        }

    def apply(self, layer: nn.Module, x: torch.Tensor | ops.QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, ops.QuantizedRows):   # quantized by the kernel before (RMSNorm, SiLU-and-mul)
            xq, x_scale = x
        elif ops.fused_ops_enabled(x):   # one Triton pass per row instead of eight float32 tensor ops
            xq, x_scale = ops.quantize_rows(x, torch.float8_e4m3fn, FP8_MAX)     # [M, K], [M, 1]
        else:
            xq, x_scale = quantize_fp8_tokens(x)
        out = torch._scaled_mm(xq, layer.fp8_weight_t, scale_a=x_scale, scale_b=layer.fp8_scale_row,
                               out_dtype=self.problem.dtype)
        return out if bias is None else out + bias
