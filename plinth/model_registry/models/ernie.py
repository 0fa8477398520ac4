"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, e.g. ERNIE-4.5-0.3B) and ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``, e.g.
ERNIE-4.5-21B-A3B).

- Attention: Llama's with RoPE over adjacent pairs of features (``AttentionOptions.rope_interleaved``) and one
  ``use_bias`` for every projection (q/k/v/o and the MLPs).
- MoE: the layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` on every ``moe_layer_interval``-th have
  experts; softmax router scores in float32, the choice made on the scores plus the learned
  ``e_score_correction_bias`` (the checkpoint's ``mlp.moe_statics``), the weights the chosen scores renormalised
  (their sum clamped below at ``moe_norm_min``); ``moe_num_shared_experts`` shared experts every token runs. The
  checkpoint's multi-token-prediction tensors (``mtp*``) are not part of the model and are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.moe import FusedMoE, check_expert_activation
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM, DenseMLP
from plinth.model_registry.models.deepseek import CorrectedExpertWeights, SharedExpertsMoE


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 dense: Llama with RoPE over adjacent pairs and biases from ``use_bias``."""

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "use_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope_interleaved=True)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        return DenseMLP(ctx, cfg.intermediate_size, bias=bool(getattr(cfg, "use_bias", False)),
                        activation=self.block_options(cfg).activation)


class Ernie4_5Experts(FusedMoE):
    """The routed experts with ERNIE's corrected choice (see the module docstring)."""

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         renormalize=True, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.norm_min = float(getattr(cfg, "moe_norm_min", 1e-12))
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, self.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = router_logits.to(torch.float32).softmax(dim=-1)
        ids = (scores + self.e_score_correction_bias[0]).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min), ids


def _sparse(cfg: Any, layer_idx: int) -> bool:
    interval = int(getattr(cfg, "moe_layer_interval", 1) or 1)
    start = int(getattr(cfg, "moe_layer_start_index", 0) or 0)
    end = getattr(cfg, "moe_layer_end_index", None)
    end = cfg.num_hidden_layers - 1 if end is None or end < 0 else int(end)
    return (layer_idx + 1) % interval == 0 and start <= layer_idx <= end


class Ernie4_5_MoeForCausalLM(CorrectedExpertWeights, Ernie4_5ForCausalLM):
    """ERNIE 4.5 MoE: ERNIE 4.5's attention, sparse layers with ERNIE's routing and shared experts."""

    correction_owner: ClassVar[str] = ".mlp.moe_statics."
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def __init__(self, ctx: ModelContext):
        if getattr(ctx.hf_config, "use_bias", False):   # the released models set it false
            raise UnsupportedModelError("ERNIE 4.5 MoE with use_bias: its LM head would take a bias, which plinth's "
                                        "LM head does not have")
        super().__init__(ctx)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        if not _sparse(cfg, layer_idx):
            return super().make_mlp(ctx, layer_idx)
        check_expert_activation(self.block_options(cfg).activation)
        return SharedExpertsMoE(ctx, Ernie4_5Experts(ctx), int(getattr(cfg, "moe_num_shared_experts", 0) or 0),
                                bias=bool(getattr(cfg, "use_bias", False)))

    def not_in_the_model(self, name: str) -> bool:
        """The multi-token-prediction tensors (``mtp*``)."""
        return name.startswith(("mtp", "model.mtp"))
