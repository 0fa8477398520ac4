"""The decoder-only transformer shared by the Llama family (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE, Phi-3,
SmolLM3, Granite, OLMo 2/3, gpt-oss) and the Gemma family (Gemma, Gemma 2, Gemma 3).

One implementation with options: architectures subclass :class:`DecoderForCausalLM` and
override :meth:`~DecoderForCausalLM.attention_options` (biases, per-head q/k norm, softmax scale;
:meth:`~DecoderForCausalLM.layer_attention_options` where layers differ, e.g. in RoPE),
:meth:`~DecoderForCausalLM.block_options` (norm flavour, activation, norms around each block's output,
embedding and residual multipliers) and :meth:`~DecoderForCausalLM.make_mlp` (dense or mixture-of-experts). Parameter names
follow the Hugging Face checkpoints, except the fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.distributed.communication import tp_all_reduce_add_rms_norm
from plinth.distributed.parallel_state import pp_layer_range
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.layers.activation import GATED_ACTIVATIONS, SiluAndMul
from plinth.model_registry.layers.attention import Attention
from plinth.model_registry.layers.embedding import LMHead, VocabEmbedding
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from plinth.model_registry.layers.rotary import RotaryEmbedding, deinterleave_pairs, rope_parameters

_LAYER_RE = re.compile(r"^model\.layers\.(?P<idx>\d+)\.")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How one architecture's attention block differs from Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False       # RMSNorm over each head's features of q and k (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # RMSNorm over each token's whole q and k projections, all heads at once (OLMo 2)
    scale: float | None = None  # the softmax scale (default: head_dim ** -0.5)
    soft_cap: float | None = None  # attention-logit soft-capping, cap * tanh(score / cap) (Gemma 2)
    rope: bool = True           # False: the layer's q and k get no rotary embedding (SmolLM3's NoPE layers)
    sinks: bool = False         # each head's learned sink logit in its softmax's denominator (``self_attn.sinks``, gpt-oss)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after the q/k norms (OLMoE, OLMo)
    rope_interleaved: bool = False  # RoPE rotates adjacent pairs of features (GPT-J style; ERNIE 4.5)
    attention_chunk: int | None = None  # chunked local attention: positions p // chunk * chunk .. p (Llama 4)


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """How one architecture's decoder blocks differ from Llama's."""

    norm: type[RMSNorm] = RMSNorm   # GemmaRMSNorm: the checkpoint's weights are ``w`` of ``(1 + w)``
    activation: str = "silu"        # the gated MLP's activation (a GATED_ACTIVATIONS name)
    sandwich_norms: bool = False    # Gemma 2/3: a norm on each block's output before the residual add
    post_norms: bool = False        # OLMo 2: a norm on each block's output and none on its input
    embed_scale: bool = False       # the embeddings multiplied by sqrt(hidden_size) (Gemma)
    local_rope: bool = False        # sliding-window layers take the config's local RoPE (Gemma 3)
    embedding_multiplier: float = 1.0   # the embeddings multiplied by this (Granite; Gemma's is embed_scale)
    residual_multiplier: float = 1.0    # each block's output multiplied by this before the residual add (Granite)
    norm_eps: float | None = None   # the norms' epsilon when the config has no ``rms_norm_eps`` (LayerNorm models)


def gated_activation(name: str) -> torch.nn.Module:
    """The gated activation module of a ``config.json`` activation name."""
    make = GATED_ACTIVATIONS.get(name)
    if make is None:
        raise UnsupportedModelError(f"activation {name!r} is not supported by plinth's native decoder; supported: "
                                    f"{', '.join(sorted(GATED_ACTIVATIONS))}")
    return make()


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def config_sliding_window(cfg: Any) -> int | None:
    """The config's sliding window (``None``: none). A ``sliding_window`` key in the config of an architecture
    without one (Llama, Granite, ...: its config class has no such field) is ignored, as transformers ignores it.

    Raises:
        ModelLoadError: a window that is not a positive integer.
    """
    window = getattr(cfg, "sliding_window", None)
    if window is None or (isinstance(window, int) and window == 0) or not _has_sliding_window(
            getattr(cfg, "model_type", None) or type(cfg).__name__):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window


def sliding_window_of(cfg: Any, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` (``None`` for full attention; see :func:`config_sliding_window`)."""
    window = config_sliding_window(cfg)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


