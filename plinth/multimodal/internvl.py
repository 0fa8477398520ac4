"""InternVL images (``InternVLForConditionalGeneration``: InternVL3 / InternVL3.5 in transformers' layout): each image as
up to ``max_patches`` tiles and a thumbnail, through InternViT, a pixel shuffle and an MLP projector.

The image processor (transformers' ``GotOcr2ImageProcessor``) picks the grid of ``size``-pixel tiles whose aspect
ratio is nearest the image's (``min_patches`` to ``max_patches`` tiles), cuts the resized image into it and adds the
whole image as one more tile (none where the grid is one tile). InternViT: a class token and learned positions, blocks
of pre-norm attention (optionally with q/k RMSNorms over all heads) and MLP, each scaled by its learned layer scale,
a final LayerNorm where the config has one. The class token is dropped, each 2x2 patches become one position
(``downsample_ratio`` 0.5), then LayerNorm, ``linear_1``, GELU, ``linear_2``. The prompt's ``<IMG_CONTEXT>`` becomes
``<img>``, ``image_seq_length`` positions a tile, ``</img>`` (transformers' ``InternVLProcessor``); the language model
(Qwen2, Qwen3, Llama) attends causally.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.errors import UnsupportedModelError
from plinth.multimodal.qwen_vision import FloatRMSNorm
from plinth.multimodal.vision import activation, load_encoder_weights, pixel_shuffle

#: tiles the encoder takes in one pass
TILES_PER_PASS = 13


def is_internvl(mm_config: Any) -> bool:
    """Whether ``mm_config`` is InternVL's image-and-text config (transformers' layout)."""
    return getattr(mm_config, "model_type", None) == "internvl"


def square_size(value: Any) -> int:
    """A square size given as one number or a pair (InternVL's configs give pairs)."""
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"InternVL: non-square sizes {value} are not supported")
        return int(value[0])
    return int(value)


def positions_per_tile(mm_config: Any) -> int:
    v = mm_config.vision_config
    side = square_size(v.image_size) // square_size(v.patch_size)
    return int(side * side * float(mm_config.downsample_ratio) ** 2)


class _Block(nn.Module):
    def __init__(self, v: Any):
        super().__init__()
        h, eps = v.hidden_size, v.layer_norm_eps
        self.heads = v.num_attention_heads
        norm = (lambda: FloatRMSNorm(h, eps)) if v.norm_type == "rms_norm" else (lambda: nn.LayerNorm(h, eps=eps))
        self.norm1, self.norm2 = norm(), norm()
        bias = bool(v.attention_bias)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(h, h, bias=bias) for _ in range(3))
        self.out_proj = nn.Linear(h, h)
        self.q_norm = FloatRMSNorm(h) if v.use_qk_norm else None
        self.k_norm = FloatRMSNorm(h) if v.use_qk_norm else None
        self.fc1 = nn.Linear(h, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, h)
        self.act = activation(v.hidden_act)
        self.lambda_1 = nn.Parameter(torch.ones(h))
        self.lambda_2 = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [N, P, H]
        n, p, h = x.shape
        y = self.norm1(x)
        q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(n, p, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, h)
        x = x + self.lambda_1 * self.out_proj(attn)
        return x + self.lambda_2 * self.fc2(self.act(self.fc1(self.norm2(x))))


