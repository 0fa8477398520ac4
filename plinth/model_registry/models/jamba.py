"""AI21 Jamba (``JambaForCausalLM``: Jamba v0.1, Jamba 1.5/1.6/1.7 Mini and Large, Jamba Reasoning 3B): Mamba-1
mixer layers with attention every ``attn_layer_period`` layers (no positional embeddings: the Mamba layers carry
order), and a mixture of experts instead of the dense MLP every ``expert_layer_period`` layers.

Each layer is ``h = h + mixer(input_layernorm(h))``, then ``h = h + feed_forward(pre_ff_layernorm(h))`` (Granite
4.0's hybrid layer under other names); the mixture of experts routes by a softmax over ``router`` and keeps the
top-k weights as they are (not renormalised). The Mamba layers normalise their time steps and ``B``/``C`` with
weights (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) and keep per-sequence state
(:mod:`plinth.model_registry.layers.mamba`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.mamba import Mamba1Mixer, MambaStateMixin
from plinth.model_registry.layers.moe import (
    SparseMoeBlock,
    check_expert_activation,
    expert_checkpoint_name,
    map_expert_weight,
)
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM, DenseMLP
from plinth.model_registry.models.granite_hybrid import HybridDecoderLayer

_EXPERT_PROJS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
#: checkpoint names -> the hybrid layer's (and the decoder's final norm)
_RENAMES = ((".pre_ff_layernorm.", ".post_attention_layernorm."), (".feed_forward.router.", ".mlp.gate."),
            (".feed_forward.", ".mlp."), ("model.final_layernorm.", "model.norm."))


def layer_kinds(cfg: Any) -> list[str]:
    """``"mamba"`` or ``"attention"`` for each layer (``layers_block_type``, else from the periods)."""
    kinds = getattr(cfg, "layers_block_type", None)
    if kinds is None:
        kinds = ["attention" if i % cfg.attn_layer_period == cfg.attn_layer_offset else "mamba"
                 for i in range(cfg.num_hidden_layers)]
    for i, kind in enumerate(kinds):
        if kind not in ("mamba", "attention"):
            raise UnsupportedModelError(f"Jamba layer {i}: block type {kind!r} (expected mamba or attention)")
    return list(kinds)


def layer_experts(cfg: Any) -> list[int]:
    """Experts of each layer's feed-forward block (1: a dense MLP)."""
    counts = getattr(cfg, "layers_num_experts", None)
    if counts is None:
        counts = [cfg.num_experts if i % cfg.expert_layer_period == cfg.expert_layer_offset else 1
                  for i in range(cfg.num_hidden_layers)]
    return [int(c) for c in counts]


class JambaDecoderLayer(HybridDecoderLayer):
    """A pre-norm Mamba-1 mixer (``mamba``) or attention (``self_attn``), then the pre-norm feed-forward block."""

    def make_mamba(self, ctx: ModelContext, layer_idx: int) -> nn.Module | None:
        cfg = ctx.hf_config
        if layer_kinds(cfg)[layer_idx] != "mamba":
            return None
        rank = cfg.mamba_dt_rank
        if rank == "auto":
            rank = -(-cfg.hidden_size // 16)
        return Mamba1Mixer(
            cfg.hidden_size, cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_d_conv, int(rank),
            conv_bias=bool(cfg.mamba_conv_bias), proj_bias=bool(cfg.mamba_proj_bias),
            activation=getattr(cfg, "hidden_act", "silu") or "silu", inner_norms="weighted",
            norm_eps=cfg.rms_norm_eps, quant_method=ctx.quant_method, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)


class JambaForCausalLM(MambaStateMixin, DecoderForCausalLM):
    """``JambaForCausalLM``. Checkpoint names: ``model.layers.N.mamba.*`` (``in_proj``, ``conv1d``, ``x_proj``,
    ``dt_proj``, ``A_log``, ``D``, ``out_proj``, the three inner norms) or ``self_attn.*``; ``feed_forward.*`` (a
    dense ``gate_proj``/``up_proj``/``down_proj``, or ``router`` and ``experts.E.*``); ``model.final_layernorm``."""

    layer_class: ClassVar[type[nn.Module] | None] = JambaDecoderLayer
    lora_modules: ClassVar[tuple[str, ...]] = ()
    config_biases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        self.has_recurrent_state = self.config_has_recurrent_state(ctx.hf_config)

    @classmethod
    def config_has_recurrent_state(cls, hf_config: Any) -> bool:
        return "mamba" in layer_kinds(hf_config)

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(rope=False)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        activation = self.block_options(cfg).activation
        experts = layer_experts(cfg)[layer_idx]
        if experts > 1:
            check_expert_activation(activation)
            return SparseMoeBlock(experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                                  renormalize=False, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        return DenseMLP(ctx, cfg.intermediate_size, activation=activation)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return map_expert_weight(name, _EXPERT_PROJS) or super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        name = param_name
        for theirs, ours in _RENAMES:
            name = name.replace(ours, theirs)
        if isinstance(shard_id, tuple):
            return expert_checkpoint_name(name, shard_id, _EXPERT_PROJS)
        return super().checkpoint_name(name, shard_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        self.begin_step(metadata)
        return super().forward(input_ids, positions, metadata, image_embeds)
