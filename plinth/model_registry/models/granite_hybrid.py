"""IBM Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``: granite-4.0-h-micro, -h-tiny, -h-small, and the
attention-only granite-4.0-micro): Mamba-2 mixer layers and attention layers (``layer_types``), Granite's four
multipliers, a shared MLP on every layer and, where ``num_local_experts`` is set, routed experts beside it.

The Mamba layers keep recurrent state for every running sequence (:mod:`plinth.model_registry.layers.mamba`):
the engine keeps that state at block boundaries for the prefix cache and refuses speculative decoding (a rejected
draft would have to take the state back). Tensor parallelism splits the Mamba layers by heads
(:class:`~plinth.model_registry.layers.mamba.Mamba2Mixer`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.mamba import MambaStateMixin, mixer_from_mamba_config
from plinth.model_registry.models.decoder import AttentionOptions, DecoderAttention, DenseMLP
from plinth.model_registry.models.granite import GraniteMoeForCausalLM

#: ``layer_types`` values of Mamba layers (transformers 5 writes ``linear_attention``; released configs ``mamba``)
MAMBA_LAYER_TYPES = frozenset({"mamba", "linear_attention"})
ATTENTION_LAYER_TYPES = frozenset({"attention", "full_attention"})


def is_mamba_layer(cfg: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a hybrid config is a Mamba layer (every layer is, without ``layer_types``)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return True
    kind = types[layer_idx]
    if kind not in MAMBA_LAYER_TYPES | ATTENTION_LAYER_TYPES:
        raise UnsupportedModelError(f"layer {layer_idx}: layer type {kind!r} is not supported (supported: "
                                    f"{', '.join(sorted(MAMBA_LAYER_TYPES | ATTENTION_LAYER_TYPES))})")
    return kind in MAMBA_LAYER_TYPES


class HybridDecoderLayer(nn.Module):
    """Granite 4.0's block: a pre-norm Mamba-2 mixer (``mamba``) or attention (``self_attn``), then the pre-norm
    MLP; each output times ``residual_multiplier`` before it joins the residual stream. Speaks
    :class:`~plinth.model_registry.models.decoder.DecoderLayer`'s ``(hidden, residual)`` protocol (one rank)."""

    can_defer_output = False
    reduce_input = False
    #: the attention block of the attention layers (built as ``attention(ctx, layer_idx, options, norm)``)
    attention: ClassVar[type[nn.Module]] = DecoderAttention

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        cfg = ctx.hf_config
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0))
        self.input_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn: nn.Module | None = None
        self.mamba = self.make_mamba(ctx, layer_idx)
        if self.mamba is None:
            self.self_attn = self.attention(ctx, layer_idx, options, norm)
        self.mlp = mlp

    def make_mamba(self, ctx: ModelContext, layer_idx: int) -> nn.Module | None:
        """The layer's Mamba mixer, or ``None`` for an attention layer (Granite 4.0's: ``layer_types``)."""
        return mixer_from_mamba_config(ctx) if is_mamba_layer(ctx.hf_config, layer_idx) else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.mamba is not None:
            hidden = self.mamba(hidden, metadata)
        else:
            assert self.self_attn is not None
            hidden = self.self_attn(hidden, cos, sin, metadata)
        m = self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden * m if m != 1.0 else hidden, residual)
        hidden = self.mlp(hidden)
        return (hidden * m if m != 1.0 else hidden), residual


class GraniteMoeHybridForCausalLM(MambaStateMixin, GraniteMoeForCausalLM):
    """``GraniteMoeHybridForCausalLM``. Checkpoint names: ``model.layers.N.mamba.*`` (``in_proj``, ``conv1d``,
    ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``) or ``self_attn.*``; ``shared_mlp.input_linear`` (gate rows
    then up rows) and ``output_linear``; ``block_sparse_moe.*`` as Granite 3's mixtures of experts. RoPE only where
    ``position_embedding_type`` is ``"rope"``."""

    layer_class: ClassVar[type[nn.Module] | None] = HybridDecoderLayer
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def __init__(self, ctx: ModelContext):
        self.has_experts = int(getattr(ctx.hf_config, "num_local_experts", 0) or 0) > 0
        super().__init__(ctx)
        self.has_recurrent_state = self.config_has_recurrent_state(ctx.hf_config)

    @classmethod
    def config_has_recurrent_state(cls, hf_config: Any) -> bool:
        """Granite 4.0's attention-only models (granite-4.0-micro) keep no state: they run as any model does."""
        return any(is_mamba_layer(hf_config, i) for i in range(hf_config.num_hidden_layers))

    def attention_options(self, cfg: Any) -> AttentionOptions:
        return dataclasses.replace(super().attention_options(cfg),
                                   rope=getattr(cfg, "position_embedding_type", None) == "rope")

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        if self.has_experts:
            return super().make_mlp(ctx, layer_idx)
        return DenseMLP(ctx, ctx.hf_config.shared_intermediate_size, activation=self.block_options(ctx.hf_config).activation)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.has_experts:   # the shared MLP is the layer's MLP
            weights = self._dense_mlp(weights)
        super().load_weights(weights)

    @staticmethod
    def _dense_mlp(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The shared MLP's tensors under the dense MLP's names: ``input_linear`` (gate rows, then up rows) split in
        two, with its per-row scales (an FP8 checkpoint's ``weight_scale``, ``weight_scale_inv``); a scalar scale
        goes to both halves."""
        for name, t in weights:
            m = _SHARED_MLP.match(name)
            if m is None:
                yield name, t
            elif m["what"] == "input_linear":
                for proj, part in zip(("gate_proj", "up_proj"), _halves(t), strict=True):
                    yield f"{m['prefix']}.mlp.{proj}.{m['tensor']}", part
            else:
                yield f"{m['prefix']}.mlp.down_proj.{m['tensor']}", t

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if not self.has_experts and ".mlp." in param_name:
            layer = param_name.split(".mlp.", 1)[0]
            if ".mlp.gate_up_proj." in param_name:
                return f"{layer}.shared_mlp.input_linear.weight"
            if ".mlp.down_proj." in param_name:
                return f"{layer}.shared_mlp.output_linear.weight"
        return super().checkpoint_name(param_name, shard_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        self.begin_step(metadata)
        return super().forward(input_ids, positions, metadata, image_embeds)


_SHARED_MLP = re.compile(r"^(?P<prefix>model\.layers\.\d+)\.shared_mlp\.(?P<what>input_linear|output_linear)\."
                         r"(?P<tensor>weight|bias|weight_scale|weight_scale_inv|input_scale)$")


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused gate/up tensor's two halves of rows (a scalar, a per-tensor scale: itself twice)."""
    if t.dim() == 0 or t.numel() == 1:
        return t, t
    if t.shape[0] % 2:
        from plinth.errors import ModelLoadError

        raise ModelLoadError(f"shared_mlp.input_linear: {t.shape[0]} rows do not split into gate and up halves")
    half = t.shape[0] // 2
    return t[:half], t[half:]
