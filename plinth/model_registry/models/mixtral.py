"""Mixtral: Mistral's attention with a sparse mixture of experts (softmax top-k, renormalised)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.moe import (
    SparseMoeBlock,
    check_expert_activation,
    expert_checkpoint_name,
    map_expert_weight,
)
from plinth.model_registry.models.decoder import DecoderForCausalLM

_EXPERT_PROJS = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(DecoderForCausalLM):
    """Checkpoint ``block_sparse_moe.*`` tensors load into each layer's ``mlp``."""

    config_biases: ClassVar[tuple[str, ...]] = ()

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        check_expert_activation(self.block_options(cfg).activation)
        return SparseMoeBlock(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                              cfg.intermediate_size, renormalize=True, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return map_expert_weight(name, _EXPERT_PROJS) or super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        name = param_name.replace(".mlp.", ".block_sparse_moe.")
        if isinstance(shard_id, tuple):
            return expert_checkpoint_name(name, shard_id, _EXPERT_PROJS)
        return super().checkpoint_name(name, shard_id)
