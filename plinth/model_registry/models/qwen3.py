"""Qwen3: RMSNorm over each head of q and k before the rotary embedding."""

from __future__ import annotations

from typing import Any

from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