@functools.cache
def _has_sliding_window(model_type: str) -> bool:
    """Whether the architecture ``model_type`` has a sliding window (the default config of its transformers config
    class has the field; a model type transformers does not know, or whose config cannot be built with its
    defaults, is taken at its config's word)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return True
    try:
        return hasattr(CONFIG_MAPPING[model_type](), "sliding_window")
    except Exception:   # noqa: BLE001 - a config class with required arguments
        return True


class DecoderAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, rotary embedding, paged attention, output projection."""

    #: ``q_proj``'s rows per head, in units of ``head_dim`` (2: each head's query and an output gate side by side)
    query_parts: ClassVar[int] = 1

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        cfg = ctx.hf_config
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, self.query_parts * num_heads, num_kv_heads,
                                          bias=options.qkv_bias, **tp)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg.hidden_size, bias=options.o_bias, **tp)
        self.num_heads = self.qkv_proj.num_heads // self.query_parts   # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads    # on this rank
        self.qk_norm_full = options.qk_norm_full
        if options.clip_qkv is not None and options.qk_norm and not options.qk_norm_full:
            raise UnsupportedModelError("clip_qkv with per-head q/k norms (the clamp comes after the norms)")
        self.clip_qkv = options.clip_qkv
        if options.qk_norm_full:
            if ctx.tp_size > 1:
                raise UnsupportedModelError("q/k norms over all heads of a token (OLMo 2) need every head on one "
                                            "rank: tensor parallelism is not supported for this model")
            self.q_norm = norm(num_heads * self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = norm(num_kv_heads * self.head_dim, eps=cfg.rms_norm_eps)
        elif options.qk_norm:
            self.q_norm = norm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = norm(self.head_dim, eps=cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        scale = options.scale if options.scale is not None else self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads,
                              ctx.attention_backend, sliding_window_of(cfg, layer_idx), layer_idx,
                              soft_cap=options.soft_cap, has_sinks=options.sinks,
                              attention_chunk=options.attention_chunk)
        self.use_rope = options.rope
        self.rope_interleaved = options.rope_interleaved
        self.sinks = None
        if options.sinks:   # float32, as the kernels read them; this rank's heads
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size

    def input_quant(self) -> Any:
        """How the fused q/k/v projection wants its input rows quantized (see
        :meth:`~plinth.model_registry.layers.linear.LinearBase.input_quant`)."""
        return self.qkv_proj.input_quant()

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.num_heads
        if tuple(loaded.shape) != (n * self.tp_size,):
            raise ModelLoadError(f"shape mismatch: expected ({n * self.tp_size},) (one sink per head), checkpoint "
                                 f"has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, hidden: Any, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, reduce: bool = True) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)       # ``hidden`` may be QuantizedRows (DecoderLayer.input_quant)
        t = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)          # [T, Hq*D], [T, Hkv*D]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)       # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)    # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_interleaved and self.use_rope:   # the rotated pairs to the rotate-half layout
            q, k = deinterleave_pairs(q, cos.shape[-1]), deinterleave_pairs(k, cos.shape[-1])
        # RoPE in the attention backend or before it
        out = self.attn(q, k, v, metadata, rotary=(cos, sin) if self.use_rope else None, sinks=self.sinks)
        return self.o_proj(out.reshape(t, q_size), reduce=reduce)


class DenseMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused (``act`` SiLU unless ``activation`` says otherwise)."""

    def __init__(self, ctx: ModelContext, intermediate_size: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        hidden = ctx.hf_config.hidden_size
        tp = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size, "quant_method": ctx.quant_method}
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate_size] * 2, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden, bias=bias, **tp)
        self.act_fn = gated_activation(activation)
        # a quantized kernel may pack gate and up rows side by side and apply the activation itself
        self.gate_up_proj.feeds_silu_and_mul = isinstance(self.act_fn, SiluAndMul)
        self._down_quant: tuple[Any] | None = None   # (down_proj.input_quant(),), read at the first forward

    def input_quant(self) -> Any:
        """The gate/up projection's :meth:`~plinth.model_registry.layers.linear.LinearBase.input_quant`."""
        return self.gate_up_proj.input_quant()

    def forward(self, x: Any, reduce: bool = True) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.gate_up_proj.forward_silu_and_mul(x) if self.gate_up_proj.feeds_silu_and_mul else None
        if h is None:
            if self._down_quant is None:
                self._down_quant = (self.down_proj.input_quant(),)
            h = self.act_fn(self.gate_up_proj(x), self._down_quant[0])
        return self.down_proj(h, reduce=reduce)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks around one running residual stream.

    Under tensor parallelism the all-reduce after each row-parallel projection is left to the RMSNorm
    that follows it (:func:`~plinth.distributed.communication.tp_all_reduce_add_rms_norm`: one kernel where
    the custom all-reduce takes it): after ``o_proj`` always, after the MLP's ``down_proj`` when
    :attr:`defer_output` is set, in which case the layer returns its MLP output as this rank's partial sums
    and the next layer (:attr:`reduce_input`) or the final norm reduces them. :class:`DecoderModel` sets both.
    """

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm, residual_multiplier: float = 1.0,
                 attention: type[nn.Module] = DecoderAttention, eps: float | None = None):
        super().__init__()
        eps = eps if eps is not None else ctx.hf_config.rms_norm_eps
        #: the attention and MLP outputs are multiplied by this before they join the residual stream (Granite)
        self.residual_multiplier = residual_multiplier
        self.input_layernorm = norm(ctx.hf_config.hidden_size, eps=eps)
        self.self_attn = attention(ctx, layer_idx, options, norm)
        self.post_attention_layernorm = norm(ctx.hf_config.hidden_size, eps=eps)
        self.mlp = mlp
        #: the attention output's all-reduce happens in the norm after it
        self.fuse_attention_reduce = ctx.tp_size > 1 and self.self_attn.o_proj.bias is None
        #: the layer may return the MLP's partial sums (a dense MLP without a down-projection bias)
        self.can_defer_output = (ctx.tp_size > 1 and isinstance(mlp, DenseMLP) and mlp.down_proj.bias is None)
        self.defer_output = False   # return the MLP's partial sums (set by DecoderModel)
        self.reduce_input = False   # the hidden state arrives as the previous layer's partial sums
        self._input_quant: tuple[Any, Any] | None = None   # input_quant(), read at the first forward

    def input_quant(self) -> tuple[Any, Any]:
        """How the attention block's and the MLP's first GEMMs want their inputs quantized per row (see
        :meth:`~plinth.model_registry.layers.linear.LinearBase.input_quant`): the norms before them then
        write the quantized rows. Fixed once the quantization kernel is selected (before loading)."""
        mlp = self.mlp.input_quant() if isinstance(self.mlp, DenseMLP) else None
        return self.self_attn.input_quant(), mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self._input_quant is None:
            self._input_quant = self.input_quant()
        attn_quant, mlp_quant = self._input_quant
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant=attn_quant)
        elif self.reduce_input:
            hidden, residual = tp_all_reduce_add_rms_norm(hidden, residual, self.input_layernorm)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant=attn_quant)
        scaled = self.residual_multiplier != 1.0
        if self.fuse_attention_reduce:
            hidden = self.self_attn(hidden, cos, sin, metadata, reduce=False)
            if scaled:   # this rank's partial sums: the scaled sum is the sum of the scaled parts
                hidden = hidden * self.residual_multiplier
            hidden, residual = tp_all_reduce_add_rms_norm(hidden, residual, self.post_attention_layernorm)
        else:
            hidden = self.self_attn(hidden, cos, sin, metadata)
            if scaled:
                hidden = hidden * self.residual_multiplier
            hidden, residual = self.post_attention_layernorm(hidden, residual, quant=mlp_quant)
        hidden = self.mlp(hidden, reduce=False) if self.defer_output else self.mlp(hidden)
        return (hidden * self.residual_multiplier if scaled else hidden), residual


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's block: no norm on the attention's or the MLP's input, a norm on each output before it joins the
    residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``). The same ``(hidden,
    residual)`` protocol as :class:`DecoderLayer`: the stream is their sum, which the next layer or the final norm
    forms; the all-reduces of tensor parallelism would happen in the projections, since a norm stands between each
    projection and its residual add."""

    can_defer_output = False
    reduce_input = False

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = DecoderAttention(ctx, layer_idx, options, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, metadata))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class SandwichDecoderLayer(PostNormDecoderLayer):
    """Gemma 2/3's block: OLMo 2's norms on the attention and MLP outputs, and norms on their inputs too
    (``input_layernorm``, ``pre_feedforward_layernorm``, which add the residual stream as :class:`DecoderLayer`'s
    do)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, options: AttentionOptions, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__(ctx, layer_idx, options, mlp, norm)
        cfg = ctx.hf_config
        self.input_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class MissingLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage runs (keeps layer indices aligned)."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


def _rotary(ctx: ModelContext, layer_type: str, partial: bool) -> RotaryEmbedding:
    """The RoPE of the config's layers of ``layer_type`` (over ``partial_rotary_factor`` of each head where the
    architecture reads it, ``partial``; over the whole head otherwise, as transformers does for them)."""
    cfg = ctx.hf_config
    params = rope_parameters(cfg, layer_type)
    original = getattr(cfg, "original_max_position_embeddings", None)   # Phi-3 keeps it beside rope_scaling
    if original and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = original
    factor = (params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)) or 1.0) if partial else 1.0
    head_dim = head_dim_of(cfg)
    return RotaryEmbedding(head_dim, params, getattr(cfg, "max_position_embeddings", 2048), int(head_dim * factor),
                           context=ctx.max_model_len)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (the checkpoint's ``model.`` prefix).

    Under pipeline parallelism (``ctx.pp_size > 1``) only this stage's layers are built
    (:func:`~plinth.distributed.parallel_state.pp_layer_range`); the embedding lives on the
    first stage and the final norm on the last.
    """

    def __init__(self, ctx: ModelContext, owner: DecoderForCausalLM):
        super().__init__()
        cfg = ctx.hf_config
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers, ctx.pp_rank, ctx.pp_size)
        self.is_first_stage = ctx.pp_rank == 0
        self.is_last_stage = ctx.pp_rank == ctx.pp_size - 1
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
                             if self.is_first_stage else None)
        block = owner.block_options(cfg)
        if owner.layer_class is not None:
            make_layer: Any = owner.layer_class
        elif block.sandwich_norms or block.post_norms:
            if block.residual_multiplier != 1.0:
                raise UnsupportedModelError(f"{type(owner).__name__}: a residual multiplier with norms on the block "
                                            "outputs")
            make_layer = SandwichDecoderLayer if block.sandwich_norms else PostNormDecoderLayer
        else:
            make_layer = functools.partial(DecoderLayer, residual_multiplier=block.residual_multiplier,
                                           attention=owner.attention_class, eps=block.norm_eps)
        self.layers = nn.ModuleList(
            make_layer(ctx, i, owner.layer_attention_options(cfg, i), owner.make_mlp(ctx, i), block.norm)
            if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        eps = block.norm_eps if block.norm_eps is not None else cfg.rms_norm_eps
        self.norm = block.norm(cfg.hidden_size, eps=eps) if self.is_last_stage else None
        # each layer's MLP output is reduced by whatever norms it next (see DecoderLayer); the last layer of a
        # stage without the final norm hands reduced states to the next stage
        built = [layer for layer in self.layers if not isinstance(layer, MissingLayer)]
        for i, layer in enumerate(built):
            layer.defer_output = layer.can_defer_output and (i + 1 < len(built) or self.norm is not None)
            if i + 1 < len(built):
                built[i + 1].reduce_input = layer.defer_output
        self.reduce_final = bool(built) and built[-1].defer_output
        #: the embeddings' multiplier (Gemma: sqrt(hidden_size) rounded to the model's dtype; Granite's own)
        self.embed_scale = float(block.embedding_multiplier)
        #: what image embeddings are multiplied by: Granite's multiplier applies to the merged embeddings (as
        #: transformers multiplies ``inputs_embeds``), Gemma's scale to the token embeddings only
        self.image_embed_scale = float(block.embedding_multiplier)
        if block.embed_scale:
            self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=ctx.dtype, device="cpu"))
            self.image_embed_scale = 1.0
        #: Qwen3-VL's DeepStack: how many of the first layers add an image position's extra embeddings (which come
        #: after its main one in the image embeddings' rows) to its hidden states
        self.deepstack = int(getattr(cfg, "deepstack_layers", 0) or 0)
        if self.deepstack and ctx.pp_size > 1 and pp_layer_range(cfg.num_hidden_layers, 0, ctx.pp_size)[1] < min(
                self.deepstack, cfg.num_hidden_layers):
            raise UnsupportedModelError(f"the first {self.deepstack} layers take the images' DeepStack embeddings, "
                                        "which the first pipeline stage makes: it must hold them (use fewer "
                                        "pipeline stages)")
        self.rotary_emb = _rotary(ctx, "full_attention", owner.partial_rotary)
        #: the sliding-window layers' own RoPE (Gemma 3's local base frequency), else ``None``
        self.local_rotary_emb = _rotary(ctx, "sliding_attention", owner.partial_rotary) if block.local_rope else None
        self._local_layers = frozenset(i for i in range(cfg.num_hidden_layers) if sliding_window_of(cfg, i))

    def run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                  hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  image_embeds: tuple[torch.Tensor, ...] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's share of the forward pass.

        The first stage embeds ``input_ids``; later stages continue from the previous stage's
        ``hidden`` and ``residual`` (``[T, H]`` each). Returns ``(hidden, residual)``; on the last
        stage ``hidden`` is the normed final state and ``residual`` is ``None``. ``image_embeds``:
        ``(rows [K], embeddings [K, H])`` that replace those rows' token embeddings (image inputs), and for a
        multimodal RoPE (Qwen2-VL) a third item, the rows' ``[K, 3]`` positions.
        """
        deep = None   # Qwen3-VL: the image rows' DeepStack embeddings [K, layers, H]
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)                  # [T, H]
            if self.embed_scale != 1.0:
                hidden = hidden * self.embed_scale
            if image_embeds is not None:
                rows, values = image_embeds[:2]
                if self.deepstack:
                    width = hidden.shape[-1]
                    values, deep = values[:, :width], values[:, width:].unflatten(-1, (-1, width)).to(hidden.dtype)
                if self.image_embed_scale != 1.0:
                    values = values * self.image_embed_scale
                hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        assert hidden is not None, "a later pipeline stage needs the previous stage's hidden states"
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)  # [T, R] each
        if image_embeds is not None and len(image_embeds) > 2 and image_embeds[2] is not None:
            # multimodal RoPE: image rows rotate by their (time, height, width) positions
            rows, image_cos, image_sin = image_embeds[0], *self.rotary_emb.cos_sin_3d(image_embeds[2], hidden.dtype)
            cos, sin = cos.index_copy(0, rows, image_cos), sin.index_copy(0, rows, image_sin)
        local = self.local_rotary_emb
        local_cos, local_sin = local.cos_sin(positions, hidden.dtype) if local is not None else (cos, sin)
        for i in range(self.start_layer, self.end_layer):
            if i in self._local_layers:
                hidden, residual = self.layers[i](hidden, residual, local_cos, local_sin, metadata)
            else:
                hidden, residual = self.layers[i](hidden, residual, cos, sin, metadata)
            if deep is not None and i < deep.shape[1]:   # (to the residual stream: whole on every rank)
                assert residual is not None and image_embeds is not None
                residual = residual.index_add(0, image_embeds[0], deep[:, i])
        if self.norm is None:
            return hidden, residual
        if self.reduce_final:
            assert residual is not None
            hidden, _ = tp_all_reduce_add_rms_norm(hidden, residual, self.norm)
        else:
            hidden, _ = self.norm(hidden, residual)
        return hidden, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        hidden, _ = self.run_stage(input_ids, positions, metadata, image_embeds=image_embeds)
        return hidden


class DecoderForCausalLM(CausalLM):
    """A Llama-style causal LM; subclasses choose the attention options and the MLP."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    #: the attention block of :class:`DecoderLayer` (built as ``attention_class(ctx, layer_idx, options, norm)``)
    attention_class: ClassVar[type[nn.Module]] = DecoderAttention
    #: a decoder layer of another shape than the pre-norm, sandwich and post-norm ones (built as
    #: ``layer_class(ctx, layer_idx, options, mlp, norm)``, speaking :class:`DecoderLayer`'s ``(hidden, residual)``
    #: protocol; Cohere's parallel block)
    layer_class: ClassVar[type[nn.Module] | None] = None
    #: stages can be built and run one at a time (see :meth:`forward_stage`)
    supports_pipeline_parallel: ClassVar[bool] = True
    #: the linear layers that take LoRA adapters (:mod:`plinth.lora`); a mixture-of-experts MLP has none of the last two
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    #: the checkpoint modules adapters may name, ``{projection: (block, input kind, output kind)}``
    #: (:func:`plinth.lora.adapter.adapter_targets`); ``None``: those of ``lora_modules`` under Llama's names
    lora_adapter_targets: ClassVar[dict[str, tuple[str, str, str]] | None] = None
    #: RoPE turns only ``partial_rotary_factor`` of each head (Phi, Phi-3, StableLM, GLM-4 MoE); the other
    #: architectures turn the whole head whatever the config says, as their transformers code does
    partial_rotary: ClassVar[bool] = False
    #: the config's bias switches the architecture's transformers code reads (``attention_bias`` for the default
    #: attention, ``mlp_bias`` for the default MLP): the others have no biases there whatever the config says
    config_biases: ClassVar[tuple[str, ...]] = ("attention_bias",)

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        #: an image's positions attend to each other (Gemma 3; set by the loader on the language model's config):
        #: the runner marks them in the step's metadata (:attr:`AttentionMetadata.image_spans`)
        self.bidirectional_images = bool(getattr(cfg, "bidirectional_image_attention", False))
        self.model = DecoderModel(ctx, self)
        # a last stage without the embedding reads the tied matrix into its own LM head
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
                              tp_rank=ctx.tp_rank, tp_size=ctx.tp_size) if self.model.is_last_stage else None

    def attention_options(self, cfg: Any) -> AttentionOptions:
        """Biases and norms of the attention block (default: Llama's ``attention_bias``)."""
        bias = "attention_bias" in self.config_biases and bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def layer_attention_options(self, cfg: Any, layer_idx: int) -> AttentionOptions:
        """The attention options of layer ``layer_idx`` (default: :meth:`attention_options`, the same for every
        layer)."""
        return self.attention_options(cfg)

    def block_options(self, cfg: Any) -> BlockOptions:
        """Norms, activation and embedding scale (default: Llama's, with the config's ``hidden_act``)."""
        return BlockOptions(activation=getattr(cfg, "hidden_act", None) or "silu")

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (default: a dense gated MLP)."""
        cfg = ctx.hf_config
        bias = "mlp_bias" in self.config_biases and bool(getattr(cfg, "mlp_bias", False))
        return DenseMLP(ctx, cfg.intermediate_size, bias=bias,
                        activation=self.block_options(cfg).activation)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None  # some tied checkpoints store the shared matrix twice
        if self.tie_word_embeddings and self.model.embed_tokens is None and name == "model.embed_tokens.weight":
            return "lm_head.weight", None   # a last pipeline stage holds the tied matrix as its LM head
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint tensors of this pipeline stage (all of them without pipeline parallelism)."""
        if self.ctx.pp_size > 1:
            weights = ((name, t) for name, t in weights if self._on_this_stage(name))
        super().load_weights(weights)

    def _on_this_stage(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        if m is not None:   # (a layer no stage holds goes on, to be refused as every stage's unknown tensor)
            idx = int(m["idx"])
            return self.model.start_layer <= idx < self.model.end_layer or idx >= self.ctx.hf_config.num_hidden_layers
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or (self.lm_head is not None and self.tie_word_embeddings)
        if name.startswith(("model.norm.", "model.final_layernorm.")):   # (the final norm's two names)
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    #: the forward pass takes ``image_embeds`` (image inputs: see :meth:`DecoderModel.run_stage`)
    accepts_image_embeds: ClassVar[bool] = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                image_embeds: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, metadata, image_embeds)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      image_embeds: tuple[torch.Tensor | None, ...] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pipeline stage: see :meth:`DecoderModel.run_stage` (``image_embeds``: the first stage's rows and
        embeddings; a later stage's rows and, for a multimodal RoPE, their positions, the embeddings ``None``)."""
        return self.model.run_stage(input_ids, positions, metadata, hidden, residual, image_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden).float()
