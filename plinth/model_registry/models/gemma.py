"""Gemma, Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's norms, GeLU and scaled embeddings.

All: RMSNorm weights stored as ``w`` of ``(1 + w)``, a tanh-approximated GeLU gate (``hidden_act`` /
``hidden_activation``), embeddings multiplied by ``sqrt(hidden_size)``, tied LM head. Gemma 2 adds a norm on
each block's output before the residual add, the softmax scale ``query_pre_attn_scalar ** -0.5``,
sliding-window layers (``layer_types``), attention-logit soft-capping and a final logit soft cap; Gemma 3
adds per-head q/k norms and the sliding layers' own RoPE base.
"""

from __future__ import annotations

from typing import Any

import torch

from plinth.attention_backends.interface import soft_capped
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.attention import MAX_SOFT_CAP, usable_soft_cap
from plinth.model_registry.layers.layernorm import GemmaRMSNorm
from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma (1): Llama's blocks with Gemma's norms, activation and embedding scale."""

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=GemmaRMSNorm, activation=getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh",
                            embed_scale=True)


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``, e.g. gemma-2-2b, 9b and 27b): a norm on each block's output before the
    residual add, the softmax scale ``query_pre_attn_scalar ** -0.5``, sliding-window layers from
    ``layer_types``, attention-logit soft-capping (``attn_logit_softcapping``, applied by the attention
    backends that support it) and a final logit soft cap."""

    #: per-head RMSNorm of q and k, and the sliding layers' own RoPE base (Gemma 3)
    gemma3_extras = False

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{type(self).__name__}: bidirectional attention (use_bidirectional_attention) "
                                        "is not supported; plinth's attention is causal")
        for key in ("final_logit_softcapping",) if self.gemma3_extras else ("attn_logit_softcapping",
                                                                              "final_logit_softcapping"):
            cap = getattr(cfg, key, None)
            if cap is not None and not usable_soft_cap(cap):
                raise UnsupportedModelError(f"{type(self).__name__}: {key} must be a number in (0, {MAX_SOFT_CAP:g}] "
                                            f"or null, got {cap!r}")
        super().__init__(ctx)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=self.gemma3_extras,
                                scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                                soft_cap=None if self.gemma3_extras else getattr(cfg, "attn_logit_softcapping", None))

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=GemmaRMSNorm, activation=getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh",
                            sandwich_norms=True, embed_scale=True, local_rope=self.gemma3_extras)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = soft_capped(logits, cap)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``, e.g. gemma-3-270m and gemma-3-1b): Gemma 2's blocks with
    per-head q/k norms and the sliding layers' own RoPE base (``rope_local_base_freq``), and no attention-logit
    soft cap (the q/k norms replace it: ``attn_logit_softcapping`` is ignored, as transformers ignores it)."""

    gemma3_extras = True
