"""TII Falcon-H1 (``FalconH1ForCausalLM``: Falcon-H1 0.5B to 34B, Falcon-H1R): every layer runs a Mamba-2 mixer and
attention side by side on the same normed input, their outputs summed into the residual stream, then a gated MLP.

Falcon-H1 scales many activations by constants of its config (muP multipliers): the attention's input
(``attention_in_multiplier``) and output (``attention_out_multiplier``), the keys (``key_multiplier``), the Mamba
mixer's input (``ssm_in_multiplier``), each part of its input projection (``ssm_multipliers``: ``z``, ``x``, ``B``,
``C``, ``dt``) and its output (``ssm_out_multiplier``), the MLP's gate and output (``mlp_multipliers``), the
embeddings and the logits. Each of these sits next to a linear map, so they are folded into the weights as the
checkpoint loads (in float32, then rounded to the model's dtype); only the embedding and logit multipliers stay
multiplications. The Mamba layers keep per-sequence state (:mod:`plinth.model_registry.layers.mamba`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.mamba import MambaStateMixin, mamba_width, mixer_from_mamba_config
from plinth.model_registry.models.decoder import (
    AttentionOptions,
    BlockOptions,
    DecoderAttention,
    DecoderForCausalLM,
    DenseMLP,
)


class FalconH1Layer(nn.Module):
    """``h = x + mamba(norm(x)) + attention(norm(x))``, then ``h + feed_forward(pre_ff_layernorm(h))`` (the
    multipliers folded into the weights). Speaks the decoder's ``(hidden, residual)`` protocol."""

    can_defer_output = False
    reduce_input = False

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        cfg = ctx.hf_config
        eps = cfg.rms_norm_eps
        self.input_layernorm = norm(cfg.hidden_size, eps=eps)
        self.pre_ff_layernorm = norm(cfg.hidden_size, eps=eps)
        if not getattr(cfg, "mamba_rms_norm", False):
            mode = "gate"
        else:
            mode = "norm_gate" if getattr(cfg, "mamba_norm_before_gate", True) else "gate_norm"
        self.mamba = mixer_from_mamba_config(ctx, out_bias=bool(getattr(cfg, "projectors_bias", False)),
                                             norm_mode=mode)
        self.self_attn = DecoderAttention(ctx, layer_idx, options, norm)
        self.feed_forward = mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixed = self.mamba(hidden, metadata) + self.self_attn(hidden, cos, sin, metadata)
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class FalconH1ForCausalLM(MambaStateMixin, DecoderForCausalLM):
    """``FalconH1ForCausalLM``: checkpoint names ``model.layers.N.{mamba,self_attn,feed_forward}.*``,
    ``input_layernorm``, ``pre_ff_layernorm``, ``model.final_layernorm``."""

    layer_class: ClassVar[type[nn.Module] | None] = FalconH1Layer
    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")
    #: none: the attention multipliers are folded into the base weights, which an adapter's product would miss
    lora_modules: ClassVar[tuple[str, ...]] = ()
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        **DecoderForCausalLM.packed_modules_mapping, ".final_layernorm.": (".norm.", None)}

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        for key in ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                    "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"):
            value = getattr(cfg, key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UnsupportedModelError(f"FalconH1ForCausalLM: {key} must be a number, got {value!r}")
        super().__init__(ctx)
        self.lm_head_multiplier = float(getattr(cfg, "lm_head_multiplier", 1.0))
        # embeddings given in place of tokens (prompt_embeds) are taken as they are: transformers multiplies only
        # the embeddings it looks up itself by embedding_multiplier
        self.model.image_embed_scale = 1.0

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(activation=getattr(cfg, "hidden_act", None) or "silu",
                            embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)))

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        return DenseMLP(ctx, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)),
                        activation=self.block_options(cfg).activation)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if param_name == "model.norm.weight":
            return "model.final_layernorm.weight"
        return super().checkpoint_name(param_name, shard_id)

    # ------------------------------------------------------------------ the multipliers, folded

    def _factors(self) -> dict[str, tuple[Any, Any]]:
        """Checkpoint name suffix -> (factor of the weight, factor of the bias); a factor is a number or a
        ``[rows]`` vector (the input projection's parts)."""
        cfg = self.ctx.hf_config

        def num(key: str) -> float:
            return float(getattr(cfg, key, 1.0))

        attn_in, key_mult, attn_out = num("attention_in_multiplier"), num("key_multiplier"), \
            num("attention_out_multiplier")
        gate_mult, down_mult = (float(m) for m in (getattr(cfg, "mlp_multipliers", None) or (1.0, 1.0)))
        width, groups, state, heads = mamba_width(cfg), cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_n_heads
        parts = [float(m) for m in (getattr(cfg, "ssm_multipliers", None) or (1.0,) * 5)]
        if len(parts) != 5:
            raise ModelLoadError(f"FalconH1: ssm_multipliers needs five values (z, x, B, C, dt), got {parts!r}")
        mup = torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in
                         zip((width, width, groups * state, groups * state, heads), parts, strict=True)])
        ssm_in = num("ssm_in_multiplier")
        return {
            ".self_attn.q_proj.": (attn_in, 1.0), ".self_attn.k_proj.": (attn_in * key_mult, key_mult),
            ".self_attn.v_proj.": (attn_in, 1.0), ".self_attn.o_proj.": (attn_out, attn_out),
            ".mamba.in_proj.": (mup[:, None] * ssm_in, mup), ".mamba.out_proj.": (num("ssm_out_multiplier"),) * 2,
            ".feed_forward.gate_proj.": (gate_mult, gate_mult), ".feed_forward.down_proj.": (down_mult, down_mult),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._scaled(weights))

    def _scaled(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        factors = self._factors()
        for name, t in weights:
            for fragment, (w_factor, b_factor) in factors.items():
                if fragment in name and name.endswith((".weight", ".bias")):
                    factor = w_factor if name.endswith(".weight") else b_factor
                    if isinstance(factor, float) and factor == 1.0:
                        break
                    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
                        raise ModelLoadError(f"{name}: Falcon-H1's multipliers are folded into the weights, which a "
                                             f"tensor of dtype {t.dtype} (a quantized checkpoint) cannot take")
                    t = (t.to(torch.float32) * factor).to(t.dtype)
                    break
            yield name, t

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits * self.lm_head_multiplier if self.lm_head_multiplier != 1.0 else logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        self.begin_step(metadata)
        return super().forward(input_ids, positions, metadata, image_embeds)
