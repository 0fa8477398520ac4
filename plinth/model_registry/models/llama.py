"""Llama (1/2/3, with llama3 RoPE scaling), Mistral and Ministral (sliding-window attention), Seed-OSS, ERNIE 4.5.

All are the shared decoder: Llama's ``attention_bias``/``mlp_bias`` options are read from the config, Mistral's
``sliding_window`` (Ministral's on the layers ``layer_types`` marks) is applied by the shared attention block,
Seed-OSS gives its output projection a bias of its own (``attention_out_bias``), ERNIE 4.5 rotates adjacent
pairs of features (``AttentionOptions.rope_interleaved``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plinth.model_registry.interface import ModelContext
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM, DenseMLP


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: the reference decoder."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout with a sliding attention window on every layer."""


class MinistralForCausalLM(DecoderForCausalLM):
    """Ministral (e.g. Ministral-8B-Instruct-2410): Mistral's layout, the window on the layers ``layer_types`` marks
    ``sliding_attention``."""


class SeedOssForCausalLM(DecoderForCausalLM):
    """Seed-OSS (e.g. Seed-OSS-36B-Instruct): Llama with q/k/v biases (``attention_bias``) and an output-projection
    bias of its own (``attention_out_bias``)."""

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                o_bias=bool(getattr(cfg, "attention_out_bias", False)))


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 dense (e.g. ERNIE-4.5-0.3B): Llama with RoPE over adjacent pairs of features and one ``use_bias``
    for every projection."""

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "use_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope_interleaved=True)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        return DenseMLP(ctx, cfg.intermediate_size, bias=bool(getattr(cfg, "use_bias", False)),
                        activation=self.block_options(cfg).activation)
