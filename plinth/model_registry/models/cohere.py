"""Cohere's Command-R family (``CohereForCausalLM``: Command-R, Command-R+, Aya 23 / Expanse) and its successor
(``Cohere2ForCausalLM``: Command-R7B, Command A).

One parallel block per layer: a single LayerNorm without a bias (``input_layernorm``, normalised in float32, epsilon
``layer_norm_eps``) feeds both the attention and the gated SiLU MLP, and both outputs join the residual stream
together (under tensor parallelism their partial sums are reduced in one all-reduce). RoPE rotates adjacent pairs
(GPT-J style). Command-R+ normalises each head's queries and keys with a LayerNorm whose weights differ per head
(``use_qk_norm``). The logits are multiplied by ``logit_scale``; embeddings are usually tied. Cohere2 alternates
sliding-window layers, which take RoPE, with full-attention layers, which take none (``layer_types``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plinth.distributed.communication import tp_all_reduce
from plinth.errors import ModelLoadError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.attention import AttentionMetadata
from plinth.model_registry.layers.layernorm import LayerNorm
from plinth.model_registry.models.decoder import (
    AttentionOptions,
    BlockOptions,
    DecoderAttention,
    DecoderForCausalLM,
)


def CohereLayerNorm(hidden_size: int | tuple[int, ...], eps: float = 1e-5) -> LayerNorm:   # noqa: N802
    """Cohere's LayerNorm: no bias, in float32 (see :class:`~plinth.model_registry.layers.layernorm.LayerNorm`)."""
    return LayerNorm(hidden_size, eps=eps)


class CohereAttention(DecoderAttention):
    """The shared attention block; with ``use_qk_norm`` each head's queries and keys pass a LayerNorm with that head's
    weights (this rank's heads of the checkpoint's ``[heads, head_dim]``), before RoPE."""

    #: the config field that turns the per-head q/k LayerNorms on
    qk_norm_field: ClassVar[str] = "use_qk_norm"

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, norm: Any = None):
        super().__init__(ctx, layer_idx, options)
        cfg = ctx.hf_config
        if getattr(cfg, self.qk_norm_field, False):
            eps = cfg.layer_norm_eps
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps=eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps=eps)
            for norm_module in (self.q_norm, self.k_norm):
                norm_module.weight.weight_loader = self._load_head_rows  # type: ignore[attr-defined]

    def _load_head_rows(self, param: nn.Parameter, loaded: torch.Tensor, head: int | None = None) -> None:
        """The checkpoint's ``[heads, head_dim]`` weights (or, with ``head``, one head's ``[head_dim]``): this rank's
        heads, or its replica of a key/value head when there are fewer than ranks."""
        heads, dim = param.shape
        if head is not None:   # one head's norm (StableLM stores a LayerNorm per head)
            if tuple(loaded.shape) != (dim,):
                raise ModelLoadError(f"shape mismatch: expected ({dim},), checkpoint has {tuple(loaded.shape)}")
            replicas = self.qkv_proj.kv_replicas if param is self.k_norm.weight else 1
            first = self.tp_rank // replicas * heads
            if first <= head < first + heads:
                param.data[head - first].copy_(loaded)
            return
        if loaded.dim() != 2 or loaded.shape[1] != dim:
            raise ModelLoadError(f"shape mismatch: expected [heads, {dim}], checkpoint has {tuple(loaded.shape)}")
        total = loaded.shape[0]
        if total == heads * self.tp_size:          # query heads, or key/value heads split over the ranks
            param.data.copy_(loaded.narrow(0, self.tp_rank * heads, heads))
        elif heads == 1 and self.tp_size % total == 0:   # fewer key/value heads than ranks: each rank's copy
            param.data.copy_(loaded[self.tp_rank * total // self.tp_size][None])
        else:
            raise ModelLoadError(f"shape mismatch: expected {heads * self.tp_size} heads, checkpoint has "
                                 f"{loaded.shape[0]}")


class CohereDecoderLayer(nn.Module):
    """Cohere's parallel block: ``stream + attention(norm(stream)) + mlp(norm(stream))`` (see the module docstring),
    in :class:`~plinth.model_registry.models.decoder.DecoderLayer`'s ``(hidden, residual)`` protocol: the layer
    returns its block output and the stream before it, which the next layer (or the final norm) adds."""

    can_defer_output = False
    defer_output = False
    reduce_input = False

    #: the attention block (StableLM's names its q/k norms differently)
    attention: ClassVar[type[nn.Module]] = CohereAttention

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: Any = CohereLayerNorm):
        super().__init__()
        cfg = ctx.hf_config
        self.input_layernorm = norm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = self.attention(ctx, layer_idx, options)
        self.mlp = mlp
        #: both blocks' partial sums are added before one all-reduce (neither output projection has a bias)
        self.reduce_once = ctx.tp_size > 1 and self.self_attn.o_proj.bias is None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        x = self.input_layernorm(stream)
        if self.reduce_once:
            out = self.self_attn(x, cos, sin, metadata, reduce=False) + self.mlp(x, reduce=False)
            return tp_all_reduce(out), stream
        return self.self_attn(x, cos, sin, metadata) + self.mlp(x), stream


class CohereForCausalLM(DecoderForCausalLM):
    """Command-R / R+ / Aya (see the module docstring)."""

    layer_class: ClassVar[type[nn.Module] | None] = CohereDecoderLayer

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        self.logit_scale = float(getattr(ctx.hf_config, "logit_scale", 1.0) or 1.0)

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope_interleaved=True)

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=CohereLayerNorm, activation=getattr(cfg, "hidden_act", None) or "silu",  # type: ignore[arg-type]
                            norm_eps=cfg.layer_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command-R7B / Command A: Cohere's block with sliding-window layers (RoPE) between full-attention ones (no
    RoPE), as ``layer_types`` lists them."""

    def layer_attention_options(self, cfg: Any, layer_idx: int) -> AttentionOptions:
        options = self.attention_options(cfg)
        layer_types = getattr(cfg, "layer_types", None) or ()
        sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
        return AttentionOptions(qkv_bias=options.qkv_bias, o_bias=options.o_bias, rope_interleaved=True, rope=sliding)
