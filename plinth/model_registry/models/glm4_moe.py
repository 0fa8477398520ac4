"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``, e.g. GLM-4.5-Air): Llama-style grouped-query attention (q/k/v biases
with ``attention_bias``, per-head q/k norms with ``use_qk_norm``, RoPE over ``partial_rotary_factor`` of each head)
on DeepSeek-V3's mixture of experts: sigmoid routing with the learned ``e_score_correction_bias`` within the
``topk_group`` best of ``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``, shared experts, and dense
layers before ``first_k_dense_replace``; the multi-token-prediction layers after the last decoder layer are
skipped. dots.llm1 (``Dots1ForCausalLM``) is the same with q/k norms always and biases on all four projections."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from plinth.model_registry.models.decoder import AttentionOptions, DecoderAttention, DecoderForCausalLM
from plinth.model_registry.models.deepseek import DeepseekV3ForCausalLM


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's experts (and checkpoint names) behind the shared decoder's attention."""

    partial_rotary: ClassVar[bool] = True

    attention_class: ClassVar[type[nn.Module]] = DecoderAttention
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = DecoderForCausalLM.packed_modules_mapping
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "attention_bias", False)), o_bias=False,
                                qk_norm=bool(getattr(cfg, "use_qk_norm", False)))


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """dots.llm1 (``Dots1ForCausalLM``): GLM-4.5's layout with q/k/v/o biases (``attention_bias``), per-head q/k norms
    always, full RoPE, and sliding-window layers where ``layer_types`` marks them."""

    partial_rotary: ClassVar[bool] = False

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
