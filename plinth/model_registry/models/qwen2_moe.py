"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and OLMoE: sparse experts on a Qwen2 or OLMo-style decoder.

- Qwen2-MoE: Qwen2's attention (q/k/v biases); on each sparse layer a softmax top-k router (renormalised with
  ``norm_topk_prob``) and a shared expert every token runs, scaled by ``sigmoid(shared_expert_gate(x))``; layers
  in ``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense.
- OLMoE (``OlmoeForCausalLM``): Llama's pre-norm blocks, RMSNorm over each token's whole q and k projections (as
  OLMo 2, so tensor parallelism is refused), q/k/v clamped to ``clip_qkv`` when set, 64 experts without a
  shared one.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.linear import ReplicatedLinear
from plinth.model_registry.layers.moe import (
    SparseMoeBlock,
    check_expert_activation,
    expert_checkpoint_name,
    map_expert_weight,
)
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM, DenseMLP
from plinth.model_registry.models.qwen2 import Qwen2ForCausalLM

_EXPERT_PROJS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _sparse(cfg: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (``mlp_only_layers``, ``decoder_sparse_step``)."""
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (getattr(cfg, "num_experts", 0) or 0) > 0
            and (layer_idx + 1) % (getattr(cfg, "decoder_sparse_step", 1) or 1) == 0)


class SharedExpertMoeBlock(nn.Module):
    """The routed experts (``routed``) plus, where ``shared_size`` is set, a shared expert every token runs
    (``shared_expert``), scaled per token by ``sigmoid(shared_expert_gate(x))`` when ``gated``."""

    def __init__(self, ctx: ModelContext, activation: str, num_experts: int, intermediate_size: int,
                 renormalize: bool, shared_size: int | None, gated: bool):
        super().__init__()
        cfg = ctx.hf_config
        self.routed = SparseMoeBlock(num_experts, cfg.num_experts_per_tok, cfg.hidden_size, intermediate_size,
                                     renormalize=renormalize, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.shared_expert = DenseMLP(ctx, shared_size, activation=activation) if shared_size else None
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False) if shared_size and gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.routed(x)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(self.shared_expert_gate(x))
        return out + shared


class _ExpertWeights:
    """Checkpoint names of per-expert tensors (``mlp.experts.{e}.{gate,up,down}_proj``) for the stacked experts;
    the router is ``mlp.gate``."""

    def _to_param(self, name: str) -> str:
        return name

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        mapped = map_expert_weight(self._to_param(name), _EXPERT_PROJS)
        if mapped is not None:
            return mapped
        return super().map_weight_name(self._to_param(name))  # type: ignore[misc]

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        name = self._from_param(param_name)
        if isinstance(shard_id, tuple):
            return expert_checkpoint_name(name, shard_id, _EXPERT_PROJS)
        return super().checkpoint_name(name, shard_id)  # type: ignore[misc]

    def _from_param(self, param_name: str) -> str:
        return param_name


class Qwen2MoeForCausalLM(_ExpertWeights, Qwen2ForCausalLM):
    """Qwen2-MoE: the sparse layers' routed experts live under ``mlp.routed`` (the checkpoint's ``mlp.gate`` and
    ``mlp.experts``), beside ``mlp.shared_expert`` and ``mlp.shared_expert_gate``."""

    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def attention_options(self, cfg: Any) -> AttentionOptions:
        """q/k/v biases unless the config's ``qkv_bias`` says otherwise (Qwen2-MoE's own field)."""
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "qkv_bias", True)), o_bias=False)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        activation = self.block_options(cfg).activation
        if not _sparse(cfg, layer_idx):
            return DenseMLP(ctx, cfg.intermediate_size, activation=activation)
        check_expert_activation(activation)
        # (Qwen3.5-MoE's config has no norm_topk_prob: its router always renormalises)
        return SharedExpertMoeBlock(ctx, activation, cfg.num_experts, cfg.moe_intermediate_size,
                                    bool(getattr(cfg, "norm_topk_prob", True)), cfg.shared_expert_intermediate_size,
                                    gated=True)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        """A config without a shared expert (``shared_expert_intermediate_size`` 0) still has transformers write
        its empty projections and its gate, which multiplies nothing: skipped."""
        if (not getattr(self.ctx.hf_config, "shared_expert_intermediate_size", 0)
                and (".mlp.shared_expert." in name or ".mlp.shared_expert_gate." in name)):
            return None
        return super().map_weight_name(name)

    def _to_param(self, name: str) -> str:
        for part in (".mlp.gate.", ".mlp.experts."):
            if part in name:
                return name.replace(".mlp.", ".mlp.routed.", 1)
        return name

    def _from_param(self, param_name: str) -> str:
        return param_name.replace(".mlp.routed.", ".mlp.", 1)


class OlmoeForCausalLM(_ExpertWeights, DecoderForCausalLM):
    """OLMoE-1B-7B: pre-norm blocks, q/k norms over all heads, ``clip_qkv``, experts on every layer."""

    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        clip = getattr(cfg, "clip_qkv", None)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm_full=True,
                                clip_qkv=float(clip) if clip is not None else None)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        check_expert_activation(self.block_options(cfg).activation)
        return SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                              renormalize=bool(getattr(cfg, "norm_topk_prob", False)), tp_rank=ctx.tp_rank,
                              tp_size=ctx.tp_size)
