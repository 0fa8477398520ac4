"""The image encoder of a Mistral 3 checkpoint (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2 and
the like): the Pixtral vision transformer over an image's patches at its own size, then Mistral 3's projector.

- **Pixtral**: a patch convolution (no bias), an RMSNorm, then blocks of RMSNorm -> attention (q/k/v/o without
  biases, a 2D rotary embedding: the first quarter of a head's angles from the patch's row with the even-indexed
  frequencies, the second from its column with the odd-indexed ones, rotate-half layout) and RMSNorm -> gated MLP
  (``gate_proj``, ``up_proj``, ``down_proj``). Each image attends to itself alone.
- **The projector**: an RMSNorm over the patch features, the patch merger (each ``spatial_merge_size`` x
  ``spatial_merge_size`` block of patches, concatenated feature-major as ``F.unfold`` lays it out, through
  ``merging_layer``), ``linear_1``, the activation, ``linear_2``.

An image's prompt is its merged grid in rows: ``[IMG]`` for each merged patch, ``[IMG_BREAK]`` after each row, the
last one ``[IMG_END]`` instead; the embeddings take the ``[IMG]`` positions (the break and end tokens keep their own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.errors import UnsupportedModelError
from plinth.multimodal.qwen_vision import FloatRMSNorm
from plinth.multimodal.vision import activation, load_encoder_weights

#: ``mm_config.model_type`` values this module runs
PIXTRAL_TYPES = ("mistral3",)
#: the checkpoint prefixes of the encoder's tensors (transformers 5's layout, then the older one)
PIXTRAL_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def is_pixtral(mm_config: Any) -> bool:
    """Whether ``mm_config`` is a Mistral 3 checkpoint's over a Pixtral vision tower."""
    return (getattr(mm_config, "model_type", None) in PIXTRAL_TYPES
            and getattr(getattr(mm_config, "vision_config", None), "model_type", None) == "pixtral")


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:   # [B, N, dim]
        b, n = x.shape[:2]
        q, k, v = (proj(x).view(b, n, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))                      # [B, heads, N, D]
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v)                                       # each image on its own
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[heads, N, D]`` by ``cos``/``sin`` ``[N, D]`` (in the model's dtype, as
    transformers' Pixtral rotates)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Layer(nn.Module):
    def __init__(self, vcfg: Any):
        super().__init__()
        dim = int(vcfg.hidden_size)
        self.attention_norm = FloatRMSNorm(dim, 1e-5)
        self.ffn_norm = FloatRMSNorm(dim, 1e-5)
        self.attention = _Attention(dim, int(vcfg.num_attention_heads))
        self.feed_forward = nn.Module()
        for name, (a, b) in (("gate_proj", (dim, vcfg.intermediate_size)), ("up_proj", (dim, vcfg.intermediate_size)),
                             ("down_proj", (vcfg.intermediate_size, dim))):
            self.feed_forward.add_module(name, nn.Linear(int(a), int(b), bias=False))
        self.act = activation(vcfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        ff, y = self.feed_forward, self.ffn_norm(x)
        return x + ff.down_proj(self.act(ff.gate_proj(y)) * ff.up_proj(y))


class PixtralEncoder(nn.Module):
    """One image's pixels to its embeddings (see the module's docstring).

    Args:
        mm_config: the checkpoint's ``Mistral3Config``.

    Raises:
        UnsupportedModelError: another tower, several feature layers, a head size the rotary embedding cannot split.
    """

    def __init__(self, mm_config: Any):
        super().__init__()
        if not is_pixtral(mm_config):
            raise UnsupportedModelError(f"{getattr(mm_config, 'model_type', None)!r} is not a Mistral 3 model over a "
                                        "Pixtral vision tower")
        vcfg = mm_config.vision_config
        layer = mm_config.vision_feature_layer
        if not isinstance(layer, int):
            raise UnsupportedModelError(f"Mistral 3 with several vision feature layers ({layer}) is not supported")
        depth = int(vcfg.num_hidden_layers)
        index = layer if layer >= 0 else depth + 1 + layer   # into [the embeddings, layer 1, ..., layer L]
        if not 0 <= index <= depth:
            raise UnsupportedModelError(f"vision_feature_layer {layer} is outside the vision tower's {depth} layers")
        dim, heads = int(vcfg.hidden_size), int(vcfg.num_attention_heads)
        head = int(getattr(vcfg, "head_dim", None) or dim // heads)
        if dim % heads or head % 4:
            raise UnsupportedModelError(f"vision width {dim} over {heads} heads: the 2D rotary embedding needs a "
                                        "head size that is a multiple of 4")
        self.patch_size = int(vcfg.patch_size)
        self.merge = int(mm_config.spatial_merge_size)
        self.mm_config = mm_config
        self.patch_conv = nn.Conv2d(int(vcfg.num_channels), dim, self.patch_size, stride=self.patch_size, bias=False)
        self.ln_pre = FloatRMSNorm(dim, 1e-5)
        self.layers = nn.ModuleList(_Layer(vcfg) for _ in range(index))
        rope = getattr(vcfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(vcfg, "rope_theta", 10000.0)))
        freqs = 1.0 / theta ** (torch.arange(0, head, 2, dtype=torch.float32) / head)
        #: the row angles' frequencies (even-indexed) and the column angles' (odd-indexed)
        self.row_freqs, self.col_freqs = freqs[0::2], freqs[1::2]
        text_hidden = int(mm_config.text_config.hidden_size)
        bias = bool(getattr(mm_config, "multimodal_projector_bias", False))
        self.norm = FloatRMSNorm(dim, float(mm_config.text_config.rms_norm_eps))
        self.merging_layer = nn.Linear(dim * self.merge * self.merge, dim, bias=False)
        self.linear_1 = nn.Linear(dim, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(getattr(mm_config, "projector_hidden_act", "gelu"))

    @property
    def device(self) -> torch.device:
        return self.patch_conv.weight.device

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images' ``[C, H, W]`` pixels, or ``[B, C, H, W]`` of images of one size (H and W whole merged patches) ->
        ``[(H / P / m) * (W / P / m), text hidden]`` embeddings, the merged patches in rows (``[B, ...]`` for a
        batch). The images of a batch attend each to itself."""
        weight = self.patch_conv.weight
        single = pixel_values.dim() == 3
        x = self.patch_conv(pixel_values.to(weight.device, weight.dtype)[None] if single
                            else pixel_values.to(weight.device, weight.dtype))             # [B, dim, h, w]
        b, dim, h, w = x.shape
        if h % self.merge or w % self.merge:
            raise ValueError(f"an image of {h}x{w} patches is not whole {self.merge}x{self.merge} merge blocks")
        x = self.ln_pre(x.flatten(2).transpose(1, 2))                                      # [B, h * w, dim]
        rows = torch.arange(h, device=x.device).repeat_interleave(w).float()
        cols = torch.arange(w, device=x.device).repeat(h).float()
        angles = torch.cat([rows[:, None] * self.row_freqs.to(x.device), cols[:, None] * self.col_freqs.to(x.device)],
                           dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        m = self.merge
        grid = F.unfold(x.transpose(1, 2).reshape(b, dim, h, w), kernel_size=m, stride=m).transpose(1, 2)
        out = self.linear_2(self.act(self.linear_1(self.merging_layer(grid))))            # [B, (h/m)(w/m), text]
        return out[0] if single else out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from a checkpoint's ``vision_tower.*`` and ``multi_modal_projector.*`` tensors (either
        layout; the vision layers past the one read are skipped). ``partial``: any subset; ``write=False``: check.

        Raises:
            ModelLoadError: a missing tensor (unless ``partial``), an unknown one, of another shape, or not float.
        """
        def target_of(name: str) -> str | None:
            for prefix in ("model.vision_tower.", "vision_tower."):
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    if rest.startswith("transformer.layers."):
                        index = int(rest.split(".")[2])
                        if index >= len(self.layers):
                            return None   # a layer past the one read
                        return "layers." + rest[len("transformer.layers."):]
                    return None if rest.endswith("inv_freq") else rest
            for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
                if name.startswith(prefix):
                    return name[len(prefix):].removeprefix("patch_merger.")
            return None

        load_encoder_weights(self, weights, target_of, partial, write)


def layout(rows: int, cols: int, image: int, brk: int, end: int) -> list[int]:
    """An image's prompt tokens: ``cols`` image tokens and a break token for each of its ``rows`` merged rows, the
    last break an end token."""
    out = ([image] * cols + [brk]) * rows
    out[-1] = end
    return out


def grid_of(mm_config: Any, processor: Any, size: tuple[int, int]) -> tuple[int, int]:
    """The merged rows and columns of an image of ``size`` (height, width) once the processor resizes it."""
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    unit = int(mm_config.vision_config.patch_size) * int(mm_config.spatial_merge_size)
    longest = int(processor.size["longest_edge"])
    import numpy as np
    from transformers.image_utils import ChannelDimension

    h, w = get_resize_output_image_size(np.zeros((*size, 3), dtype=np.uint8), size=(longest, longest),
                                        patch_size=(unit, unit), input_data_format=ChannelDimension.LAST)
    return math.ceil(h / unit), math.ceil(w / unit)
