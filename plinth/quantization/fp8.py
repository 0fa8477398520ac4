"""``fp8``: FP8 E4M3 weights with dynamic per-token FP8 activations (W8A8).

Two sources:

- FP8 checkpoints with ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}``:
  ``weight`` float8_e4m3fn ``[N, K]`` plus ``weight_scale`` (one value per tensor, or one per output
  channel), or, with ``"weight_block_size": [bn, bk]``, ``weight_scale_inv`` ``[N / bn, K / bk]`` (the
  multiplier of each block, despite the name). ``activation_scheme: "static"`` checkpoints carry an
  ``input_scale`` per layer; it is read and not used (activations are scaled per token, which is at
  least as accurate). Per-tensor scales of fused projections become per-channel scales.
- float checkpoints with ``--quantization fp8``: each weight gets one scale per output channel.

Kernels: ``fp8_scaled_mm`` (``torch._scaled_mm`` on GPUs with FP8 tensor cores, per-channel scales),
``triton_fp8`` (a Triton weight-only GEMM widening the FP8 bytes in registers, per-channel or block scales) and
``dequant`` (any device; activations stay in the compute dtype).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.awq import name_in, skip_list
from plinth.quantization.formats import FP8Weights
from plinth.quantization.interface import QuantContext, QuantizationMethod
from plinth.quantization.kernels.interface import GemmProblem
from plinth.quantization.layers import float_weight, take_row_absmax
from plinth.quantization.params import PackedLayout, load_packed, packed_parameter
from plinth.quantization.quantizers import quantize_fp8_per_channel, random_fp8_weights

_K = "plinth.quantization.kernels"
FP8_KERNELS = {
    "dequant": f"{_K}.dequant:DequantFP8Kernel",
    "fp8_scaled_mm": f"{_K}.fp8_scaled_mm:ScaledMMFP8Kernel",
    "triton_fp8": f"{_K}.fp8_triton:TritonFP8Kernel",
}


def _load_fp8_weight(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """FP8 weights are kept as their bytes (uint8) until conversion."""
    if loaded.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"expected a float8_e4m3fn weight, checkpoint has "
                             f"{str(loaded.dtype).removeprefix('torch.')} (a float layer missing from the "
                             f"checkpoint's ignore list?)")
    load_packed(layer, param, loaded.view(torch.uint8), shard_id)


def _ignore_loaded(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Static activation scales are read and not used (activations are scaled per token)."""


