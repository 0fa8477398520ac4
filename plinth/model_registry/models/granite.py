"""Granite (IBM Granite 3.x): Llama's blocks with four multipliers from the config; the mixtures of experts too."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.moe import check_expert_activation
from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM
from plinth.model_registry.models.qwen2_moe import SharedExpertMoeBlock, _ExpertWeights

_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


class GraniteForCausalLM(DecoderForCausalLM):
    """``GraniteForCausalLM``: the embeddings times ``embedding_multiplier``, the softmax scale
    ``attention_multiplier`` (instead of ``head_dim ** -0.5``), each attention and MLP output times
    ``residual_multiplier`` before the residual add, and the logits divided by ``logits_scaling``."""

    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        for key in _MULTIPLIERS:
            value = getattr(cfg, key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise UnsupportedModelError(f"GraniteForCausalLM: {key} must be a positive number, got {value!r}")
        super().__init__(ctx)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0))

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=float(getattr(cfg, "attention_multiplier", 1.0)))

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(activation=getattr(cfg, "hidden_act", None) or "silu",
                            embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)),
                            residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits


class GraniteMoeForCausalLM(_ExpertWeights, GraniteForCausalLM):
    """Granite 3.x mixtures of experts (``GraniteMoeForCausalLM``, e.g. granite-3.0-1b-a400m, and
    ``GraniteMoeSharedForCausalLM`` with a shared MLP every token runs): Granite's multipliers, a softmax over the
    top-k router logits. Checkpoints stack each layer's experts (``block_sparse_moe.input_linear`` ``[E, 2I, H]``,
    gate rows then up rows; ``output_linear`` ``[E, H, I]``); they are read one expert at a time."""

    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        cfg = ctx.hf_config
        activation = self.block_options(cfg).activation
        check_expert_activation(activation)
        block = SharedExpertMoeBlock(ctx, activation, cfg.num_local_experts, cfg.intermediate_size, renormalize=True,
                                     shared_size=getattr(cfg, "shared_intermediate_size", 0) or None, gated=False)
        block.routed.experts.loads_per_expert_tensors = False   # the checkpoint stacks them (read split per expert)
        return block

    def _to_param(self, name: str) -> str:
        return name.replace(".mlp.gate.", ".mlp.routed.gate.", 1).replace(".mlp.experts.", ".mlp.routed.experts.", 1)

    def _from_param(self, param_name: str) -> str:
        return param_name.replace(".mlp.routed.", ".mlp.", 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    @staticmethod
    def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's stacked tensors under per-expert (and per-projection) names."""
        for name, t in weights:
            m = _GRANITE_MOE_TENSOR.match(name)
            if m is None:
                yield name, t
                continue
            layer, kind = m["prefix"], _GRANITE_MOE_KINDS[m["what"]]
            if kind == "router":
                yield f"{layer}.mlp.gate.weight", t
            elif kind == "shared_in":
                half = t.shape[0] // 2
                yield f"{layer}.mlp.shared_expert.gate_proj.weight", t[:half]
                yield f"{layer}.mlp.shared_expert.up_proj.weight", t[half:]
            elif kind == "shared_out":
                yield f"{layer}.mlp.shared_expert.down_proj.weight", t
            elif kind == "experts_in":
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    yield f"{layer}.mlp.experts.{e}.gate_proj.weight", t[e, :half]
                    yield f"{layer}.mlp.experts.{e}.up_proj.weight", t[e, half:]
            else:
                for e in range(t.shape[0]):
                    yield f"{layer}.mlp.experts.{e}.down_proj.weight", t[e]

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        layer = param_name.split(".mlp.", 1)[0]
        if ".mlp.routed.experts.w13_weight" in param_name:
            return f"{layer}.block_sparse_moe.input_linear.weight"
        if ".mlp.routed.experts.w2_weight" in param_name:
            return f"{layer}.block_sparse_moe.output_linear.weight"
        if ".mlp.routed.gate." in param_name:
            return f"{layer}.block_sparse_moe.router.layer.weight"
        if ".mlp.shared_expert.gate_up_proj." in param_name:
            return f"{layer}.shared_mlp.input_linear.weight"
        if ".mlp.shared_expert.down_proj." in param_name:
            return f"{layer}.shared_mlp.output_linear.weight"
        return super().checkpoint_name(param_name, shard_id)


_GRANITE_MOE_TENSOR = re.compile(r"^(?P<prefix>model\.layers\.\d+)\.(?P<what>block_sparse_moe\.router\.layer|"
                                 r"block_sparse_moe\.input_linear|block_sparse_moe\.output_linear|"
                                 r"shared_mlp\.input_linear|shared_mlp\.output_linear)\.weight$")
_GRANITE_MOE_KINDS = {"block_sparse_moe.router.layer": "router", "block_sparse_moe.input_linear": "experts_in",
                      "block_sparse_moe.output_linear": "experts_out", "shared_mlp.input_linear": "shared_in",
                      "shared_mlp.output_linear": "shared_out"}
