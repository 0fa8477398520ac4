"""``gguf``: run a ``.gguf`` file's linear layers on their llama.cpp blocks, kept quantized in memory.

Without ``--quantization gguf`` a GGUF file is dequantized to the compute dtype while loading (the
default). With it, each linear layer keeps the blocks of its checkpoint tensors (one shard per tensor
of a fused layer, each with its own block type) and expands them on every call
(:mod:`plinth.quantization.kernels.gguf_blocks`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and
F32/F16/BF16). Tensors of other block types, and the embedding, norms and output head, are
dequantized while loading as in the default path.

Under tensor parallelism a column-parallel layer takes its rows of the blocks; a row-parallel one
takes whole blocks of every row, so its input size per rank must be a multiple of the block length
(32, or 256 for the K types).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.formats import GGUFShard, GGUFWeights
from plinth.quantization.interface import QuantContext, QuantizationMethod
from plinth.quantization.kernels.gguf_blocks import BLOCK_TYPES, F16, F32, Q8_0
from plinth.quantization.kernels.interface import GemmProblem
from plinth.quantization.params import input_range, output_range

#: float types whose values are read as they are (others, BF16 included, go through gguf's dequantizer)
_RAW_FLOATS = (F32, F16)


@dataclasses.dataclass
class GGUFTensor:
    """A checkpoint tensor as stored: ``data`` ``[rows, bytes_per_row]`` uint8 blocks (or float values)."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, ...]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of (part of) the read-only file mapping, owned by torch, on ``device``."""
    return torch.from_numpy(np.array(array, order="C")).to(device)


def _load_shard(layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Keep this rank's rows (and, row-parallel, its blocks of each row) of one checkpoint tensor."""
    if not isinstance(loaded, GGUFTensor):
        raise ModelLoadError("expected GGUF blocks for a layer run with --quantization gguf")
    offset, size, start, total = output_range(layer, shard_id)
    k_start, k_size, k_total = input_range(layer)
    rows, cols = loaded.shape
    if (rows, cols) != (total, k_total):
        raise ModelLoadError(f"shape mismatch: expected {(total, k_total)}, checkpoint has {(rows, cols)}")
    parts = layer.__dict__.setdefault("gguf_parts", {})
    parts[offset] = _columns(loaded, loaded.data[start:start + size], k_start, k_size, param.device, layer.gguf_dtype)


def _columns(loaded: GGUFTensor, rows: np.ndarray, k_start: int, k_size: int, device: torch.device,
             dtype: torch.dtype, widen_partial: bool = False) -> GGUFShard:
    """Input features ``k_start:k_start + k_size`` of ``rows`` (some rows of ``loaded``): whole blocks, or float values
    in ``dtype`` for float types and, with ``widen_partial``, for a cut that ends inside a block (else refused)."""
    kind, cols = loaded.ggml_type, loaded.shape[1]
    if kind in BLOCK_TYPES:
        block_len, type_size, _fn = BLOCK_TYPES[kind]
        if not (k_start % block_len or k_size % block_len):
            blocks = rows[:, k_start // block_len * type_size:(k_start + k_size) // block_len * type_size]
            return GGUFShard(kind, _to_device(blocks, device), len(rows), k_size)
        if not widen_partial:
            raise ModelLoadError(f"cannot shard a {cols}-wide row of {block_len}-element blocks at "
                                 f"{k_start}:{k_start + k_size} (tensor parallelism vs the block length)")
        import gguf

        rows, kind = gguf.quants.dequantize(rows, kind).reshape(len(rows), cols), F32
    return GGUFShard(kind, _to_device(rows[:, k_start:k_start + k_size], device).to(dtype), len(rows), k_size)


class GGUFMethod(QuantizationMethod):
    """llama.cpp block types, dequantized per call."""

    name = "gguf"
    source_kinds = ("gguf",)
    reference_kernel = "gguf_dequant"

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> GGUFMethod:
        if ctx.source_kind != "gguf":
            raise ConfigError("--quantization gguf needs a .gguf file")
        return cls(ctx)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        # The blocks arrive one tensor at a time with sizes known only then: the parameter is a
        # placeholder whose loader keeps each shard's blocks on the layer.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = functools.partial(_load_shard, layer)  # type: ignore[attr-defined]
        weight.gguf_blocks = True  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.gguf_dtype = self.ctx.dtype

    def convert_weights(self, layer: nn.Module) -> GGUFWeights:
        parts = layer.__dict__.pop("gguf_parts", {})
        shards = [parts[o] for o in sorted(parts)]
        if sum(s.rows for s in shards) != sum(layer.output_sizes_per_partition):
            raise ModelLoadError("a GGUF layer is missing some of its rows")
        return GGUFWeights(shards)

    def expert_method(self, layer: nn.Module) -> GGUFExpertMethod:
        return GGUFExpertMethod(self.ctx.dtype)

    def kernel_candidates(self) -> dict[str, str]:
        return {"gguf_dequant": "plinth.quantization.kernels.gguf:GGUFDequantKernel"}

    def gemm_problem(self, shapes: tuple[tuple[int, int], ...]) -> GemmProblem:
        return GemmProblem(weight_format="gguf", dtype=self.ctx.dtype, device_type=self.ctx.device.type,
                           capability=self.ctx.capability, shapes=shapes)

    def random_weights(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> GGUFWeights:
        """Q8_0 blocks: random int8 codes and float16 scales around 1e-4."""
        nb = k // 32
        scales = (torch.rand(n, nb, 1, generator=generator, device=device) * 2e-4).to(torch.float16)
        codes = torch.randint(-127, 128, (n, nb, 32), generator=generator, device=device).to(torch.int8)
        blocks = torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)], dim=-1)  # [n, nb, 34]
        return GGUFWeights([GGUFShard(Q8_0, blocks.reshape(n, nb * 34).contiguous(), n, k)])

    def weights_iterator(self, source: Any, model: nn.Module) -> Iterator[tuple[str, Any]]:
        return self._weights(source.path, model)

    def _weights(self, path: str, model: nn.Module) -> Iterator[tuple[str, Any]]:
        import gguf

        from plinth.model_registry.gguf_loader import iter_gguf_raw

        params = dict(model.named_parameters())
        for hf_name, data, ggml_type, shape in iter_gguf_raw(path):
            target = model.map_weight_name(hf_name)
            param = params.get(target[0]) if target is not None else None
            kept = param is not None and getattr(param, "gguf_blocks", False)
            if kept and (int(ggml_type) in BLOCK_TYPES or int(ggml_type) in _RAW_FLOATS):
                yield hf_name, GGUFTensor(data, int(ggml_type), shape)
                continue
            try:
                values = gguf.quants.dequantize(data, ggml_type).reshape(shape)  # float32
            except NotImplementedError as exc:
                raise ModelLoadError(f"GGUF file {path!r}: tensor {hf_name!r} has type {ggml_type.name}, which "
                                     f"cannot be dequantized") from exc
            if kept:  # a block type without a torch dequantizer: kept as float values
                yield hf_name, GGUFTensor(values, F32, shape)
            else:
                yield hf_name, torch.from_numpy(np.array(values, dtype=np.float32)).to(self.ctx.dtype)


