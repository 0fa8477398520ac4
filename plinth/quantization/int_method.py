"""The shared half of every method whose layers end up as :class:`~plinth.quantization.formats.IntWeights`
(int4, AWQ, GPTQ, compressed-tensors integer schemes, INT8 plugins): kernel candidates, the problem
description and random weights for kernel checks. Subclasses parse their checkpoints."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from plinth.quantization.interface import QuantContext, QuantizationMethod
from plinth.quantization.kernels.interface import GemmProblem
from plinth.quantization.quantizers import random_int_weights

logger = logging.getLogger(__name__)

_K = "plinth.quantization.kernels"
#: every integer kernel plinth ships, by name
INT_KERNELS = {
    "dequant": f"{_K}.dequant:DequantIntKernel",
    "triton_w4a16": f"{_K}.w4a16_triton:TritonW4A16Kernel",
    "torch_int4pack": f"{_K}.int4pack:TorchInt4PackKernel",
    "w4a16_split": f"{_K}.w4a16_split:SplitW4A16Kernel",
    "cuda_w4a16": f"{_K}.w4a16_cuda:CudaW4A16Kernel",
    "torch_int_mm": f"{_K}.int8_mm:TorchIntMMKernel",
}


class IntWeightMethod(QuantizationMethod):
    """A method with integer weights.

    Args:
        ctx: the engine context.
        bits: 4 or 8.
        group_size: input features per scale; ``None`` for one scale per output channel.
        symmetric: zero points fixed at the code midpoint.
        act_order: input features permuted so that groups are contiguous (GPTQ ``desc_act``).
        activation: ``None`` (weight-only) or ``"int8_token"`` (W8A8 with dynamic token scales).
    """

    def __init__(self, ctx: QuantContext, *, bits: int, group_size: int | None, symmetric: bool = False,
                 act_order: bool = False, activation: str | None = None):
        super().__init__(ctx)
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.act_order = act_order
        self.activation = activation

    def expert_method(self, layer: nn.Module) -> Any:
        """Integer experts (:mod:`plinth.quantization.int_experts`): the checkpoint's packed ones, or float ones
        quantized like the linear layers (``None``, experts left in floating point, where the group size does not
        divide their input features, with a warning)."""
        from plinth.quantization.int_experts import IntExpertMethod

        if not self.quantizes_float_checkpoints:
            # a checkpoint's stacked expert tensors (Granite, gpt-oss) are not linear layers: quantizers leave them
            return IntExpertMethod(self, from_checkpoint=True) if layer.loads_per_expert_tensors else None
        if type(self).float_weights is QuantizationMethod.float_weights:
            return None
        sizes = (layer.w2_weight.shape[1], layer.intermediate_per_rank)
        if self.group_size is not None and any(k % self.group_size for k in sizes):
            logger.warning("%s: groups of %d do not divide the experts' input features %s; the experts stay in "
                           "floating point", self.name, self.group_size, sizes)
            return None
        return IntExpertMethod(self, from_checkpoint=False)

    def widened_weight(self, layer: nn.Module) -> Any:
        """For a weight ``layer`` reads itself (DeepSeek's ``kv_b_proj``): the checkpoint's packed tensors widened to
        the model's dtype once loaded; ``None`` for float checkpoints."""
        from plinth.quantization.int_experts import WidenedIntWeight

        return WidenedIntWeight(layer, self) if not self.quantizes_float_checkpoints else None

    def group_for(self, input_size: int) -> int:
        """The group size of a layer with ``input_size`` input features (on this rank)."""
        return input_size if self.group_size is None else self.group_size

    def kernel_candidates(self) -> dict[str, str]:
        names = ["dequant"]
        if self.bits == 4:
            names += ["triton_w4a16", "torch_int4pack", "w4a16_split", "cuda_w4a16"]
        if self.bits == 8 and self.activation == "int8_token":
            names.append("torch_int_mm")
        return {n: INT_KERNELS[n] for n in names}

    def gemm_problem(self, shapes: tuple[tuple[int, int], ...]) -> GemmProblem:
        return GemmProblem(
            weight_format="int", dtype=self.ctx.dtype, device_type=self.ctx.device.type,
            capability=self.ctx.capability, bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, act_order=self.act_order, activation=self.activation, shapes=shapes,
        )

    def random_weights(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> Any:
        return random_int_weights(n, k, self.bits, self.group_for(k), symmetric=self.symmetric,
                                  act_order=self.act_order, device=device, generator=generator)

    def kernel_tolerance(self) -> float:
        if self.activation == "int8_token":  # activation rounding: about 1/254 of each row's range
            return 3e-2
        return super().kernel_tolerance()
