"""Linear layers that own their weight loading and tensor-parallel sharding.

Each layer holds the shard of the weight its rank computes with and knows how to cut a
full checkpoint tensor down to that shard (``weight_loader``). Fused layers (QKV, gate/up)
take each checkpoint projection with a shard id and place it at its offset.

The matmul itself is delegated to a *linear method*: :class:`UnquantizedLinearMethod` by
default; a quantization method may provide another one (``quant_method.get_linear_method(layer)``
returning an object with the same three methods), which is the hook point for quantized GEMMs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.distributed.communication import tp_all_reduce
from plinth.errors import ModelLoadError


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def _check_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ModelLoadError(f"shape mismatch: expected {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")


class UnquantizedLinearMethod:
    """Plain ``y = x W^T + b`` with a weight of the layer's dtype."""

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        """Create ``layer.weight`` of shape ``[sum(output_sizes), input_size]`` (already per-rank sizes)."""
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size), requires_grad=False)
        layer.register_parameter("weight", weight)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Nothing to repack for plain weights."""


def _linear_method(quant_method: Any, layer: LinearBase) -> Any:
    if quant_method is None:
        return UnquantizedLinearMethod()
    return quant_method.get_linear_method(layer)


class LinearBase(nn.Module):
    """A linear layer whose ``weight`` (and ``bias``) are this rank's shard.

    Args:
        input_size: full input features.
        output_size: full output features.
        bias: whether the layer has a bias.
        tp_rank, tp_size: this rank and the tensor-parallel world size.
        quant_method: ``None`` or an object with ``get_linear_method(layer)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp_rank: int = 0,
                 tp_size: int = 1, quant_method: Any = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.lora: Any = None   # a plinth.lora.layers.LinearLoRA once LoRA adapters are enabled
        self.input_size_per_partition, self.output_sizes_per_partition = self._partition_sizes()
        self.linear_method = _linear_method(quant_method, self)
        self.linear_method.create_weights(self, self.input_size_per_partition, self.output_sizes_per_partition)
        for param in self.parameters(recurse=False):  # ``weight``, or a quantized method's packed tensors
            if not hasattr(param, "weight_loader"):
                self._set_loader(param)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes_per_partition)), requires_grad=False)
            self._set_loader(self.bias)
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> tuple[int, list[int]]:
        return self.input_size, [self.output_size]

    def _set_loader(self, param: nn.Parameter) -> None:
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.linear_method.apply(self, x, bias)
        lora = self.lora
        if lora is not None and lora.state.active:
            y = lora.apply(x, y)
        return y

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate/up layer's output in one kernel, where its linear method can
        (a layer marked ``feeds_silu_and_mul`` before loading, with a kernel that pairs the halves' rows);
        ``None``: run :meth:`forward`, then the activation."""
        fused = getattr(self.linear_method, "apply_silu_mul", None)
        if fused is None or not isinstance(x, torch.Tensor) or self.lora is not None:
            return None
        return fused(self, x, self.bias)

    def input_quant(self) -> Any:
        """How this layer's GEMM kernel wants its input rows quantized (a
        :class:`~plinth.kernels.ops.RowQuant`), so that the kernel before the layer can hand it
        :class:`~plinth.kernels.ops.QuantizedRows`; ``None``: a plain input (always for a layer with LoRA
        adapters, whose products read the input rows themselves)."""
        if self.lora is not None:
            return None
        method = getattr(self.linear_method, "input_quant", None)
        return method(self) if method is not None else None

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_rank}/{self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (e.g. a MoE router)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows ``[r*n/tp, (r+1)*n/tp)`` of the weight."""

    def _partition_sizes(self) -> tuple[int, list[int]]:
        return self.input_size, [divide(self.output_size, self.tp_size, "output size")]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        if loaded.shape[0] != shard * self.tp_size:
            raise ModelLoadError(f"shape mismatch: expected {(shard * self.tp_size, *param.shape[1:])}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
        piece = loaded.narrow(0, self.tp_rank * shard, shard)
        _check_shape(param, piece)
        param.data.copy_(piece)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    The bias is added once, after the reduction.
    """

    def _partition_sizes(self) -> tuple[int, list[int]]:
        return divide(self.input_size, self.tp_size, "input size"), [self.output_size]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 2:
            shard = param.shape[1]
            if loaded.dim() != 2 or loaded.shape[1] != shard * self.tp_size:
                raise ModelLoadError(f"shape mismatch: expected {(param.shape[0], shard * self.tp_size)}, "
                                     f"checkpoint has {tuple(loaded.shape)}")
            loaded = loaded.narrow(1, self.tp_rank * shard, shard)
        _check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``x @ W^T (+ bias)`` summed over the ranks; with ``reduce=False`` this rank's partial sums, which
        the caller reduces (a layer without a bias only: the bias is added after the reduction)."""
        if self.tp_size == 1 and reduce:
            return self._matmul(x, self.bias)   # (the bias in the GEMM)
        out = self._matmul(x, None)
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel layer with a bias cannot leave its reduction to the caller")
            return out
        tp_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate/up).

    Checkpoint tensors arrive one by one with an integer shard id (their index in ``output_sizes``).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kwargs: Any):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, **kwargs)
        for p in self.parameters(recurse=False):
            p.expected_shards = tuple(range(len(self.output_sizes)))  # type: ignore[attr-defined]

    def _partition_sizes(self) -> tuple[int, list[int]]:
        return self.input_size, [divide(s, self.tp_size, "output size") for s in self.output_sizes]

    def _shard_offset_size(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in the fused param, rows on this rank, rank's start row in the checkpoint tensor)."""
        sizes = self.output_sizes_per_partition
        return sum(sizes[:shard_id]), sizes[shard_id], self.tp_rank * sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            return super().weight_loader(param, loaded)
        offset, size, start = self._shard_offset_size(shard_id)
        full = self._full_shard_rows(shard_id)
        if loaded.shape[0] != full or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(f"shape mismatch: expected {(full, *param.shape[1:])}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def _full_shard_rows(self, shard_id: Any) -> int:
        return self.output_sizes[shard_id]


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused query/key/value projection; shard ids ``"q"``, ``"k"``, ``"v"``.

    Query heads are split across ranks. Key/value heads are split too when there are at
    least as many as ranks; otherwise each KV head is replicated on ``tp_size / num_kv_heads``
    ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1, quant_method: Any = None):
        self.head_size = head_size
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = divide(tp_size, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, bias, tp_rank=tp_rank, tp_size=tp_size, quant_method=quant_method)
        for p in self.parameters(recurse=False):
            p.expected_shards = ("q", "k", "v")  # type: ignore[attr-defined]

    def _partition_sizes(self) -> tuple[int, list[int]]:
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        return self.input_size, [q, kv, kv]

    def _full_shard_rows(self, shard_id: Any) -> int:
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return heads * self.head_size

    def _shard_offset_size(self, shard_id: Any) -> tuple[int, int, int]:
        q, kv, _ = self.output_sizes_per_partition
        if shard_id == "q":
            return 0, q, self.tp_rank * q
        if shard_id not in ("k", "v"):
            raise ModelLoadError(f"unknown QKV shard id {shard_id!r}")
        offset = q if shard_id == "k" else q + kv
        return offset, kv, (self.tp_rank // self.kv_replicas) * kv
