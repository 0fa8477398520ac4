"""The attention layer: holds its shapes and its KV cache, delegates the math to the backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plinth.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    applies_sinks,
    applies_soft_cap,
    attend_kwargs,
    attend_within_images,
    chunked_attention_view,
)
from plinth.errors import UnsupportedModelError
from plinth.kernels import ops
from plinth.model_registry.layers.rotary import rotate_qk

#: the largest soft cap taken (the Triton kernels hold cap * log2(e) in float32; a larger cap caps nothing anyway)
MAX_SOFT_CAP = 1e30


def usable_soft_cap(cap: object) -> bool:
    """Whether ``cap`` is a soft cap the attention and the logits can apply: a number in (0, MAX_SOFT_CAP]."""
    return (not isinstance(cap, bool) and isinstance(cap, (int, float)) and 0 < cap <= MAX_SOFT_CAP)


class Attention(nn.Module):
    """Paged attention for one layer.

    The model runner assigns ``kv_cache`` (a tensor of shape
    ``backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)``) before the
    first forward pass.

    Args:
        num_heads: query heads on this rank.
        head_size: features per head.
        scale: the softmax scale (usually ``head_size ** -0.5``).
        num_kv_heads: key/value heads on this rank.
        backend: the attention backend instance shared by every layer.
        sliding_window: attend only to the last ``sliding_window`` positions, or ``None``.
        layer_idx: the layer's index (for messages and backends that need it).
        soft_cap: attention-logit soft-capping, ``soft_cap * tanh(score / soft_cap)`` (Gemma 2), or ``None``.
        has_sinks: :meth:`forward` receives each head's sink logit (gpt-oss): the backend must take ``sinks``.
        attention_chunk: chunked local attention (Llama 4): a query at position ``p`` attends to positions
            ``p // attention_chunk * attention_chunk .. p`` only (:func:`chunked_attention_view`), or ``None``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 backend: AttentionBackend, sliding_window: int | None = None, layer_idx: int = 0,
                 soft_cap: float | None = None, has_sinks: bool = False, values_are_keys: bool = False,
                 attention_chunk: int | None = None):
        super().__init__()
        if attention_chunk is not None and (isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int)
                                            or attention_chunk < 1):
            raise UnsupportedModelError(f"attention layer {layer_idx}: attention_chunk_size must be a positive "
                                        f"integer, got {attention_chunk!r}")
        if has_sinks and not applies_sinks(backend):
            raise UnsupportedModelError(f"attention layer {layer_idx}: attention sinks need a backend that applies "
                                        f"them ({type(backend).__name__} does not)")
        if soft_cap is not None and not (usable_soft_cap(soft_cap) and applies_soft_cap(backend)):
            applies = "" if applies_soft_cap(backend) else " not"
            raise UnsupportedModelError(f"attention layer {layer_idx}: soft cap {soft_cap!r} needs a cap in "
                                        f"(0, {MAX_SOFT_CAP:g}] and a backend that applies it "
                                        f"({type(backend).__name__} does{applies})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.has_sinks = has_sinks
        #: :meth:`forward` always gets ``v`` = ``k``: a backend that ``shares_kv_cache`` stores them once
        self.values_are_keys = values_are_keys
        self.layer_idx = layer_idx
        self.backend = backend
        self.attention_chunk = attention_chunk
        self.kv_cache: torch.Tensor | None = None
        #: tokens per KV block (set with ``kv_cache`` by the model runner; read by chunked attention)
        self.block_size: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``.

        ``rotary``: ``(cos, sin)`` ``[T, R]`` of a rotate-half RoPE still to be applied to ``q`` and ``k``
        (over their first ``R`` features): by the backend where it takes it, else here (in place where the
        fused ops run). ``sinks``: ``[Hq]``, each head's sink logit, given exactly when the layer ``has_sinks``.
        """
        if self.kv_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache; the model runner assigns it")
        if (sinks is not None) != self.has_sinks:
            raise ValueError(f"attention layer {self.layer_idx}: sinks {'given' if sinks is not None else 'missing'}"
                             f" (the layer was built with has_sinks={self.has_sinks})")
        options = self._options(sinks)
        if self.attention_chunk is not None and not 0 < metadata.max_seq_len <= self.attention_chunk:
            # (default cache layout [2, blocks, block_size, ...] where no runner said the block size)
            block_size = self.block_size or self.kv_cache.shape[2]
            metadata = chunked_attention_view(metadata, self.attention_chunk, block_size, self.backend)
        if rotary is not None:
            cos, sin = rotary
            if (self.backend.fuses_rotary and cos.shape[-1] == self.head_size and ops.fused_ops_enabled(q)
                    and not metadata.image_spans):
                return self.backend.forward(q, k, v, self.kv_cache, metadata, rotary=rotary, **options)
            q, k = rotate_qk(q, k, cos, sin)
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, **options)
        if metadata.image_spans:   # (Gemma 3: image positions see their whole image)
            out = attend_within_images(out, q, self.kv_cache, metadata, **options)
        return out

    def _options(self, sinks: torch.Tensor | None = None) -> dict[str, Any]:
        """The backend's per-layer keywords."""
        options = {"scale": self.scale, **attend_kwargs(self.sliding_window, self.soft_cap)}
        if sinks is not None:
            options["sinks"] = sinks.float() if sinks.dtype != torch.float32 else sinks
        return options

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}" + (f", soft_cap={self.soft_cap}" if self.soft_cap else "")
                + (", sinks" if self.has_sinks else "")
                + (f", attention_chunk={self.attention_chunk}" if self.attention_chunk else ""))
