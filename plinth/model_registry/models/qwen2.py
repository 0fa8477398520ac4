"""Qwen2 / Qwen2.5: biases on the q/k/v projections (not on the output), often tied embeddings."""

from __future__ import annotations

from typing import Any

from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
