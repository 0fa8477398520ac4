"""FP8 weights (per-channel or block scales) through a Triton weight-only GEMM (W8A16): the FP8 bytes are read
(half of bfloat16's) and widened in registers, each K tile's product scaled per column by its block's scale;
activations stay in the compute dtype. It runs DeepSeek-style block-scaled checkpoints, which ``fp8_scaled_mm``
(row-wise scales only) does not. NVIDIA GPUs of compute capability 8.9 and newer (Triton converts E4M3 there) and XPU
devices; Triton's interpreter on the CPU in tests."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plinth.kernels.ops import num_sms, triton_fp8_refusal
from plinth.quantization.formats import FP8Weights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.kernels.w4a16_triton import interpret_requested, load_jit_module, triton_refusal

_JIT = "plinth.quantization.kernels.fp8_triton_jit"
_INTERPRETER_SMS = 4


def fp8_tiles(m: int, n: int, k: int, sbk: int, sms: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps)``: ``BLOCK_K`` divides the scale block's columns; decode-sized
    inputs split K until the SMs have work (starting points, not tuned)."""
    block_k = next(b for b in (128, 64, 32, 16) if sbk % b == 0)
    if m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 64, 64, 4
    else:
        block_m, block_n, warps = 128, 128, 8
        block_k = min(block_k, 64)
    tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = -(-k // block_k)
    split = 1
    if m <= 64 and tiles < sms:
        split = max(1, min(k_tiles // 2 or 1, (2 * sms) // max(tiles, 1), 16))
    return block_m, block_n, block_k, split, warps


class TritonFP8Kernel(GemmKernel):
    """FP8 E4M3 weights widened in registers, per-channel or ``(bn, bk)`` block scales (``bk`` a multiple of 16)."""

    name: ClassVar[str] = "triton_fp8"
    priority: ClassVar[int] = 10

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "fp8":
            return Support.no("runs FP8 weights only")
        refused = triton_refusal(problem)
        if refused is not None:
            return refused
        fp8_refused = triton_fp8_refusal(problem.device_type, problem.capability)
        if fp8_refused is not None:
            return Support.no(fp8_refused)
        if problem.block is not None and problem.block[1] % 16:
            return Support.no(f"block scales {problem.block[0]}x{problem.block[1]}: the columns per scale must be a "
                              f"multiple of 16")
        return Support.yes()

    def prepare(self, weights: FP8Weights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        n, k = weights.shape
        scale = weights.scale.to(torch.float32)
        if weights.block is None:
            scale = scale.reshape(n, 1)
        return {"fp8t_weight": weights.weight.view(torch.uint8).contiguous(), "fp8t_scale": scale.contiguous()}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w, s = layer.fp8t_weight, layer.fp8t_scale
        m, k = x.shape
        n = w.shape[0]
        if self.problem.block is None:    # one scale per row: any K tile reads column 0
            sbn, sbk = 1, -(-k // 128) * 128
        else:
            sbn, sbk = self.problem.block
        sms = _INTERPRETER_SMS if interpret_requested() else num_sms(x.device)
        bm, bn, bk, split, warps = fp8_tiles(m, n, k, sbk, sms)
        out = (torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1
               else torch.zeros(m, n, dtype=torch.float32, device=x.device))
        load_jit_module(_JIT).fp8_w8a16_gemm_kernel[(-(-m // bm), -(-n // bn), split)](
            x, w, s, out, m, n, k, x.stride(0), w.stride(0), s.stride(0), s.stride(1), out.stride(0),
            SBN=sbn, SBK=sbk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=3,
        )
        out = out.to(x.dtype)
        return out if bias is None else out + bias
