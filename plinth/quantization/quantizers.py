"""Quantizing float weights while loading (round-to-nearest), and random weights for kernel checks."""

from __future__ import annotations

import torch

from plinth.quantization.formats import FP8_MAX, FP8Weights, IntWeights


def quantize_int_rtn(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> IntWeights:
    """Round-to-nearest integer quantization of ``weight`` ``[N, K]`` with one scale per group.

    Asymmetric: the group's ``[min, max]`` (widened to include 0) maps onto ``[0, 2**bits - 1]``
    with an integer zero point. Symmetric: ``max |w|`` maps onto ``2**(bits-1) - 1`` around the
    fixed zero point ``2**(bits-1)``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the group size {group_size}")
    levels = (1 << bits) - 1
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:
        half = 1 << (bits - 1)
        scales = w.abs().amax(-1) / (half - 1)                          # [N, G]
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.full_like(scales, float(half))
    else:
        lo = w.amin(-1).clamp(max=0.0)
        hi = w.amax(-1).clamp(min=0.0)
        scales = (hi - lo) / levels
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.round(-lo / scales).clamp(0, levels)
    q = torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, levels).to(torch.uint8)
    return IntWeights(q.reshape(n, k), scales, zeros, bits, group_size, symmetric=symmetric)


def quantize_fp8_per_channel(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> FP8Weights:
    """FP8 E4M3 with one float32 scale per output channel (``max |w| / 448``).

    ``row_absmax`` ``[N]``, when given, is each channel's ``max |w|`` over the whole row: a tensor-parallel
    shard of the input features then gets the scales of the unsharded weight.
    """
    w = weight.detach().to(torch.float32)
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.to(torch.float32)
    scale = (absmax / FP8_MAX).clamp(min=1e-12)                         # [N]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weights(q, scale)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> FP8Weights:
    """FP8 E4M3 with one float32 scale per ``(bn, bk)`` block (``max |w| / 448`` over the block; the last blocks
    may cover fewer rows or columns), DeepSeek-V3's checkpoint layout."""
    bn, bk = block
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    padded = w.new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    scale = (padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).abs().amax(dim=(1, 3))
             / FP8_MAX).clamp(min=1e-12)                                  # [ceil(N / bn), ceil(K / bk)]
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weights(q, scale, (bn, bk))


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 activations: ``x`` ``[M, K]`` -> (``[M, K]`` e4m3, ``[M, 1]`` float32 scales)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric INT8 activations: (``[M, K]`` int8, ``[M, 1]`` float32 scales)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def random_int_weights(n: int, k: int, bits: int, group_size: int, *, symmetric: bool, act_order: bool,
                       device: torch.device, generator: torch.Generator) -> IntWeights:
    """Random codes, scales around 0.01 and zero points, for kernel checks and timing."""
    levels = 1 << bits
    groups = k // group_size
    q = torch.randint(0, levels, (n, k), generator=generator, device=device, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, groups, generator=generator, device=device) * 0.01 + 0.005
    if symmetric:
        zeros = torch.full((n, groups), float(levels // 2), device=device)
    else:
        zeros = torch.randint(0, levels, (n, groups), generator=generator, device=device).to(torch.float32)
    perm = torch.randperm(k, generator=generator, device=device) if act_order else None
    return IntWeights(q, scales, zeros, bits, group_size, perm=perm, symmetric=symmetric)


def random_fp8_weights(n: int, k: int, *, device: torch.device, generator: torch.Generator,
                       block: tuple[int, int] | None = None) -> FP8Weights:
    """Random FP8 weights with per-channel scales, or with ``block`` scales."""
    w = torch.randn(n, k, generator=generator, device=device) * 0.02
    return quantize_fp8_per_channel(w) if block is None else quantize_fp8_blocks(w, block)
