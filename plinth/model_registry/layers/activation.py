"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for an input of ``2d`` features (fused gate/up output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2d] -> [T, d]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
