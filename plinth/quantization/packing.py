"""Bit packing of integer codes into int32 words, in the orders published checkpoints use.

``pack_int32(codes, bits, dim, order)`` packs ``32 // bits`` consecutive codes along ``dim`` into
one int32: code ``order[i]`` of each run goes to bits ``[i * bits, (i + 1) * bits)``. The orders:

- sequential (``order=None``): GPTQ ``qweight`` (along the input axis) and ``qzeros``,
  compressed-tensors ``weight_packed`` at 4 and 8 bits;
- :data:`AWQ_ORDER` ``[0, 2, 4, 6, 1, 3, 5, 7]``: AWQ ``qweight`` and ``qzeros`` (along the output axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: AWQ (GEMM version) stores code ``AWQ_ORDER[i]`` of every eight in nibble ``i``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_factor(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes into int32 words evenly")
    return 32 // bits


def _check_order(order: Sequence[int] | None, per_word: int) -> list[int]:
    if order is None:
        return list(range(per_word))
    if sorted(order) != list(range(per_word)):
        raise ValueError(f"order {list(order)} is not a permutation of 0..{per_word - 1}")
    return list(order)


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Pack unsigned ``codes`` (values in ``[0, 2**bits)``) along ``dim``; that axis shrinks ``32 // bits`` times."""
    per_word = pack_factor(bits)
    order = _check_order(order, per_word)
    dim = dim % codes.dim()
    if codes.shape[dim] % per_word:
        raise ValueError(f"axis {dim} of length {codes.shape[dim]} is not a multiple of {per_word}")
    moved = codes.movedim(dim, -1).to(torch.int64)
    runs = moved.reshape(*moved.shape[:-1], -1, per_word)  # [..., words, per_word]
    word = torch.zeros(runs.shape[:-1], dtype=torch.int64, device=codes.device)
    for slot, src in enumerate(order):
        word |= (runs[..., src] & ((1 << bits) - 1)) << (slot * bits)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """The inverse of :func:`pack_int32`: uint8 codes, ``dim`` grows ``32 // bits`` times."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    per_word = pack_factor(bits)
    order = _check_order(order, per_word)
    dim = dim % words.dim()
    moved = words.movedim(dim, -1)
    out = torch.empty(*moved.shape, per_word, dtype=torch.uint8, device=words.device)
    mask = (1 << bits) - 1
    for slot, dst in enumerate(order):
        out[..., dst] = ((moved >> (slot * bits)) & mask).to(torch.uint8)
    return out.reshape(*moved.shape[:-1], -1).movedim(-1, dim).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` 4-bit codes -> ``[N, K // 2]`` uint8, even ``k`` in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``[N, K // 2]`` uint8 -> ``[N, K]`` uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
