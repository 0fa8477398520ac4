"""Phi-1 / Phi-1.5 / Phi-2 (``PhiForCausalLM``): Cohere's parallel block (one LayerNorm, with a bias, feeding the
attention and the MLP) with q/k/v and output (``dense``) biases, RoPE over ``partial_rotary_factor`` of each head, an
ungated MLP ``fc2(act(fc1(x)))`` with biases (``gelu_new``), optional q/k LayerNorms shared by the heads
(``qk_layernorm``), a final LayerNorm (``model.final_layernorm``) and an LM head with a bias."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.activations import ACT2FN

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.layernorm import LayerNorm
from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from plinth.model_registry.models.cohere import CohereDecoderLayer
from plinth.model_registry.models.decoder import (
    AttentionOptions,
    BlockOptions,
    DecoderAttention,
    DecoderForCausalLM,
)

# checkpoint name fragment -> plinth's
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), ("model.final_layernorm.", "model.norm."))


def _ours(name: str) -> str:
    for theirs, ours in _RENAMES:
        name = name.replace(theirs, ours)
    return name


class PlainMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases (an ungated MLP); under tensor parallelism ``fc1`` splits its outputs and
    ``fc2`` its inputs."""

    def __init__(self, ctx: ModelContext, intermediate_size: int, activation: str, bias: bool = True):
        super().__init__()
        hidden = ctx.hf_config.hidden_size
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        self.fc1 = ColumnParallelLinear(hidden, intermediate_size, bias=bias, **tp)
        self.fc2 = RowParallelLinear(intermediate_size, hidden, bias=bias, **tp)
        if activation not in ACT2FN:
            raise UnsupportedModelError(f"activation {activation!r} is not one transformers knows")
        self.act = ACT2FN[activation]

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)), reduce=reduce)


class PhiAttention(DecoderAttention):
    """The shared attention block; with ``qk_layernorm`` one LayerNorm (with a bias) over each head's queries and one
    over its keys, the same weights for every head."""

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, norm: Any = None):
        super().__init__(ctx, layer_idx, options)
        cfg = ctx.hf_config
        if getattr(cfg, "qk_layernorm", False):
            self.q_norm = LayerNorm(self.head_dim, eps=cfg.layer_norm_eps, bias=True)
            self.k_norm = LayerNorm(self.head_dim, eps=cfg.layer_norm_eps, bias=True)


class PhiDecoderLayer(CohereDecoderLayer):
    attention: ClassVar[type[nn.Module]] = PhiAttention


class PhiForCausalLM(DecoderForCausalLM):
    """See the module docstring."""

    partial_rotary: ClassVar[bool] = True

    layer_class: ClassVar[type[nn.Module] | None] = PhiDecoderLayer
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "fc1", "fc2")
    #: the modules adapters name (the checkpoint's): q/k/v as Llama's, the output projection ``dense``, the MLP's
    #: ``fc1`` and ``fc2``
    lora_adapter_targets: ClassVar[dict[str, tuple[str, str, str]]] = {
        "q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
        "v_proj": ("self_attn", "hidden", "kv"), "dense": ("self_attn", "q", "hidden"),
        "fc1": ("mlp", "hidden", "intermediate"), "fc2": ("mlp", "intermediate", "hidden")}

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if self.lm_head is not None:   # Phi's head has a bias over the whole vocabulary (added after the gather)
            self.lm_head.bias = nn.Parameter(torch.zeros(ctx.hf_config.vocab_size), requires_grad=False)
            # a base-model checkpoint (PhiModel, run for embeddings) has no head: its tied head has no bias either
            self.lm_head.bias.optional_in_checkpoint = bool(getattr(ctx.hf_config, "tie_word_embeddings", False))

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True)

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=functools.partial(LayerNorm, bias=True),  # type: ignore[arg-type]
                            activation=getattr(cfg, "hidden_act", None) or "gelu_new", norm_eps=cfg.layer_norm_eps)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        return PlainMLP(ctx, cfg.intermediate_size, getattr(cfg, "hidden_act", None) or "gelu_new")

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        return super().map_weight_name(_ours(name))   # also for LoRA adapters' module names (``dense``, ...)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's names as plinth's (before the pipeline stage picks its tensors by them)."""
        super().load_weights((_ours(name), tensor) for name, tensor in weights)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        name = super().checkpoint_name(param_name, shard_id)
        for theirs, ours in _RENAMES:
            name = name.replace(ours, theirs)
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits + self.lm_head.bias.float()
