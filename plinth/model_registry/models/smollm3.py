"""SmolLM3: Llama's blocks, with no rotary embedding in some layers (``no_rope_layers``, NoPE)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3 (e.g. SmolLM3-3B): ``no_rope_layers[i]`` is 1 where layer ``i`` rotates q and k, 0 where it does
    not (by default every fourth layer, ``no_rope_layer_interval``)."""

    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        flags = getattr(cfg, "no_rope_layers", None)
        if flags is None:
            flags = [1] * cfg.num_hidden_layers
        if (not isinstance(flags, list | tuple) or len(flags) != cfg.num_hidden_layers
                or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
            raise UnsupportedModelError(f"SmolLM3ForCausalLM: no_rope_layers must list 0 or 1 for each of the "
                                        f"{cfg.num_hidden_layers} layers, got {flags!r}")
        self.rope_layers = tuple(bool(f) for f in flags)
        super().__init__(ctx)

    def layer_attention_options(self, cfg: Any, layer_idx: int) -> AttentionOptions:
        return dataclasses.replace(self.attention_options(cfg), rope=self.rope_layers[layer_idx])
