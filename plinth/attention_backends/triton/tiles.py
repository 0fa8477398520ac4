"""Tile sizes and split counts for the Triton kernels: pure host arithmetic, no Triton import."""

from __future__ import annotations

import dataclasses
import functools

import torch

#: the largest head the kernels take: DeepSeek's multi-head latent attention pages one head of 512 + 64 features
#: (padded to 1024 in the kernels' registers; the loads are masked)
MAX_HEAD_SIZE = 576
#: query heads one program computes on a head wider than 256 (their accumulators fill the registers)
MAX_WIDE_GROUP = 16
#: the most KV splits one decode row is divided into
MAX_DECODE_SPLITS = 32
#: programs per streaming multiprocessor the decode grid aims for, for short and long contexts:
#: on an H200 (32/8 heads, d=128, bf16) batch 64 x 2k ran best unsplit (3.7 TB/s against 3.3
#: with 3 splits), while batch 16 x 8k went from 1.7 TB/s unsplit to 3.0-3.3 with 12-32 splits
DECODE_PROGRAMS_PER_SM = 2
DECODE_PROGRAMS_PER_SM_LONG = 8
#: a capacity bound above this many tokens counts as a long context
DECODE_LONG_CONTEXT = 4096


LOG2E = 1.4426950408889634   # the kernels keep scores in log2 units (exp2)


def soft_cap_args(soft_cap: float | None) -> dict:
    """The attention kernels' keywords for attention-logit soft-capping (none when off)."""
    if soft_cap is None:
        return {}
    return {"soft_cap": float(soft_cap) * LOG2E, "SOFT_CAP": True}


def sinks_args(sinks: torch.Tensor | None) -> dict:
    """The kernels' SINKS arguments (none without sinks): ``[num_heads]`` float32, contiguous."""
    if sinks is None:
        return {}
    assert sinks.dtype == torch.float32 and sinks.is_contiguous()
    return {"sinks_ptr": sinks, "SINKS": True}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def latent_head_chunks(num_heads: int, num_kv_heads: int, head_size: int) -> int:
    """Into how many programs the query heads of a single KV head wider than 256 are split (1: not split): the
    kernels then see that head repeated (a stride-0 view), each copy serving at most :data:`MAX_WIDE_GROUP` query
    heads (DeepSeek-V3's 128 heads on one latent head would not fit one program)."""
    group = num_heads // num_kv_heads
    if num_kv_heads != 1 or head_size <= 256 or group <= MAX_WIDE_GROUP:
        return 1
    chunks = cdiv(group, MAX_WIDE_GROUP)
    while group % chunks:
        chunks += 1
    return chunks


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    block_m: int      # rows of one program: block_q query tokens x group query heads (padded)
    block_q: int      # query tokens of one program
    block_n: int      # keys per inner-loop tile
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    block_g: int      # query heads of one KV head, padded to a dot-friendly size
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=64)
def prefill_tiles(head_size: int, group: int, dtype: torch.dtype, interpret: bool) -> PrefillTiles:
    """Pick the prefill tile for a head size, a GQA group size and a dtype."""
    block_d = next_power_of_2(head_size)
    # measured on an H200 (bf16, 32/8 heads, 4k causal): benchmarks/attention_kernels.py --sweep
    if interpret:
        block_m, block_n, warps, stages = 32, 16, 4, 1
    elif block_d > 256:   # latent heads: small tiles keep a [BLOCK_M, 1024] accumulator and its operands on chip
        block_m, block_n, warps, stages = (16, 16, 8, 1) if dtype == torch.float32 else (32, 16, 8, 1)
    elif dtype == torch.float32:
        block_m, block_n, warps, stages = (32, 32, 4, 1) if block_d >= 256 else (64, 32, 4, 2)
    elif block_d >= 256:
        block_m, block_n, warps, stages = 128, 64, 8, 2   # 364 TFLOP/s (64x32: 296)
    elif block_d >= 128:
        block_m, block_n, warps, stages = 64, 64, 4, 2    # 317 TFLOP/s (128x64: 290)
    else:
        block_m, block_n, warps, stages = 64, 128, 4, 3   # 265 TFLOP/s
    block_m = max(block_m, next_power_of_2(group))
    return PrefillTiles(block_m, block_m // group, block_n, warps, stages)


@functools.lru_cache(maxsize=64)
def decode_tiles(head_size: int, group: int, dtype: torch.dtype, interpret: bool) -> DecodeTiles:
    """Pick the split-KV decode tile for a head size, a GQA group size and a dtype."""
    block_d = next_power_of_2(head_size)
    block_g = max(16, next_power_of_2(group))
    if interpret:
        return DecodeTiles(block_g, 16, 4, 1)
    if block_d > 256:
        return DecodeTiles(block_g, 16, 8, 1)
    if dtype == torch.float32 or block_d != 128:
        return DecodeTiles(block_g, 32, 4, 2)
    return DecodeTiles(block_g, 64, 4, 2)


@functools.lru_cache(maxsize=256)
def decode_splits(num_seqs: int, num_kv_heads: int, max_kv_tokens: int, block_n: int, num_sms: int) -> int:
    """How many KV ranges each (sequence, KV head) of a decode step is split into.

    Depends only on the batch size, the head count and the cache-capacity bound
    (``max_blocks_per_seq * block_size``), never on the sequence lengths, so one captured
    decode graph stays valid for every step of its batch size.
    """
    max_tiles = max(1, cdiv(max_kv_tokens, block_n))
    per_sm = DECODE_PROGRAMS_PER_SM_LONG if max_kv_tokens > DECODE_LONG_CONTEXT else DECODE_PROGRAMS_PER_SM
    wanted = cdiv(per_sm * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_tiles, MAX_DECODE_SPLITS))
