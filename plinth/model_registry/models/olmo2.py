"""OLMo 2 and OLMo 3: norms on each block's output (none on its input) and q/k norms over all heads of a token."""

from __future__ import annotations

from typing import Any

from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 (``Olmo2ForCausalLM``, e.g. OLMo-2-1B/7B/13B/32B): each attention and MLP output is normed before the
    residual add and their inputs are not; RMSNorm over each token's whole q and k projections (so tensor
    parallelism, which splits the heads, is refused)."""

    #: sliding-window layers from ``layer_types`` with their own RoPE (OLMo 3)
    olmo3_extras = False

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm_full=True)

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(activation=getattr(cfg, "hidden_act", None) or "silu", post_norms=True,
                            local_rope=self.olmo3_extras)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (``Olmo3ForCausalLM``): OLMo 2's blocks with sliding-window layers (``layer_types``), each kind of
    layer with its own RoPE parameters."""

    olmo3_extras = True
