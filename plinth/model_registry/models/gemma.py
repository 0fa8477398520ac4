"""Gemma and Gemma 3 (text): the shared decoder with Gemma's norms, GeLU and scaled embeddings.

Both: RMSNorm weights stored as ``w`` of ``(1 + w)``, a tanh-approximated GeLU gate (``hidden_act`` /
``hidden_activation``), embeddings multiplied by ``sqrt(hidden_size)``, tied LM head. Gemma 3 adds per-head
q/k norms, a norm on each block's output before the residual add, the softmax scale
``query_pre_attn_scalar ** -0.5``, sliding-window layers (``layer_types``) with their own RoPE base, and an
optional final logit soft cap. Attention-logit soft-capping (Gemma 2) is refused: the attention backends
do not apply it.
"""

from __future__ import annotations

from typing import Any

import torch

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.layernorm import GemmaRMSNorm
from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma (1): Llama's blocks with Gemma's norms, activation and embedding scale."""

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=GemmaRMSNorm, activation=getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh",
                            embed_scale=True)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``, e.g. gemma-3-270m and gemma-3-1b)."""

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError("Gemma3ForCausalLM: attention-logit soft-capping "
                                        "(attn_logit_softcapping) is not supported by plinth's attention backends")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma3ForCausalLM: bidirectional attention (use_bidirectional_attention) "
                                        "is not supported; plinth's attention is causal")
        super().__init__(ctx)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                                scale=float(cfg.query_pre_attn_scalar) ** -0.5)

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=GemmaRMSNorm, activation=getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh",
                            sandwich_norms=True, embed_scale=True, local_rope=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
