"""StableLM (``StableLmForCausalLM``: StableLM 2 1.6B / 12B, StableLM 3B 4E1T, Zephyr and the like): Llama's blocks
with LayerNorms that have a bias (``layer_norm_eps``), RoPE over ``partial_rotary_factor`` of each head, q/k/v biases
where ``use_qkv_bias`` says. ``use_parallel_residual`` (12B) runs Cohere's parallel block (one norm feeding the
attention and the MLP); ``qk_layernorm`` (12B) gives each head's queries and keys their own LayerNorm without a bias,
stored per head in the checkpoint (``self_attn.q_layernorm.norms.{h}.weight``)."""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar

from torch import nn

from plinth.model_registry.layers.layernorm import LayerNorm
from plinth.model_registry.models.cohere import CohereAttention, CohereDecoderLayer
from plinth.model_registry.models.decoder import AttentionOptions, BlockOptions, DecoderForCausalLM

_HEAD_NORM = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?P<which>q|k)_layernorm\.norms\.(?P<head>\d+)\.weight$")


class StableLmAttention(CohereAttention):
    """The shared attention block with StableLM's per-head q/k LayerNorms (``qk_layernorm``)."""

    qk_norm_field: ClassVar[str] = "qk_layernorm"

    def __init__(self, ctx: Any, layer_idx: int, options: AttentionOptions, norm: Any = None):
        super().__init__(ctx, layer_idx, options)
        cfg = ctx.hf_config
        if self.q_norm is not None:   # one checkpoint tensor per head, every head loaded (each rank keeps its own)
            self.q_norm.weight.expected_shards = tuple(range(cfg.num_attention_heads))  # type: ignore[attr-defined]
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.k_norm.weight.expected_shards = tuple(range(kv_heads))  # type: ignore[attr-defined]


class StableLmParallelLayer(CohereDecoderLayer):
    """``use_parallel_residual``: one LayerNorm feeding the attention and the MLP, both added to the stream."""

    attention: ClassVar[type[nn.Module]] = StableLmAttention


class StableLmForCausalLM(DecoderForCausalLM):
    """See the module docstring."""

    partial_rotary: ClassVar[bool] = True

    attention_class: ClassVar[type[nn.Module]] = StableLmAttention

    def __init__(self, ctx: Any):
        if getattr(ctx.hf_config, "use_parallel_residual", False):
            self.layer_class = StableLmParallelLayer   # type: ignore[misc]
        super().__init__(ctx)

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "use_qkv_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=False)

    def block_options(self, cfg: Any) -> BlockOptions:
        return BlockOptions(norm=functools.partial(LayerNorm, bias=True),  # type: ignore[arg-type]
                            activation=getattr(cfg, "hidden_act", None) or "silu", norm_eps=cfg.layer_norm_eps)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        m = _HEAD_NORM.match(name)
        if m is not None:   # one head's q/k norm: a row of this rank's [heads, head_dim] weight
            return f"{m['prefix']}.{m['which']}_norm.weight", int(m["head"])
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        if isinstance(shard_id, int) and param_name.endswith(("q_norm.weight", "k_norm.weight")):
            which = param_name[-len("q_norm.weight")]
            return param_name.replace(f"{which}_norm.weight", f"{which}_layernorm.norms.{shard_id}.weight")
        return super().checkpoint_name(param_name, shard_id)
