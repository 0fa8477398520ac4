"""Granite (IBM Granite 3.x dense models): Llama's blocks with four multipliers from the config."""

from __future__ import annotations

import math
from typing import Any

import torch

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM

_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


class GraniteForCausalLM(DecoderForCausalLM):
    """``GraniteForCausalLM``: the embeddings times ``embedding_multiplier``, the softmax scale
    ``attention_multiplier`` (instead of ``head_dim ** -0.5``), each attention and MLP output times
    ``residual_multiplier`` before the residual add, and the logits divided by ``logits_scaling``."""

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        for key in _MULTIPLIERS:
            value = getattr(cfg, key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise UnsupportedModelError(f"GraniteForCausalLM: {key} must be a positive number, got {value!r}")
        super().__init__(ctx)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0))

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=float(getattr(cfg, "attention_multiplier", 1.0)))

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(activation=getattr(cfg, "hidden_act", None) or "silu",
                            embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)),
                            residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits
