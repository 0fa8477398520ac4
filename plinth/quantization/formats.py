"""The weight formats GEMM kernels take: one canonical layout per family, whatever the checkpoint.

A quantization method reads its checkpoint's packed tensors and converts them, once, into one of
these records; the selected kernel then repacks the record into its own layout
(:meth:`~plinth.quantization.kernels.interface.GemmKernel.prepare`). Every record can dequantize
itself, which is the reference every kernel is checked against.

- :class:`IntWeights`: integer weights with group-wise scales and zero points (RTN int4, AWQ,
  GPTQ, compressed-tensors pack-/int-quantized, INT8 plugins);
- :class:`FP8Weights`: FP8 E4M3 weights with per-channel or block-wise scales;
- :class:`GGUFWeights`: llama.cpp blocks, one shard per checkpoint tensor of a fused layer.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value


@dataclasses.dataclass
class IntWeights:
    """``w[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]`` (in the *permuted* K order).

    Attributes:
        q: ``[N, K]`` uint8, unsigned codes in ``[0, 2**bits)``.
        scales: ``[N, K // group_size]`` float32.
        zeros: ``[N, K // group_size]`` float32 zero points in code units (``2**(bits-1)`` when
            symmetric).
        bits: 4 or 8.
        group_size: input features per scale (``K`` for per-channel scales).
        perm: ``[K]`` int64 or ``None``. With act order the checkpoint's input features were
            sorted so that groups are contiguous; the layer computes ``x[:, perm] @ w.T``.
        symmetric: every zero point is ``2**(bits-1)``.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    perm: torch.Tensor | None = None
    symmetric: bool = False

    def __post_init__(self) -> None:
        n, k = self.q.shape
        assert self.bits in (4, 8), self.bits
        assert k % self.group_size == 0, (k, self.group_size)
        assert tuple(self.scales.shape) == (n, k // self.group_size), (self.scales.shape, n, k)
        assert tuple(self.zeros.shape) == tuple(self.scales.shape), (self.zeros.shape, self.scales.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight in the checkpoint's (unpermuted) input order."""
        n, k = self.shape
        g = self.group_size
        codes = self.q.view(n, k // g, g).to(torch.float32)
        w = ((codes - self.zeros[..., None]) * self.scales[..., None]).reshape(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)


@functools.cache
def _fp8_table(device: torch.device) -> torch.Tensor:
    """The 256 float8_e4m3fn values as float32, by their byte."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).to(device)


def fp8_to_float32(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``weight`` widened to float32: on CPUs through a 256-entry table (bit-identical to ``.to()``,
    about 2.7x faster on a 2-core AVX2 machine, where the conversion has no vector instruction), elsewhere ``.to()``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_to_float32 reads float8_e4m3fn, not {weight.dtype}")
    if weight.device.type != "cpu":
        return weight.to(torch.float32)
    codes = weight.view(torch.uint8).reshape(-1).to(torch.int32)
    return _fp8_table(weight.device).index_select(0, codes).view(weight.shape)


@dataclasses.dataclass
class FP8Weights:
    """``w = weight.float() * scale`` with per-output-channel or block-wise scales.

    Attributes:
        weight: ``[N, K]`` float8_e4m3fn.
        scale: ``[N]`` float32 per output channel, or ``[ceil(N / bn), ceil(K / bk)]`` per block.
        block: ``(bn, bk)`` for block-wise scales, ``None`` for per-channel.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        w = fp8_to_float32(self.weight)
        if self.block is None:
            return (w * self.scale[:, None]).to(dtype)
        bn, bk = self.block
        scale = self.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
        return (w * scale).to(dtype)


@dataclasses.dataclass
class GGUFShard:
    """One checkpoint tensor of a (possibly fused) layer, as llama.cpp stored it.

    Attributes:
        ggml_type: the ``gguf.GGMLQuantizationType`` value.
        data: ``[rows, bytes_per_row]`` uint8 blocks; for float types (F32/F16/BF16, or types kept
            dequantized) a ``[rows, cols]`` float tensor.
        rows, cols: the dequantized shape.
    """

    ggml_type: int
    data: torch.Tensor
    rows: int
    cols: int


@dataclasses.dataclass
class GGUFWeights:
    """The shards of one layer, in output-row order (q, k, v or gate, up, or a single one)."""

    shards: list[GGUFShard]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.rows for s in self.shards), self.shards[0].cols

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from plinth.quantization.kernels.gguf_blocks import dequantize_shard

        return torch.cat([dequantize_shard(s, torch.float32) for s in self.shards], 0).to(dtype)


QuantizedWeights = IntWeights | FP8Weights | GGUFWeights
