"""GGUF layers computed by expanding their llama.cpp blocks on every call (torch ops, any device)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.quantization.formats import GGUFWeights
from plinth.quantization.kernels.gguf_blocks import dequantize_shard
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support


class GGUFDequantKernel(GemmKernel):
    """Each shard's blocks -> the compute dtype, concatenated, then one ``F.linear``."""

    name: ClassVar[str] = "gguf_dequant"
    priority: ClassVar[int] = 0

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "gguf":
            return Support.no("runs GGUF blocks only")
        return Support.yes()

    def prepare(self, weights: GGUFWeights) -> dict[str, Any]:  # type: ignore[override]
        state: dict[str, Any] = {f"gguf_blocks_{i}": s.data for i, s in enumerate(weights.shards)}
        state["gguf_shards"] = [(s.ggml_type, s.rows, s.cols) for s in weights.shards]
        return state

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        parts = []
        for i, (ggml_type, rows, cols) in enumerate(layer.gguf_shards):
            shard = _Shard(ggml_type, getattr(layer, f"gguf_blocks_{i}"), rows, cols)
            parts.append(dequantize_shard(shard, x.dtype))                 # [rows, K]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts, 0)     # [N, K]
        return F.linear(x, weight, bias)


class _Shard:
    __slots__ = ("ggml_type", "data", "rows", "cols")

    def __init__(self, ggml_type: int, data: torch.Tensor, rows: int, cols: int):
        self.ggml_type, self.data, self.rows, self.cols = ggml_type, data, rows, cols
