"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B) and the Qwen3.5 language models
(``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): gated DeltaNet layers (linear attention with per-sequence
state, :mod:`plinth.model_registry.layers.gated_delta`) and gated attention layers as ``layer_types`` lists them
(three of the first to one of the second in the released models).

- Gated attention: ``q_proj`` gives each head's query and an output gate side by side; per-head q/k norms; RoPE over
  ``partial_rotary_factor`` of each head; the attention output times ``sigmoid(gate)`` before ``o_proj``.
- Norms scale by ``1 + w`` (the checkpoint stores ``w``), in float32.
- Feed-forward: Qwen2-MoE's sparse block (softmax top-k, ``norm_topk_prob``, a shared expert scaled by
  ``sigmoid(shared_expert_gate(x))``) on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick (Qwen3-Next,
  Qwen3.5-MoE); a dense gated MLP otherwise (Qwen3.5).

The DeltaNet layers' states go where the Mamba layers' go, so the prefix cache (checkpoint slots), the CUDA decode
graphs, tensor parallelism (split by key heads) and sleep mode work as they do for the Mamba hybrids.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.gated_delta import GatedDeltaNetMixer
from plinth.model_registry.layers.layernorm import GemmaRMSNorm
from plinth.model_registry.layers.mamba import MambaStateMixin
from plinth.model_registry.layers.moe import split_stacked_experts
from plinth.model_registry.models.decoder import (
    AttentionOptions,
    BlockOptions,
    DecoderAttention,
)
from plinth.model_registry.models.granite_hybrid import HybridDecoderLayer, is_mamba_layer
from plinth.model_registry.models.qwen2_moe import Qwen2MoeForCausalLM

_RENAMES = ((".linear_attn.", ".mamba."),)
#: an expert layer's tensors stacked over its experts (transformers' own layout, which Qwen3.5-MoE checkpoints use):
#: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<which>gate_up_proj|down_proj)$")


class GatedAttention(DecoderAttention):
    """Attention whose output is gated per feature by ``sigmoid`` of a second half of ``q_proj`` (each head's
    ``[query, gate]`` side by side in the checkpoint's rows)."""

    #: twice the query rows: as many "heads" of head_dim, split over ranks in whole (query, gate) pairs
    query_parts: ClassVar[int] = 2

    def forward(self, hidden: Any, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qg, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.reshape(t, self.num_kv_heads, d))
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, d), metadata,
                        rotary=(cos, sin) if self.use_rope else None)
        out = out.reshape(t, q_size) * torch.sigmoid(gate.reshape(t, q_size))
        return self.o_proj(out, reduce=reduce)


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """A pre-norm gated DeltaNet (``linear_attn``, held as ``mamba``) or gated attention, then the pre-norm
    feed-forward block."""

    attention: ClassVar[type[nn.Module]] = GatedAttention

    def make_mamba(self, ctx: ModelContext, layer_idx: int) -> nn.Module | None:
        cfg = ctx.hf_config
        if not is_mamba_layer(cfg, layer_idx):
            return None
        layout = "split" if getattr(cfg, "model_type", "").startswith("qwen3_5") else "qkvz"
        return GatedDeltaNetMixer(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, layout=layout,
            activation=getattr(cfg, "hidden_act", "silu") or "silu", quant_method=ctx.quant_method,
            tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)


class Qwen3NextForCausalLM(MambaStateMixin, Qwen2MoeForCausalLM):
    """``Qwen3NextForCausalLM``. Checkpoint names: ``model.layers.N.linear_attn.*`` (``in_proj_qkvz``,
    ``in_proj_ba``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``) or ``self_attn.*`` (``q_proj``
    twice the heads' width, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``); ``mlp.gate``,
    ``mlp.experts.E.*``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate`` (or a dense ``mlp.*``)."""

    layer_class: ClassVar[type[nn.Module] | None] = Qwen3NextDecoderLayer
    partial_rotary: ClassVar[bool] = True
    lora_modules: ClassVar[tuple[str, ...]] = ()
    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias",)

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        self.has_recurrent_state = self.config_has_recurrent_state(ctx.hf_config)

    @classmethod
    def config_has_recurrent_state(cls, hf_config: Any) -> bool:
        return any(is_mamba_layer(hf_config, i) for i in range(hf_config.num_hidden_layers))

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                o_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm=True)

    def block_options(self, cfg: Any) -> BlockOptions:
        return dataclasses.replace(super().block_options(cfg), norm=GemmaRMSNorm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(weights, _STACKED_EXPERTS))

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if name.startswith("mtp."):   # the multi-token-prediction layer: not run
            return None
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        name = super().checkpoint_name(param_name, shard_id)
        for theirs, ours in _RENAMES:
            name = name.replace(ours, theirs)
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        self.begin_step(metadata)
        return super().forward(input_ids, positions, metadata, image_embeds)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):   # noqa: N801 (the checkpoint's architecture name)
    """``Qwen3_5ForCausalLM`` (a dense MLP on every layer) and, as a subclass, ``Qwen3_5MoeForCausalLM``: Qwen3-Next's
    layers with the DeltaNet projections as four tensors (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):   # noqa: N801
    """``Qwen3_5MoeForCausalLM``: Qwen3.5 with Qwen3-Next's sparse feed-forward blocks."""
