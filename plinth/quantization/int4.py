"""``int4``: weight-only INT4 made while loading a float checkpoint (round-to-nearest, group-wise).

Each linear weight is split into groups of ``group_size`` input features (128 by default; 64 or 32
when a layer's input size is not a multiple of 128; ``PLINTH_INT4_GROUP_SIZE`` sets it), and each
group gets a float scale and an integer zero point covering its ``[min, max]`` (asymmetric), so
``w ~= (q - z) * s`` with ``q`` in ``[0, 15]``. Activations stay in the compute dtype (W4A16).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.formats import IntWeights
from plinth.quantization.int_method import IntWeightMethod
from plinth.quantization.interface import QuantContext
from plinth.quantization.layers import float_weight, use_plain_weights
from plinth.quantization.quantizers import quantize_int_rtn

logger = logging.getLogger(__name__)

GROUP_ENV = "PLINTH_INT4_GROUP_SIZE"
DEFAULT_GROUP = 128


def input_sizes(hf_config: Any, tp_size: int) -> set[int]:
    """Input features of the decoder's linear layers on one rank (hidden; attention and MLP outputs)."""
    hidden = hf_config.hidden_size
    sizes = {hidden}
    heads = getattr(hf_config, "num_attention_heads", None)   # (none: a model without attention, Mamba-2)
    if heads:
        sizes.add((getattr(hf_config, "head_dim", None) or hidden // heads) * heads // tp_size)
    inter = getattr(hf_config, "intermediate_size", None)
    if inter:
        sizes.add(inter // tp_size)
    from plinth.model_registry.layers.mamba import mamba_width

    mamba = mamba_width(hf_config)   # the Mamba layers' out_proj input
    if mamba:
        sizes.add(mamba // tp_size)
    return sizes


def choose_group_size(sizes: set[int], requested: int | None) -> int:
    """``requested`` if every size is a multiple of it, else the largest of 128, 64, 32 that divides them all.

    Raises:
        ConfigError: no such group size.
    """
    if requested is not None:
        bad = sorted(k for k in sizes if k % requested)
        if bad:
            raise ConfigError(f"int4 group size {requested} does not divide the layer input sizes {bad}")
        return requested
    for group in (DEFAULT_GROUP, 64, 32):
        if all(k % group == 0 for k in sizes):
            return group
    raise ConfigError(f"int4 needs layer input sizes that are multiples of 32, got {sorted(sizes)}")


def _requested_group() -> int | None:
    raw = os.environ.get(GROUP_ENV, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 16 or int(raw) % 16:
        raise ConfigError(f"{GROUP_ENV}={raw!r}: expected a multiple of 16 (e.g. 32, 64, 128)")
    return int(raw)


class Int4Method(IntWeightMethod):
    """RTN INT4, asymmetric, group-wise; kernels: Triton W4A16, torch int4 packed matmul, dequantize."""

    name = "int4"
    quantizes_float_checkpoints = True
    quantizes_lm_head = True
    source_kinds = ("hf_dir", "dummy")

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> Int4Method:
        if quant_config is not None:
            raise ConfigError("int4 quantizes float checkpoints while loading; this checkpoint is already "
                              f"quantized ({quant_config.get('quant_method')!r})")
        group = choose_group_size(input_sizes(ctx.hf_config, ctx.tp_size), _requested_group())
        return cls(ctx, bits=4, group_size=group, symmetric=False)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        float_weight(layer, self.ctx.dtype, input_size, output_sizes)

    def prepare_model(self, model: nn.Module) -> None:
        """Layers whose input features the group size does not divide (a latent projection, shared experts of an
        odd width) stay in floating point, with a warning naming them; the others are quantized."""
        kept = []
        for name, layer in model.named_modules():
            k = getattr(layer, "input_size_per_partition", None)
            if getattr(layer, "linear_method", None) is self and k is not None and k % self.group_for(k):
                use_plain_weights(layer, self.ctx.dtype)
                kept.append(f"{name} ({k})")
        if kept:
            logger.warning("int4: the group size %d does not divide the input features of %d linear layers, which "
                           "stay in floating point: %s", self.group_size, len(kept),
                           ", ".join(kept[:4]) + (", ..." if len(kept) > 4 else ""))
        super().prepare_model(model)

    def convert_weights(self, layer: nn.Module) -> IntWeights:
        return self.float_weights(layer.weight)

    def float_weights(self, weight: torch.Tensor) -> IntWeights:
        if weight.shape[1] % self.group_for(weight.shape[1]):
            raise ModelLoadError(f"int4: input size {weight.shape[1]} is not a multiple of the group size "
                                 f"{self.group_size}")
        with torch.no_grad():
            return quantize_int_rtn(weight, 4, self.group_for(weight.shape[1]), symmetric=False)
