"""llama.cpp block types dequantized with torch ops (any device), from ggml's published block layouts.

Each function takes ``[rows, blocks, type_size]`` uint8 blocks and returns ``[rows, blocks * block_len]``
float32. Half-precision fields are little-endian IEEE float16.

======  ===========  =======================================================================
type    block bytes  layout
======  ===========  =======================================================================
Q4_0    2 + 16       d; 32 codes in nibbles (low nibbles: elements 0-15, high: 16-31); w = d (q - 8)
Q4_1    4 + 16       d, m; nibbles as Q4_0; w = d q + m
Q5_0    2 + 4 + 16   d; qh (bit i: 5th bit of element i); nibbles as Q4_0; w = d (q - 16)
Q5_1    4 + 4 + 16   d, m; qh; nibbles; w = d q + m
Q8_0    2 + 32       d; 32 int8; w = d q
Q4_K    144          d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes
                     of nibbles (each 32 bytes: low nibbles sub-block 2j, high 2j+1); w = d sc q - dmin m
Q5_K    176          as Q4_K plus 32 bytes qh (bit 2j / 2j+1 of byte l: 5th bit of element l of
                     sub-block 2j / 2j+1) before the nibbles
Q6_K    210          128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, d;
                     w = d sc (q - 32), 16 sub-blocks of 16
======  ===========  =======================================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plinth.quantization.formats import GGUFShard

#: ggml type ids (gguf.GGMLQuantizationType values; fixed by the file format)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
FLOAT_TYPES = (F32, F16, BF16)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """A float16 field at byte ``start`` of every block -> ``[rows, blocks, 1]`` float32."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles then high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` bytes (a little-endian uint32) -> ``[..., 32]`` bits (bit i at index i)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    bits = (qh[..., :, None] >> shifts) & 1                                  # [..., 4, 8]
    return bits.reshape(*qh.shape[:-1], 32).to(torch.float32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles32(b[..., 2:18]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles32(b[..., 4:20]) + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles32(b[..., 6:22]) + 16 * _high_bits32(b[..., 2:6])
    return _f16(b, 0) * (q - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles32(b[..., 8:24]) + 16 * _high_bits32(b[..., 4:8])
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:34].contiguous().view(torch.int8).to(torch.float32)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes of packed 6-bit values -> ``[..., 8]`` scales and ``[..., 8]`` mins (Q4_K, Q5_K)."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63                         # sub-blocks 0-3
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)                 # sub-blocks 4-7
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).to(torch.float32), torch.cat([lo_m, hi_m], -1).to(torch.float32)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> ``[..., 8, 32]`` codes: chunk j's low nibbles are sub-block 2j, high ones 2j+1."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0xF, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32).to(torch.float32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales_mins(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144])                                           # [..., 8, 32]
    w = _f16(b, 0)[..., None] * sc[..., None] * q - _f16(b, 2)[..., None] * mn[..., None]
    return w.reshape(*b.shape[:-1], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales_mins(b[..., 4:16])
    qh = b[..., 16:48]                                                       # [..., 32]
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    high = ((qh[..., None, :] >> shifts[:, None]) & 1).to(torch.float32)     # [..., 8, 32]
    q = _k_nibbles(b[..., 48:176]) + 16 * high
    w = _f16(b, 0)[..., None] * sc[..., None] * q - _f16(b, 2)[..., None] * mn[..., None]
    return w.reshape(*b.shape[:-1], 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)                      # [half, ql row (l, l+32), 32]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)                       # [half, 32]
    scales = b[..., 192:208].contiguous().view(torch.int8).to(torch.float32)  # [..., 16]
    low = torch.stack([ql & 0xF, ql >> 4], dim=-3)                           # [..., 2(half), 2(nib), 2(row), 32]
    shifts = torch.tensor([[0, 2], [4, 6]], device=b.device, dtype=torch.uint8)  # [nib, row]
    high = (qh[..., :, None, None, :] >> shifts[None, :, :, None]) & 3       # [..., 2(half), 2, 2, 32]
    q = (low | (high << 4)).to(torch.float32) - 32                           # element order: half, nib, row, l
    q = q.reshape(*b.shape[:-1], 16, 16)                                     # 16 sub-blocks of 16
    return (_f16(b, 208)[..., None] * scales[..., None] * q).reshape(*b.shape[:-1], 256)


#: ggml type -> (block length, bytes per block, dequantizer)
BLOCK_TYPES: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    Q4_0: (32, 18, _q4_0), Q4_1: (32, 20, _q4_1), Q5_0: (32, 22, _q5_0), Q5_1: (32, 24, _q5_1),
    Q8_0: (32, 34, _q8_0), Q4_K: (256, 144, _q4_k), Q5_K: (256, 176, _q5_k), Q6_K: (256, 210, _q6_k),
}


def dequantize_blocks(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """``[rows, bytes_per_row]`` uint8 blocks of ``ggml_type`` -> ``[rows, cols]`` float32."""
    block_len, type_size, fn = BLOCK_TYPES[ggml_type]
    rows = data.shape[0]
    blocks = data.reshape(rows, cols // block_len, type_size)
    return fn(blocks).reshape(rows, cols)


def dequantize_shard(shard: GGUFShard, dtype: torch.dtype) -> torch.Tensor:
    """One shard as a ``[rows, cols]`` tensor of ``dtype``."""
    if shard.ggml_type in BLOCK_TYPES:
        return dequantize_blocks(shard.data, shard.ggml_type, shard.cols).to(dtype)
    return shard.data.to(dtype)