class GGUFExpertMethod:
    """The experts of a mixture-of-experts layer kept in their llama.cpp blocks (the file's stacked
    ``ffn_{gate,up,down}_exps`` arrive split per expert): one :class:`GGUFWeights` per expert and projection
    (gate and up as two shards), expanded when the expert runs. Under tensor parallelism the gate and up rows are
    this rank's, and the down projection's rows keep this rank's whole blocks; where its share of the expert width
    is not a multiple of the block length (Qwen3-30B-A3B's 384 features per rank against K-quants' 256) that
    projection is widened while loading instead."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def create_weights(self, layer: nn.Module) -> None:
        self.hidden = layer.w2_weight.shape[1]
        for which in ("w13", "w2"):
            old = layer._parameters.pop(f"{which}_weight")
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=old.device), requires_grad=False)
            placeholder.weight_loader = functools.partial(self._load, layer)  # type: ignore[attr-defined]
            placeholder.expected_shards = old.expected_shards  # type: ignore[attr-defined]
            placeholder.gguf_blocks = True  # type: ignore[attr-defined]
            layer.register_parameter(f"{which}_weight", placeholder)
        layer.gguf_experts = {}

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: tuple[int, str]) -> None:
        expert, role = shard_id
        if not isinstance(loaded, GGUFTensor):
            raise ModelLoadError("expected GGUF blocks for experts run with --quantization gguf")
        i, r, tp = layer.intermediate_per_rank, layer.tp_rank, layer.tp_size
        hidden = self.hidden
        rows, cols = loaded.shape
        want = (hidden, i * tp) if role == "down" else (i * tp, hidden)
        if (rows, cols) != want:
            raise ModelLoadError(f"shape mismatch: expected {want}, checkpoint has {(rows, cols)}")
        data = loaded.data if role == "down" else loaded.data[r * i:(r + 1) * i]
        k_start, k_size = (r * i, i) if role == "down" else (0, hidden)
        # a rank's columns ending inside a block: that projection's values, widened
        layer.gguf_experts[expert, role] = _columns(loaded, data, k_start, k_size, param.device, self.dtype,
                                                    widen_partial=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_experts
        layer.gguf_experts = {which: [GGUFWeights([shards.pop((e, r)) for r in roles]) for e in range(layer.num_experts)]
                              for which, roles in (("w13", ("gate", "up")), ("w2", ("down",)))}

    def widen(self, layer: nn.Module, which: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        return layer.gguf_experts[which][expert].dequantize(dtype)
