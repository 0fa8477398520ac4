"""Gated activations."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.kernels import ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for an input of ``2d`` features (fused gate/up output)."""

    def forward(self, x: torch.Tensor, quant: ops.RowQuant | None = None) -> Any:  # [T, 2d] -> [T, d]
        """``quant``: as for :meth:`RMSNorm.forward <plinth.model_registry.layers.layernorm.RMSNorm.forward>`."""
        if x.dim() == 2 and x.stride(-1) == 1 and ops.fused_ops_enabled(x):
            return ops.silu_and_mul(x, quant)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]`` (tanh approximation where ``approximate="tanh"``)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor, quant: ops.RowQuant | None = None) -> torch.Tensor:  # [T, 2d] -> [T, d]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


#: the gated activations of ``config.json``'s ``hidden_act`` / ``hidden_activation`` names
GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu_fast": lambda: GeluAndMul("tanh"),
}
