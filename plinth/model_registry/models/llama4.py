"""Llama 4 (Scout, Maverick): Llama's blocks with chunked local attention, NoPE layers and top-1 experts.

- Attention: RoPE over adjacent pairs of features on the layers ``no_rope_layers`` marks 1; there, with
  ``use_qk_norm``, each head of q and k is RMS-normalised without a weight, and the attention is chunked
  (``layer_types`` ``chunked_attention``: a query at position ``p`` sees positions ``p // attention_chunk_size *
  attention_chunk_size .. p`` only; see :func:`~plinth.attention_backends.interface.chunked_attention_view`). The
  other layers (every fourth by default) take no positional embedding and attend to the whole sequence, their
  queries scaled by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (``attn_temperature_tuning``).
- Feed-forward: on the ``moe_layers`` a router picks one expert per token, whose *input* is the token times the
  sigmoid of its router logit, beside a shared expert every token runs; the other layers have a dense MLP of
  ``intermediate_size_mlp``. The checkpoint's experts are stacked (``feed_forward.experts.gate_up_proj`` ``[E, H,
  2I]``, ``down_proj`` ``[E, I, H]``) and load one expert at a time.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata, check_chunk_blocks
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.linear import ReplicatedLinear
from plinth.model_registry.layers.moe import FusedMoE, check_expert_activation, split_stacked_experts
from plinth.model_registry.layers.rotary import deinterleave_pairs
from plinth.model_registry.models.decoder import (
    AttentionOptions,
    DecoderAttention,
    DecoderForCausalLM,
    DenseMLP,
    MissingLayer,
)
from plinth.model_registry.models.qwen2_moe import _ExpertWeights

_STACKED = re.compile(r"^(?P<prefix>.+\.feed_forward\.experts)\.(?P<which>gate_up_proj|down_proj)$")
#: a stacked projection's quantization tensors (``gate_up_proj_scale``, ...)
_STACKED_EXTRA = re.compile(r"^.+\.feed_forward\.experts\.(gate_up_proj|down_proj)_\w+$")


class _StepScales:
    """The current step's query scales of the NoPE layers (``[T]`` float32), set by the model before its layers run."""

    scales: torch.Tensor | None = None


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, in float32 (Llama 4's q/k norm has no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(DecoderAttention):
    """Llama 4's attention block: the weightless q/k norm and RoPE over adjacent pairs (RoPE layers), or the
    temperature-scaled queries (NoPE layers)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, norm: Any):
        super().__init__(ctx, layer_idx, options, norm)
        cfg = ctx.hf_config
        self.l2_qk = bool(getattr(cfg, "use_qk_norm", True)) and options.rope
        self.eps = float(cfg.rms_norm_eps)
        #: the model's per-step query scales where this NoPE layer takes them (set by :class:`Llama4ForCausalLM`)
        self.step: _StepScales | None = None

    def forward(self, hidden: Any, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            # (transformers normalises after the rotation; a rotation keeps each head's norm, so normalising first
            # is the same and leaves the rotation to backends that fuse it with the cache write)
            if self.l2_qk:
                q, k = weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps)
            q, k = deinterleave_pairs(q, cos.shape[-1]), deinterleave_pairs(k, cos.shape[-1])
        elif self.step is not None and self.step.scales is not None:
            q = (q * self.step.scales[:, None, None]).to(q.dtype)
        out = self.attn(q, k, v, metadata, rotary=(cos, sin) if self.use_rope else None)
        return self.o_proj(out.reshape(t, q_size), reduce=reduce)


class Llama4Experts(FusedMoE):
    """The routed experts: each token's one expert at weight 1 (the router's score scales the expert's input, see
    :class:`Llama4MoE`)."""

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = router_logits.argmax(dim=-1, keepdim=True)
        return torch.ones(ids.shape, dtype=torch.float32, device=ids.device), ids


class Llama4MoE(nn.Module):
    """``shared_expert(x) + expert_e(x * sigmoid(router(x)_e))`` with ``e`` the token's top router logit."""

    def __init__(self, ctx: ModelContext, activation: str):
        super().__init__()
        cfg = ctx.hf_config
        check_expert_activation(activation)
        if cfg.num_experts_per_tok != 1:
            raise UnsupportedModelError(f"Llama 4 with num_experts_per_tok={cfg.num_experts_per_tok}: its experts "
                                        "take inputs scaled by their router scores, which plinth runs for one expert "
                                        "per token (the released models' setting)")
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = Llama4Experts(cfg.num_local_experts, 1, cfg.hidden_size, cfg.intermediate_size, False,
                                     tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.shared_expert = DenseMLP(ctx, cfg.intermediate_size, activation=activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = self.router(x)
        score = torch.sigmoid(logits.max(dim=-1, keepdim=True).values.float()).to(x.dtype)
        return self.shared_expert(x) + self.experts(x * score, logits)


def _flags(cfg: Any, name: str, default: list[Any]) -> list[Any]:
    value = getattr(cfg, name, None)
    value = default if value is None else value
    if not isinstance(value, list | tuple) or len(value) != cfg.num_hidden_layers:
        raise UnsupportedModelError(f"Llama 4: {name} must list each of the {cfg.num_hidden_layers} layers, got "
                                    f"{value!r}")
    return list(value)


class Llama4ForCausalLM(_ExpertWeights, DecoderForCausalLM):
    """``Llama4ForCausalLM`` (and the language model of ``Llama4ForConditionalGeneration`` checkpoints)."""

    attention_class: ClassVar[type[nn.Module]] = Llama4Attention
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        interval = int(getattr(cfg, "no_rope_layer_interval", 4) or 4)
        n = cfg.num_hidden_layers
        self.rope_layers = tuple(bool(f) for f in _flags(cfg, "no_rope_layers",
                                                          [int((i + 1) % interval != 0) for i in range(n)]))
        chunk = getattr(cfg, "attention_chunk_size", None)
        types = _flags(cfg, "layer_types", ["chunked_attention" if r and chunk else "full_attention"
                                            for r in self.rope_layers])
        unknown = sorted({t for t in types if t not in ("chunked_attention", "full_attention")})
        if unknown:
            raise UnsupportedModelError(f"Llama 4: layer types {unknown} (plinth runs chunked_attention and "
                                        "full_attention layers)")
        if "chunked_attention" in types and not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0):
            raise UnsupportedModelError(f"Llama 4: chunked_attention layers need a positive attention_chunk_size, "
                                        f"got {chunk!r}")
        self.chunks = tuple(chunk if t == "chunked_attention" else None for t in types)
        if "chunked_attention" in types:
            check_chunk_blocks(chunk, ctx.block_size, "Llama 4's chunked_attention layers")
        step = int(getattr(cfg, "interleave_moe_layer_step", 1) or 1)
        moe = getattr(cfg, "moe_layers", None)   # (an empty list: every layer dense)
        self.moe_layers = frozenset(range(step - 1, n, step) if moe is None else moe)
        super().__init__(ctx)
        self._step = _StepScales()
        self.temperature = None
        if getattr(cfg, "attn_temperature_tuning", False) and not all(self.rope_layers):
            self.temperature = (float(cfg.floor_scale), float(cfg.attn_scale))
            for layer in self.model.layers:
                if not isinstance(layer, MissingLayer) and not layer.self_attn.use_rope:
                    layer.self_attn.step = self._step

    def layer_attention_options(self, cfg: Any, layer_idx: int) -> AttentionOptions:
        return dataclasses.replace(self.attention_options(cfg), rope=self.rope_layers[layer_idx],
                                   rope_interleaved=True, attention_chunk=self.chunks[layer_idx])

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        activation = self.block_options(cfg).activation
        if layer_idx in self.moe_layers:
            return Llama4MoE(ctx, activation)
        return DenseMLP(ctx, getattr(cfg, "intermediate_size_mlp", None) or cfg.intermediate_size,
                        activation=activation)

    def _scales(self, positions: torch.Tensor) -> None:
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            self._step.scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        self._scales(positions)
        return super().forward(input_ids, positions, metadata, image_embeds)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      image_embeds: tuple[torch.Tensor | None, ...] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._scales(positions)
        return super().forward_stage(input_ids, positions, metadata, hidden, residual, image_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(_refuse_stacked_scales(weights), _STACKED, inputs_first=True))

    def _to_param(self, name: str) -> str:
        return name.replace(".feed_forward.", ".mlp.", 1)

    def _from_param(self, param_name: str) -> str:
        return param_name.replace(".mlp.", ".feed_forward.", 1)


def _refuse_stacked_scales(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        if _STACKED_EXTRA.match(name):
            raise ModelLoadError(f"{name}: quantized experts stored stacked are not supported; plinth reads stacked "
                                 "experts in floating point and quantized ones one tensor per expert")
        yield name, t
