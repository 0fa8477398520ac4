"""Models whose blocks are one pre-norm mixer each, under the checkpoint's ``backbone.`` prefix: Mamba-2
(``Mamba2ForCausalLM``: every block a Mamba-2 mixer) and NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H
8B/47B, Nemotron Nano 2; blocks of Mamba-2 mixers, attention without positional embeddings, or a squared-ReLU MLP,
as ``layers_block_type`` / ``hybrid_override_pattern`` lists them).

Each block is ``h = h + mixer(norm(h))``; the embeddings are ``backbone.embeddings``, the final norm
``backbone.norm_f``. The Mamba layers keep per-sequence state (:mod:`plinth.model_registry.layers.mamba`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.layers.embedding import LMHead, VocabEmbedding
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from plinth.model_registry.layers.mamba import Mamba2Mixer, MambaStateMixin
from plinth.model_registry.models.decoder import AttentionOptions, DecoderAttention

#: block kinds (``layers_block_type``; transformers 5 writes ``linear_attention`` and ``full_attention``)
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
          "mlp": "mlp"}


class UngatedMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (Nemotron-H's squared ReLU)."""

    def __init__(self, ctx: ModelContext, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        from transformers.activations import ACT2FN

        hidden = ctx.hf_config.hidden_size
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        self.up_proj = ColumnParallelLinear(hidden, intermediate_size, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden, bias=bias, **tp)
        if activation not in ACT2FN:
            raise UnsupportedModelError(f"activation {activation!r} is not one transformers knows")
        self.act = ACT2FN[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MixerBlock(nn.Module):
    """``norm`` then one mixer (``kind``: ``"mamba"``, ``"attention"`` or ``"mlp"``); returns ``(mixer output,
    residual stream)``, the next block's norm adding the two (one fused add-and-norm)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, kind: str, mamba: dict[str, Any], eps: float,
                 mlp: tuple[int, str, bool] | None):
        super().__init__()
        cfg = ctx.hf_config
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, eps=eps)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.hidden_size, quant_method=ctx.quant_method, tp_rank=ctx.tp_rank,
                                     tp_size=ctx.tp_size, eps=eps,
                                     **mamba)
        elif kind == "attention":
            self.mixer = DecoderAttention(ctx, layer_idx, AttentionOptions(
                qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                o_bias=bool(getattr(cfg, "attention_bias", False)), rope=False))
        else:
            assert mlp is not None
            self.mixer = UngatedMLP(ctx, *mlp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.kind == "mamba":
            return self.mixer(hidden, metadata), residual
        if self.kind == "attention":
            return self.mixer(hidden, None, None, metadata), residual
        return self.mixer(hidden), residual


class Backbone(nn.Module):
    def __init__(self, ctx: ModelContext, kinds: list[str], mamba: dict[str, Any], eps: float,
                 mlp: tuple[int, str, bool] | None):
        super().__init__()
        cfg = ctx.hf_config
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.layers = nn.ModuleList(MixerBlock(ctx, i, kind, mamba, eps, mlp) for i, kind in enumerate(kinds))
        self.norm_f = RMSNorm(cfg.hidden_size, eps=eps)


class MambaBackboneForCausalLM(MambaStateMixin, CausalLM):
    """The shared model: subclasses say each block's kind and the Mamba mixers' shapes from their config."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v")}
    supports_pipeline_parallel: ClassVar[bool] = False
    lora_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cfg = ctx.hf_config
        if ctx.pp_size > 1:
            raise UnsupportedModelError(f"{type(self).__name__}: pipeline parallelism is not supported for models "
                                        "with Mamba layers yet")
        self.backbone = Backbone(ctx, self.block_kinds(cfg), self.mamba_options(cfg), self.norm_eps(cfg),
                                 self.mlp_options(cfg))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tie_to=self.backbone.embeddings if self.tie_word_embeddings else None,
                              tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)

    def block_kinds(self, cfg: Any) -> list[str]:
        raise NotImplementedError

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        raise NotImplementedError

    def norm_eps(self, cfg: Any) -> float:
        return float(getattr(cfg, "layer_norm_epsilon", 1e-5))

    def mlp_options(self, cfg: Any) -> tuple[int, str, bool] | None:
        return None

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if name.startswith("model."):   # transformers' module names for the backbone
            name = "backbone." + name[len("model."):]
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        if ".mixer.conv1d." in name:
            name = name.replace(".mixer.conv1d.weight", ".mixer.conv_weight").replace(".mixer.conv1d.bias",
                                                                                      ".mixer.conv_bias")
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if ".mixer.conv_" in param_name:
            return param_name.replace(".mixer.conv_weight", ".mixer.conv1d.weight").replace(
                ".mixer.conv_bias", ".mixer.conv1d.bias")
        return super().checkpoint_name(param_name, shard_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: Any = None) -> torch.Tensor:
        self.begin_step(metadata)
        hidden = self.backbone.embeddings(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.backbone.layers:
            hidden, residual = layer(hidden, residual, metadata)
        hidden, _ = self.backbone.norm_f(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _limit(cfg: Any) -> tuple[float, float] | None:
    limit = getattr(cfg, "time_step_limit", None)
    return (float(limit[0]), float(limit[1])) if limit is not None else None


class Mamba2ForCausalLM(MambaBackboneForCausalLM):
    """``Mamba2ForCausalLM`` (Mamba-Codestral and other Mamba-2 checkpoints): every block a Mamba-2 mixer."""

    def block_kinds(self, cfg: Any) -> list[str]:
        return ["mamba"] * cfg.num_hidden_layers

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        if cfg.num_heads * cfg.head_dim != int(cfg.expand * cfg.hidden_size):
            raise ModelLoadError(f"Mamba2: num_heads x head_dim ({cfg.num_heads} x {cfg.head_dim}) must equal expand "
                                 f"x hidden_size ({cfg.expand} x {cfg.hidden_size})")
        return dict(num_heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.state_size,
                    n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                    conv_bias=bool(cfg.use_conv_bias), proj_bias=bool(cfg.use_bias),
                    activation=getattr(cfg, "hidden_act", "silu") or "silu", time_step_limit=_limit(cfg))


class NemotronHForCausalLM(MambaBackboneForCausalLM):
    """``NemotronHForCausalLM``: Mamba-2, attention (no RoPE) and squared-ReLU MLP blocks; mixture-of-experts blocks
    (Nemotron 3) are refused."""

    def block_kinds(self, cfg: Any) -> list[str]:
        types = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None)
        if types is None:
            raise ModelLoadError("NemotronH: the config has no layers_block_type (or hybrid_override_pattern)")
        kinds = []
        for i, kind in enumerate(types):
            if kind not in _KINDS:
                raise UnsupportedModelError(f"NemotronH: block {i} is of kind {kind!r}; supported: "
                                            f"{', '.join(sorted(_KINDS))} (mixture-of-experts blocks are not yet)")
            kinds.append(_KINDS[kind])
        return kinds

    def mamba_options(self, cfg: Any) -> dict[str, Any]:
        return dict(num_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, state_size=cfg.ssm_state_size,
                    n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                    conv_bias=bool(cfg.use_conv_bias), proj_bias=bool(getattr(cfg, "use_bias", False)),
                    activation=getattr(cfg, "mamba_hidden_act", "silu") or "silu", time_step_limit=_limit(cfg))

    def mlp_options(self, cfg: Any) -> tuple[int, str, bool] | None:
        return (cfg.intermediate_size, getattr(cfg, "mlp_hidden_act", "relu2") or "relu2",
                bool(getattr(cfg, "mlp_bias", False)))
