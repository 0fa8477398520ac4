"""RMSNorm and LayerNorm, each with a variant that adds the residual first and returns the new residual."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` with the checkpoint's zero-centred ``w``.

    The parameter holds ``1 + w`` (added in float32 as the checkpoint loads). It is kept in float32 unless
    the model computes in float32, so that a bfloat16 model scales by the float32 factor and rounds once
    at the end, as Gemma's reference does; a float32 model takes :class:`RMSNorm`'s fused kernels.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        from plinth.model_registry.interface import default_weight_loader

        default_weight_loader(param, loaded.to(torch.float32) + 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quant: ops.RowQuant | None = None) -> Any:
        if self.weight.dtype == x.dtype:
            return super().forward(x, residual, quant)
        if residual is not None:
            x = x + residual
        out = x.to(torch.float32)
        out = (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return out if residual is None else (out, x)


class LayerNorm(nn.Module):
    """``weight * (x - mean) / sqrt(var + eps) (+ bias)`` over the last dimension, computed in float32 (Cohere,
    StableLM). With ``residual`` it first adds it and returns ``(normed, new residual)``, as :class:`RMSNorm` does
    (``quant`` is accepted and ignored: the next GEMM quantizes its input itself). ``weight`` may hold one row per
    head (``hidden_size`` ``(heads, head_dim)``: per-head q/k norms)."""

    #: not an RMSNorm: never the fused all-reduce + RMSNorm kernel
    is_rms_norm = False

    def __init__(self, hidden_size: int | tuple[int, ...], eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: Any = None) -> Any:
        if residual is not None:
            x = x + residual
            residual = x
        if self.weight.dim() == 1 and self.weight.dtype == x.dtype:   # one kernel (it computes in float32 itself)
            y = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
            return y if residual is None else (y, residual)
        y = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(x.dtype)
        return y if residual is None else (y, residual)
