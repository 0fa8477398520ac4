"""torch's own W4A16 kernels: ``aten._weight_int4pack_mm`` (CUDA) and ``_weight_int4pack_mm_for_cpu``.

Both compute ``x @ ((q - 8) * scale + zero).T`` from a tiled int4 layout made by
``_convert_weight_to_int4pack[_for_cpu]`` and one ``[K / g, N, 2]`` tensor of (scale, zero) pairs.
Our zero points are in code units (``w = (q - z) * s``), so the additive zero is ``(8 - z) * s``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.dequant import perm_state, permute_input
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support

_GROUPS = (32, 64, 128, 256)
_INNER_K_TILES = {"cuda": 8, "cpu": 2}
_N_MULTIPLE = {"cuda": 8, "cpu": 16}


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


class TorchInt4PackKernel(GemmKernel):
    """4-bit weights through torch's tiled int4 matmul (tinygemm on CUDA, a vectorised CPU kernel)."""

    name: ClassVar[str] = "torch_int4pack"
    priority: ClassVar[int] = 10

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int" or problem.bits != 4:
            return Support.no("runs 4-bit integer weights only")
        device = problem.device_type
        if device == "cuda":
            if not _has_op("_weight_int4pack_mm"):
                return Support.no("this torch build has no aten._weight_int4pack_mm")
            if problem.capability is None or problem.capability < (8, 0):
                return Support.no(f"needs compute capability 8.0 or newer, this GPU has {problem.capability}")
            if problem.dtype != torch.bfloat16:
                return Support.no(f"the CUDA kernel takes bfloat16 activations, not {problem.dtype}")
        elif device == "cpu":
            if not _has_op("_weight_int4pack_mm_for_cpu"):
                return Support.no("this torch build has no aten._weight_int4pack_mm_for_cpu")
        else:
            return Support.no(f"torch's int4 packed matmul runs on cuda and cpu, not {device!r}")
        if problem.group_size not in _GROUPS:
            return Support.no(f"group size {problem.group_size} unsupported ({', '.join(map(str, _GROUPS))})")
        tile, rows = 16 * _INNER_K_TILES[device], _N_MULTIPLE[device]
        for n, k in problem.shapes:
            if k % tile or n % rows:
                return Support.no(f"shape N={n}, K={k}: needs K % {tile} == 0 and N % {rows} == 0")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        q = weights.q
        device = q.device.type
        if device == "cuda":
            nibbles = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()   # [N, K/2], even k high
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, _INNER_K_TILES["cuda"])
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                        _INNER_K_TILES["cpu"])
        scales = weights.scales.to(torch.float32)                                     # [N, G]
        additive = (8.0 - weights.zeros) * scales
        pairs = torch.stack([scales, additive], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
        return {"int4_packed": packed, "int4_scales_zeros": pairs.to(self.problem.dtype), **perm_state(weights)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = permute_input(layer, x)
        k = x.shape[1]
        group = k // layer.int4_scales_zeros.shape[0]
        if x.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(x, layer.int4_packed, group, layer.int4_scales_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.int4_packed, group, layer.int4_scales_zeros)
        return out if bias is None else out + bias