def create_fp8_checkpoint_weights(layer: nn.Module, input_size: int, output_sizes: list[int],
                                  block: tuple[int, int] | None, static_input: bool) -> None:
    """Parameters for an FP8 checkpoint layer: ``weight``, ``weight_scale`` or ``weight_scale_inv``,
    and ``input_scale`` when activations were calibrated statically."""
    n = sum(output_sizes)
    weight = packed_parameter(layer, "weight", (n, input_size), torch.uint8, PackedLayout(out_dim=0, in_dim=1))
    weight.weight_loader = functools.partial(_load_fp8_weight, layer)  # type: ignore[attr-defined]
    if block is None:
        packed_parameter(layer, "weight_scale", (n,), torch.float32, PackedLayout(out_dim=0, per_tensor_ok=True))
    else:
        bn, bk = block
        if len(output_sizes) > 1 and any(size % bn for size in output_sizes):
            raise ModelLoadError(f"FP8 block scales ({bn}x{bk}) do not tile the fused projections of {output_sizes} "
                                 f"rows (each must be a multiple of {bn})")
        # a weight taken whole may end inside its last block (DeepSeek-V3's 576-row kv_a_proj_with_mqa); a shard
        # of a split one must start and end on block edges (the loader says so)
        packed_parameter(layer, "weight_scale_inv", (-(-n // bn), -(-input_size // bk)), torch.float32,
                         PackedLayout(out_dim=0, out_per_elem=bn, in_dim=1, in_per_elem=bk, partial_last_ok=True))
    if static_input:
        scale = nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
        scale.weight_loader = _ignore_loaded  # type: ignore[attr-defined]
        layer.register_parameter("input_scale", scale)


def fp8_checkpoint_weights(layer: nn.Module, block: tuple[int, int] | None) -> FP8Weights:
    weight = layer.weight.view(torch.float8_e4m3fn)
    scale = layer.weight_scale if block is None else layer.weight_scale_inv
    return FP8Weights(weight, scale.to(torch.float32), block)


class FP8Method(QuantizationMethod):
    """FP8 E4M3 W8A8.

    Args:
        ctx: the engine context.
        from_checkpoint: the checkpoint holds FP8 weights (else float weights are quantized).
        block: ``(bn, bk)`` of block-wise scales, or ``None``.
        static_input: the checkpoint has static ``input_scale`` tensors.
        ignored: checkpoint module names (or name fragments) kept in floating point.
    """

    name = "fp8"
    quantizes_float_checkpoints = True
    quantizes_lm_head = True
    source_kinds = ("hf_dir", "dummy")
    #: the checkpoint's name of block scales (compressed-tensors says ``weight_scale``)
    block_scale_name: ClassVar[str] = "weight_scale_inv"

    def __init__(self, ctx: QuantContext, *, from_checkpoint: bool, block: tuple[int, int] | None = None,
                 static_input: bool = False, ignored: tuple[str, ...] = ()):
        super().__init__(ctx)
        self.from_checkpoint = from_checkpoint
        self.block = block
        self.static_input = static_input
        self.ignored = ignored

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> FP8Method:
        if quant_config is None:
            return cls(ctx, from_checkpoint=False)
        fmt = str(quant_config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ConfigError(f"fp8: weight format {fmt!r} unsupported; fp8 checkpoints must store e4m3 weights")
        scheme = str(quant_config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"fp8: activation_scheme {scheme!r} unsupported (dynamic, static)")
        block = quant_config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
                raise ConfigError(f"fp8: weight_block_size must be [rows, cols], got {block!r}")
            block = (int(block[0]), int(block[1]))
        ignored = skip_list(quant_config, "fp8", ("ignored_layers", "modules_to_not_convert"))
        return cls(ctx, from_checkpoint=True, block=block, static_input=scheme == "static", ignored=ignored)

    def applies_to(self, name: str) -> bool:
        """Not for a module an ignore entry names: the module itself, a dotted part of its name, or a parent (a whole
        experts module, one expert)."""
        return not name_in(name, self.ignored)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        if self.from_checkpoint:
            create_fp8_checkpoint_weights(layer, input_size, output_sizes, self.block, self.static_input)
        else:
            float_weight(layer, self.ctx.dtype, input_size, output_sizes, row_absmax=True)

    def convert_weights(self, layer: nn.Module) -> FP8Weights:
        if self.from_checkpoint:
            return fp8_checkpoint_weights(layer, self.block)
        with torch.no_grad():
            return quantize_fp8_per_channel(layer.weight, take_row_absmax(layer))

    def float_weights(self, weight: torch.Tensor) -> FP8Weights:
        """Per-channel FP8 of a float weight (also for the LM head of an FP8 checkpoint, whose head is
        stored in the float dtype)."""
        with torch.no_grad():
            return quantize_fp8_per_channel(weight, None)

    def widened_weight(self, layer: nn.Module) -> WidenedFP8Weight | None:
        """For a weight ``layer`` reads itself (not through a GEMM: DeepSeek's ``kv_b_proj``): its FP8 checkpoint
        tensor widened to the model's dtype once loaded; ``None`` for float checkpoints."""
        if not self.from_checkpoint:
            return None
        return WidenedFP8Weight(layer, self.block, self.static_input, block_scale=self.block_scale_name)

    def expert_method(self, layer: nn.Module) -> Any:
        """FP8 experts (:mod:`plinth.quantization.fp8_experts`): the checkpoint's, or float ones quantized per
        output channel; ``None`` (float experts) for a checkpoint's stacked expert tensors."""
        from plinth.quantization.fp8_experts import FP8ExpertMethod

        if self.from_checkpoint and not layer.loads_per_expert_tensors:
            return None   # stacked expert tensors (Granite, gpt-oss) are not linear layers: FP8 tools leave them float
        return FP8ExpertMethod(from_checkpoint=self.from_checkpoint, block=self.block, static_input=self.static_input,
                               block_scale=self.block_scale_name)

    def kernel_candidates(self) -> dict[str, str]:
        return dict(FP8_KERNELS)

    def gemm_problem(self, shapes: tuple[tuple[int, int], ...]) -> GemmProblem:
        return GemmProblem(weight_format="fp8", dtype=self.ctx.dtype, device_type=self.ctx.device.type,
                           capability=self.ctx.capability, activation="fp8_token", block=self.block, shapes=shapes)

    def random_weights(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> FP8Weights:
        return random_fp8_weights(n, k, device=device, generator=generator, block=self.block)

    def kernel_tolerance(self) -> float:
        # E4M3 keeps 3 mantissa bits: per-token activation rounding moves outputs by a few percent
        return 8e-2


class WidenedFP8Weight:
    """The FP8 checkpoint tensor of a weight a model reads itself (``layer.weight`` ``[rows, K]``, this rank's
    rows of ``rows * tp_size``), kept as bytes while loading and widened to the weight's dtype once its scales
    are in (:meth:`process_weights_after_loading`). A float tensor in the checkpoint (an ignored layer) loads as
    it is. The layer's ``weight_loader`` hands this rank's rows to :meth:`takes` first."""

    def __init__(self, layer: nn.Module, block: tuple[int, int] | None, static_input: bool,
                 block_scale: str = "weight_scale_inv"):
        self.block = block
        self.pending: torch.Tensor | None = None
        layer.weight.widens_fp8 = True  # type: ignore[attr-defined] # the loader lets float8_e4m3fn through
        self.tp_rank, self.tp_size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
        rows, k = layer.weight.shape
        if block is None:
            scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
            self.scale_name = "weight_scale"
        else:
            bn, bk = block
            if self.tp_size > 1 and rows % bn:
                raise ModelLoadError(f"FP8 block scales ({bn}x{bk}): {rows} rows per rank do not start on block edges")
            scale = nn.Parameter(torch.empty(-(-rows // bn), -(-k // bk), dtype=torch.float32), requires_grad=False)
            self.scale_name = block_scale
        scale.weight_loader = self._load_scale  # type: ignore[attr-defined]
        scale.expected_shards = ()  # type: ignore[attr-defined] # absent when the checkpoint keeps the layer float
        layer.register_parameter(self.scale_name, scale)
        self.scale_loaded = False
        if static_input:
            ignored = nn.Parameter(torch.empty(0), requires_grad=False)
            ignored.weight_loader = _ignore_loaded  # type: ignore[attr-defined]
            ignored.expected_shards = ()  # type: ignore[attr-defined]
            layer.register_parameter("input_scale", ignored)

    def takes(self, rows: torch.Tensor) -> bool:
        """Keep this rank's rows of an FP8 checkpoint tensor (True), or leave a float one to the caller (False)."""
        if rows.dtype != torch.float8_e4m3fn:
            return False
        self.pending = rows.view(torch.uint8).clone()
        return True

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        if self.block is None:
            src = loaded.reshape(-1)
            if src.numel() == 1:
                param.data.fill_(src.item())
            elif src.numel() == n * self.tp_size:
                param.data.copy_(src.narrow(0, self.tp_rank * n, n))
            else:
                raise ModelLoadError(f"shape mismatch: expected {n * self.tp_size} per-channel scales, checkpoint has "
                                     f"{tuple(loaded.shape)}")
        else:
            full = n if self.tp_size == 1 else n * self.tp_size
            if tuple(loaded.shape) != (full, param.shape[1]):
                raise ModelLoadError(f"shape mismatch: expected block scales {(full, param.shape[1])}, checkpoint "
                                     f"has {tuple(loaded.shape)}")
            param.data.copy_(loaded.narrow(0, self.tp_rank * n if self.tp_size > 1 else 0, n))
        self.scale_loaded = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.pending is not None:
            if not self.scale_loaded:
                raise ModelLoadError(f"an FP8 weight of {type(layer).__name__} came without its {self.scale_name}")
            scale = getattr(layer, self.scale_name)
            w = FP8Weights(self.pending.view(torch.float8_e4m3fn), scale.data, self.block)
            layer.weight.data.copy_(w.dequantize(layer.weight.dtype).to(layer.weight.device))
            self.pending = None
        delattr(layer, self.scale_name)
        if "input_scale" in layer._parameters:
            delattr(layer, "input_scale")
