"""RMSNorm, with a variant that adds the residual first and returns the new residual."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plinth.kernels import ops


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype.

    Called with a ``residual`` it computes ``h = x + residual`` and returns
    ``(norm(h), h)``, so a decoder layer keeps one running residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quant: ops.RowQuant | None = None) -> Any:
        """``quant``: the next GEMM takes its input quantized per row (its kernel's
        :attr:`~plinth.quantization.kernels.interface.GemmKernel.input_quant`); the fused kernel then returns
        :class:`~plinth.kernels.ops.QuantizedRows`, other paths the plain output."""
        if x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype and ops.fused_ops_enabled(x) and (
                residual is None or (residual.stride(-1) == 1 and residual.dtype == x.dtype)):
            return ops.rms_norm(x, self.weight, self.eps, residual, quant)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
