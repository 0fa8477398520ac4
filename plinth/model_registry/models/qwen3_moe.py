"""Qwen3-MoE: Qwen3's attention with sparse experts on most layers.

Layer ``i`` is sparse unless it is listed in ``mlp_only_layers`` or ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``; ``norm_topk_prob`` renormalises the top-k weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.moe import (
    SparseMoeBlock,
    check_expert_activation,
    expert_checkpoint_name,
    map_expert_weight,
    split_stacked_experts,
)
from plinth.model_registry.models.decoder import DenseMLP
from plinth.model_registry.models.qwen3 import Qwen3ForCausalLM

_EXPERT_PROJS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
#: an expert layer's tensors stacked over its experts (Qwen3-VL-MoE's language model: inputs first in the released
#: checkpoints, last as transformers writes them)
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<which>gate_up_proj|down_proj)$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
        sparse = (
            layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and num_experts > 0
            and (layer_idx + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        )
        activation = self.block_options(cfg).activation
        if not sparse:
            return DenseMLP(ctx, cfg.intermediate_size, activation=activation)
        check_expert_activation(activation)
        return SparseMoeBlock(num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                              # (Qwen3-VL-MoE's config has no such key: it always renormalises)
                              renormalize=bool(getattr(cfg, "norm_topk_prob", True)), tp_rank=ctx.tp_rank,
                              tp_size=ctx.tp_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(weights, _STACKED_EXPERTS, hidden=self.ctx.hf_config.hidden_size))

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        return map_expert_weight(name, _EXPERT_PROJS) or super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if isinstance(shard_id, tuple):
            return expert_checkpoint_name(param_name, shard_id, _EXPERT_PROJS)
        return super().checkpoint_name(param_name, shard_id)
