"""Llama (1/2/3, with llama3 RoPE scaling), Mistral and Ministral (sliding-window attention), Seed-OSS.

All are the shared decoder: Llama's ``attention_bias``/``mlp_bias`` options are read from the config, Mistral's
``sliding_window`` (Ministral's on the layers ``layer_types`` marks) is applied by the shared attention block,
Seed-OSS gives its output projection a bias of its own (``attention_out_bias``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: the reference decoder."""

    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout with a sliding attention window on every layer (no biases)."""

    config_biases: ClassVar[tuple[str, ...]] = ()


class MinistralForCausalLM(DecoderForCausalLM):
    """Ministral (e.g. Ministral-8B-Instruct-2410): Mistral's layout, the window on the layers ``layer_types`` marks
    ``sliding_attention``."""

    config_biases: ClassVar[tuple[str, ...]] = ()


class SeedOssForCausalLM(DecoderForCausalLM):
    """Seed-OSS (e.g. Seed-OSS-36B-Instruct): Llama with q/k/v biases (``attention_bias``) and an output-projection
    bias of its own (``attention_out_bias``)."""

    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                o_bias=bool(getattr(cfg, "attention_out_bias", False)))

