"""ModernBERT (``ModernBertModel``, ``ModernBertForSequenceClassification``): an encoder-only model with pre-norm
layers, rotary positions, a gated GELU MLP, no biases by default, and attention that alternates between the whole
input (every ``global_attn_every_n_layers``-th layer, from the first) and a local window of ``local_attention / 2``
positions on each side (the others, with their own RoPE base). Embedding models built on it (gte-modernbert,
modernbert-embed) and its classifiers (rerankers such as gte-reranker-modernbert) run as the other encoders do
(:mod:`plinth.model_registry.models.bert`): each input whole in one step, no KV cache, no prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.activation import GATED_ACTIVATIONS
from plinth.model_registry.layers.embedding import VocabEmbedding
from plinth.model_registry.layers.layernorm import LayerNorm
from plinth.model_registry.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from plinth.model_registry.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from plinth.model_registry.models.bert import EncoderModel, EncoderStep

#: checkpoint tensors that are not the encoder's (the classifier's head is read by the engine; the masked-LM head)
_NOT_ENCODER = ("head.", "classifier.", "decoder.")


def local_window(cfg: Any) -> int:
    """How far a local layer sees on each side: ``local_attention // 2`` (transformers' ``sliding_window``)."""
    window = getattr(cfg, "local_attention", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise UnsupportedModelError(f"local_attention must be an integer of at least 2, got {window!r}")
    return window // 2


def layer_kinds(cfg: Any) -> list[str]:
    """Each layer's attention: ``full_attention`` or ``sliding_attention`` (``layer_types``, else every
    ``global_attn_every_n_layers``-th layer from the first is full)."""
    kinds = getattr(cfg, "layer_types", None)
    n = int(cfg.num_hidden_layers)
    if not kinds:
        every = int(getattr(cfg, "global_attn_every_n_layers", 3) or 3)
        kinds = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(n)]
    kinds = list(kinds)
    if len(kinds) != n or any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise UnsupportedModelError(f"layer_types must name full_attention or sliding_attention for each of the "
                                    f"{n} layers, got {kinds!r}")
    return kinds


class ModernBertLayer(nn.Module):
    def __init__(self, ctx: ModelContext, index: int, kind: str):
        super().__init__()
        cfg = ctx.hf_config
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
        heads = int(cfg.num_attention_heads)
        eps, norm_bias = float(cfg.norm_eps), bool(getattr(cfg, "norm_bias", False))
        self.head_size = divide(hidden, heads, "hidden size over the attention heads")
        self.num_heads = divide(heads, ctx.tp_size, "number of attention heads")
        # (the first layer's input is the normed embedding: no norm of its own)
        self.attn_norm = LayerNorm(hidden, eps, bias=norm_bias) if index else None
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv = QKVParallelLinear(hidden, self.head_size, heads, heads, bias=bias, **tp)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=bias, **tp)
        self.mlp_norm = LayerNorm(hidden, eps, bias=norm_bias)
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=mlp_bias, **tp)
        act = getattr(cfg, "hidden_activation", "gelu")
        if act not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_activation {act!r}: ModernBERT's gated MLP runs "
                                        f"{', '.join(sorted(GATED_ACTIVATIONS))}")
        self.act = GATED_ACTIVATIONS[act]()
        self.down = RowParallelLinear(inter, hidden, bias=mlp_bias, **tp)
        self.window = local_window(cfg) if kind == "sliding_attention" else None
        self.kind = kind

    def forward(self, x: torch.Tensor, step: EncoderStep, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        qkv = self.qkv(h).view(x.shape[0], 3, self.num_heads, self.head_size)
        cos, sin = rotary
        q, k, v = qkv.unbind(1)
        qkv = torch.stack((apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v), dim=1)
        x = x + self.o_proj(step.attend(qkv, self.window).reshape(x.shape[0], -1))
        return x + self.down(self.act(self.gate_up(self.mlp_norm(x))))


class ModernBertModel(EncoderModel):
    """ModernBERT: embeddings (``task="embed"``) and, for ``ModernBertForSequenceClassification``, classifiers
    (``task="classify"``: the config's ``classifier_pooling`` of the final states through the checkpoint's
    ``head`` and ``classifier``, in the engine)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "attn.Wqkv.q": ("qkv", "q"), "attn.Wqkv.k": ("qkv", "k"), "attn.Wqkv.v": ("qkv", "v"),
        "attn.Wo": ("o_proj", None),
        "mlp.Wi.0": ("gate_up", 0), "mlp.Wi.1": ("gate_up", 1),
        "mlp.Wo": ("down", None),
    }

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cfg = ctx.hf_config
        hidden = int(cfg.hidden_size)
        eps, norm_bias = float(cfg.norm_eps), bool(getattr(cfg, "norm_bias", False))
        self.tok_embeddings = VocabEmbedding(int(cfg.vocab_size), hidden, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        self.embeddings_norm = LayerNorm(hidden, eps, bias=norm_bias)
        kinds = layer_kinds(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(ctx, i, kind) for i, kind in enumerate(kinds))
        self.final_norm = LayerNorm(hidden, eps, bias=norm_bias)
        head = hidden // int(cfg.num_attention_heads)
        positions = int(cfg.max_position_embeddings)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head, rope_parameters(cfg, kind), positions)
                                     for kind in sorted(set(kinds))})

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.removeprefix("model.")
        if name.startswith(_NOT_ENCODER):
            return None
        if name.startswith("embeddings."):
            part = name.removeprefix("embeddings.")
            return ("tok_embeddings.weight" if part == "tok_embeddings.weight" else "embeddings_" + part), None
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_split_fused(weights))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        dtype = self.embeddings_norm.weight.dtype
        step = EncoderStep(metadata, input_ids.device, input_ids.shape[0], dtype)
        x = self.embeddings_norm(self.tok_embeddings(input_ids))
        rotary = {kind: rope.cos_sin(positions, x.dtype) for kind, rope in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, step, rotary[layer.kind])
        return self.final_norm(x)


def _split_fused(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's fused ``Wqkv`` (query, key, value rows) and ``Wi`` (input, gate rows) as their parts, so that
    tensor parallelism takes each part's share."""
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        if stem.endswith("attn.Wqkv"):
            for part, piece in zip("qkv", tensor.chunk(3, 0), strict=True):
                yield f"{stem}.{part}.{leaf}", piece
        elif stem.endswith("mlp.Wi"):
            for part, piece in enumerate(tensor.chunk(2, 0)):
                yield f"{stem}.{part}.{leaf}", piece
        else:
            yield name, tensor