class InternVLImageEncoder(nn.Module):
    """Tiles ``[N, C, S, S]`` to ``[N, positions_per_tile, text hidden]`` embeddings."""

    tiles_per_pass = TILES_PER_PASS

    def __init__(self, mm_config: Any):
        super().__init__()
        v = mm_config.vision_config
        self.mm_config = mm_config
        strategy = getattr(mm_config, "vision_feature_select_strategy", "default")
        layer = getattr(mm_config, "vision_feature_layer", -1)
        ratio = float(mm_config.downsample_ratio)
        if strategy not in ("default", "full") or not isinstance(layer, int) or ratio != 0.5:
            raise UnsupportedModelError(f"InternVL: vision_feature_layer {layer!r}, strategy {strategy!r} and "
                                        f"downsample_ratio {ratio} (plinth takes one layer, 'default' or 'full', 0.5)")
        if strategy == "full":
            raise UnsupportedModelError("InternVL: the 'full' strategy keeps the class token, which the pixel shuffle "
                                        "cannot lay out")
        total = int(v.num_hidden_layers)
        self.layers_run = total if layer == -1 else (layer if layer >= 0 else total + 1 + layer)
        if not 0 < self.layers_run <= total:
            raise UnsupportedModelError(f"InternVL: vision_feature_layer {layer} is outside the tower's {total} layers")
        h = v.hidden_size
        self.patch = square_size(v.patch_size)
        self.side = square_size(v.image_size) // self.patch
        if self.side % 2:
            raise UnsupportedModelError(f"InternVL: {self.side} patches a side, which a 2x2 shuffle cannot halve")
        self.patch_embedding = nn.Conv2d(v.num_channels, h, self.patch, stride=self.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, h))
        self.position_embedding = nn.Parameter(torch.zeros(self.side * self.side + 1, h))
        self.layers = nn.ModuleList(_Block(v) for _ in range(self.layers_run))
        # the final norm applies to the last layer's output only (transformers' last_hidden_state)
        self.final_norm = nn.LayerNorm(h, eps=v.layer_norm_eps) if not v.use_mean_pooling and layer == -1 else None
        wide = h * 4
        self.norm = nn.LayerNorm(wide)
        self.linear_1 = nn.Linear(wide, mm_config.text_config.hidden_size)
        self.linear_2 = nn.Linear(mm_config.text_config.hidden_size, mm_config.text_config.hidden_size)
        self.act = activation(getattr(mm_config, "projector_hidden_act", "gelu"))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x], dim=1) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        x = pixel_shuffle(x[:, 1:], self.side, 2)   # (the class token dropped; 2x2 patches to one position)
        return self.linear_2(self.act(self.linear_1(self.norm(x))))

    def pack(self, features: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's ``[positions, hidden]`` embeddings: its tiles' in order (the thumbnail last)."""
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from the checkpoint's ``vision_tower.*`` and ``multi_modal_projector.*`` tensors
        (the layers past those run, and an unused final norm, skipped).

        Raises:
            ModelLoadError: see :func:`~plinth.multimodal.vision.load_encoder_weights`.
        """
        def target(name: str) -> str | None:
            out = _parameter_name(name)
            if out is None or out.startswith("layers.") and int(out.split(".")[1]) >= self.layers_run:
                return None
            if out.startswith("final_norm.") and self.final_norm is None:
                return None
            return out

        load_encoder_weights(self, ((name, t.reshape(-1, t.shape[-1]) if name.endswith(
            ("cls_token", "position_embeddings")) else t) for name, t in weights), target, partial, write)


_NAMES = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "position_embedding",
          "embeddings.patch_embeddings.projection.weight": "patch_embedding.weight",
          "embeddings.patch_embeddings.projection.bias": "patch_embedding.bias",
          "layernorm.weight": "final_norm.weight", "layernorm.bias": "final_norm.bias"}
_BLOCK = {"attention.q_proj": "q_proj", "attention.k_proj": "k_proj", "attention.v_proj": "v_proj",
          "attention.projection_layer": "out_proj", "attention.q_norm": "q_norm", "attention.k_norm": "k_norm",
          "layernorm_before": "norm1", "layernorm_after": "norm2", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


def _parameter_name(name: str) -> str | None:
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return "norm." + rest[len("layer_norm."):] if rest.startswith("layer_norm.") else rest
    for prefix in ("model.vision_tower.", "vision_tower."):
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest in _NAMES:
            return _NAMES[rest]
        if rest.startswith("encoder.layer."):
            index, _, part = rest[len("encoder.layer."):].partition(".")
            if part in ("lambda_1", "lambda_2"):
                return f"layers.{index}.{part}"
            module, _, leaf = part.rpartition(".")
            if module in _BLOCK:
                return f"layers.{index}.{_BLOCK[module]}.{leaf}"
        return f"(unknown) {rest}"
    return None


class PromptTokens:
    """The tokens of an InternVL image's prompt: ``<img>``, the image positions, ``</img>``.

    Raises:
        ValueError: the tokenizer lacks ``<img>`` or ``</img>``.
    """

    def __init__(self, mm_config: Any, tokenizer: Any):
        self.image = int(mm_config.image_token_id)
        self.per_tile = positions_per_tile(mm_config)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "</img>")]
        if not all(isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None) for i in ids):
            raise ValueError("the tokenizer has no <img> / </img> tokens")
        self.start, self.end = int(ids[0]), int(ids[1])

    def layout(self, tiles: int) -> list[int]:
        return [self.start, *[self.image] * (self.per_tile * tiles), self.end]

    def laid_out(self, ids: Sequence[int]) -> bool:
        """Whether a prompt carries an image's layout already (its ``<img>``)."""
        return self.start in ids
