"""Llama 4 images (``Llama4ForConditionalGeneration``: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E): each image
as up to ``max_patches`` tiles of the vision tower's size and a global view, through Llama 4's vision model.

The image processor (:class:`ImageProcessor`, what transformers' ``Llama4ImageProcessor`` does, without torchvision)
picks the canvas of whole tiles (at most ``max_patches``) the image fits best, resizes the image into it without
distortion (never enlarging it past one tile's side unless ``resize_to_max_canvas``), pads it on the right and bottom,
and cuts the tiles row by row; an image of more than one tile adds itself resized to one tile, last. Pixels are scaled
and normalised in bfloat16, as the checkpoints were trained.

The vision model: patches unfolded and projected, a class token appended (last), learned positions, a LayerNorm,
encoder layers of pre-norm attention with a 2D rotary embedding (columns in the first half of each head's pairs, rows
in the second; none for the class token) and a GELU MLP, a final LayerNorm. The class token is dropped, each 2x2
patches become one position (the pixel shuffle), then two bias-free GELU projections and the projector into the
language model's width. The prompt's ``<|image|>`` becomes ``<|image_start|>``, each tile's patch tokens (a
``<|tile_x_separator|>`` between tiles of a row, a ``<|tile_y_separator|>`` after each row), ``<|image|>``, the global
view's patch tokens and ``<|image_end|>`` (transformers' ``Llama4Processor``); only the patch tokens take embeddings.
The language model attends causally, as for text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.multimodal.images import MAX_TILES_SETTING
from plinth.multimodal.vision import load_encoder_weights, pixel_shuffle

#: tiles the encoder takes in one pass (an image of the default 16 tiles and its global view)
TILES_PER_PASS = 17


def is_llama4(mm_config: Any) -> bool:
    """Whether ``mm_config`` is Llama 4's image-and-text config."""
    return getattr(mm_config, "model_type", None) == "llama4"


def _shuffle_factor(v: Any) -> int:
    ratio = float(v.pixel_shuffle_ratio)
    factor = round(1 / ratio) if ratio > 0 else 0
    if factor < 1 or abs(factor * ratio - 1) > 1e-9:
        raise UnsupportedModelError(f"Llama 4: pixel_shuffle_ratio {ratio} (plinth takes 1 / n)")
    return factor


def tile_count(rows: int, cols: int) -> int:
    """The tiles of an image cut into ``rows x cols``: those, and the global view where there are more than one."""
    return rows * cols + (1 if rows * cols > 1 else 0)


def positions_per_tile(mm_config: Any) -> int:
    """The positions one tile's embeddings fill."""
    v = mm_config.vision_config
    side = int(v.image_size) // int(v.patch_size)
    return side * side // _shuffle_factor(v) ** 2


class _Block(nn.Module):
    def __init__(self, v: Any):
        super().__init__()
        h = int(v.hidden_size)
        self.heads = int(v.num_attention_heads)
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1 = nn.Linear(h, int(v.intermediate_size))
        self.fc2 = nn.Linear(int(v.intermediate_size), h)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:   # [N, P, H]
        n, p, h = x.shape
        y = self.input_layernorm(x)
        q, k, v = (proj(y).view(n, p, self.heads, h // self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, turns), _rotate(k, turns)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.o_proj(attn.transpose(1, 2).reshape(n, p, h))
        return x + self.fc2(F.gelu(self.fc1(self.post_attention_layernorm(x))))


def _rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Adjacent feature pairs of ``x`` ``[N, P, heads, D]`` turned by ``turns`` ``[P, 1, D/2]`` (unit complex
    numbers), in float32: each pair as one complex number times its turn (one kernel, not one per term)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turns).flatten(-2).to(x.dtype)


def rotary_angles(v: Any) -> torch.Tensor:
    """``[side * side + 1, head_dim / 2]`` float32 angles of the vision model's rotary embedding: for each patch (row
    by row, then the class token, which is not turned) the first half of a head's pairs turn by ``(column + 1) *
    f_i``, the second by ``(row + 1) * f_i``, ``f_i = theta^(-4i / head_dim)``."""
    side = int(v.image_size) // int(v.patch_size)
    half = int(v.hidden_size) // int(v.num_attention_heads) // 2
    params = getattr(v, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(v, "rope_theta", 10000.0)))
    freqs = 1.0 / theta ** (torch.arange(0, half, 2)[: half // 2].float() / half)
    index = torch.arange(side * side)
    cols = ((index % side + 1)[:, None] * freqs).float()
    rows = ((index // side + 1)[:, None] * freqs).float()
    angles = torch.cat([cols, rows], dim=-1)
    return torch.cat([angles, torch.zeros(1, angles.shape[1])])   # (the class token, last)


class Llama4ImageEncoder(nn.Module):
    """Tiles ``[N, C, S, S]`` to ``[N, positions_per_tile, text hidden]`` embeddings."""

    tiles_per_pass = TILES_PER_PASS

    def __init__(self, mm_config: Any):
        super().__init__()
        v = mm_config.vision_config
        self.mm_config = mm_config
        h, self.patch = int(v.hidden_size), int(v.patch_size)
        if int(v.image_size) % self.patch:
            raise UnsupportedModelError(f"Llama 4: patch_size {self.patch} does not divide image_size {v.image_size}")
        self.side = int(v.image_size) // self.patch
        self.shuffle = _shuffle_factor(v)
        if self.side % self.shuffle:
            raise UnsupportedModelError(f"Llama 4: {self.side} patches a side, which a {self.shuffle}x{self.shuffle} "
                                        "pixel shuffle cannot divide")
        if int(v.intermediate_size) != h * self.shuffle ** 2:
            raise UnsupportedModelError(f"Llama 4: the vision adapter takes intermediate_size {v.intermediate_size} "
                                        f"features, but the pixel shuffle makes {h * self.shuffle ** 2} (hidden_size "
                                        f"{h} x {self.shuffle ** 2})")
        if int(v.projector_input_dim) != int(v.projector_output_dim):
            raise UnsupportedModelError(f"Llama 4: projector_input_dim {v.projector_input_dim} and "
                                        f"projector_output_dim {v.projector_output_dim} differ")
        self.patch_embedding = nn.Linear(int(v.num_channels) * self.patch * self.patch, h, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(h))
        self.positional_embedding = nn.Parameter(torch.zeros(self.side * self.side + 1, h))
        self.layernorm_pre, self.layernorm_post = nn.LayerNorm(h), nn.LayerNorm(h)
        self.layers = nn.ModuleList(_Block(v) for _ in range(int(v.num_hidden_layers)))
        self.adapter_fc1 = nn.Linear(h * self.shuffle ** 2, int(v.projector_input_dim), bias=False)
        self.adapter_fc2 = nn.Linear(int(v.projector_output_dim), int(v.projector_output_dim), bias=False)
        self.projector = nn.Linear(int(v.vision_output_dim), int(mm_config.text_config.hidden_size), bias=False)
        # (not buffers: the rotary tables stay float32 whatever dtype the encoder is cast to, as transformers turns
        # the features in float32)
        angles = rotary_angles(v)[:, None, :]
        self._turns = torch.polar(torch.ones_like(angles), angles)   # (complex64)

    def _rotary(self, device: torch.device) -> torch.Tensor:
        if self._turns.device != device:
            self._turns = self._turns.to(device)
        return self._turns

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.to(self.patch_embedding.weight.dtype)
        n, c = x.shape[:2]
        side, p = self.side, self.patch
        # each patch's pixels channel by channel, then row by row (what torch's Unfold gives), patches row by row
        x = x.reshape(n, c, side, p, side, p).permute(0, 2, 4, 1, 3, 5).reshape(n, side * side, c * p * p)
        x = self.patch_embedding(x)
        x = torch.cat([x, self.class_embedding.expand(n, 1, -1)], dim=1) + self.positional_embedding
        x = self.layernorm_pre(x)
        turns = self._rotary(x.device)
        for layer in self.layers:
            x = layer(x, turns)
        x = pixel_shuffle(self.layernorm_post(x)[:, :-1], side, self.shuffle)   # (the class token dropped)
        x = F.gelu(self.adapter_fc2(F.gelu(self.adapter_fc1(x))))
        return self.projector(x)

    def pack(self, features: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's ``[positions, hidden]`` embeddings: its tiles' in order (the global view last)."""
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from the checkpoint's ``vision_model.*`` and ``multi_modal_projector.*`` tensors.

        Raises:
            ModelLoadError: see :func:`~plinth.multimodal.vision.load_encoder_weights`.
        """
        load_encoder_weights(self, weights, _parameter_name, partial, write)


_NAMES = {"patch_embedding.linear.weight": "patch_embedding.weight", "class_embedding": "class_embedding",
          "positional_embedding_vlm": "positional_embedding",
          "vision_adapter.mlp.fc1.weight": "adapter_fc1.weight", "vision_adapter.mlp.fc2.weight": "adapter_fc2.weight"}
_BLOCK = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2",
          "input_layernorm", "post_attention_layernorm"}


def _parameter_name(name: str) -> str | None:
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return "projector." + rest[len("linear_1."):] if rest.startswith("linear_1.") else f"(unknown) {rest}"
    for prefix in ("model.vision_model.", "vision_model."):
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest in _NAMES:
            return _NAMES[rest]
        if rest.startswith(("layernorm_pre.", "layernorm_post.")):
            return rest
        if rest.startswith("model.layers."):
            index, _, part = rest[len("model.layers."):].partition(".")
            module, _, leaf = part.rpartition(".")
            if module in _BLOCK:
                return f"layers.{index}.{module.rpartition('.')[2]}.{leaf}"
        return f"(unknown) {rest}"
    return None


class ImageProcessor:
    """Llama 4's image processing: an image to ``[tiles, C, S, S]`` pixels (its grid of tiles, row by row, then its
    global view where the grid has more than one tile). Settings as in the checkpoint's ``preprocessor_config.json``.

    Raises:
        ModelLoadError: settings plinth does not take (a non-square tile, a resampling other than bilinear, no
            resizing).
    """

    def __init__(self, size: int = 336, max_patches: int = 16, resize_to_max_canvas: bool = False,
                 image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                 rescale_factor: float = 1 / 255, do_rescale: bool = True, do_normalize: bool = True):
        self.size = int(size)
        self.max_patches = int(max_patches)
        self.resize_to_max_canvas = bool(resize_to_max_canvas)
        self.image_mean, self.image_std = [float(m) for m in image_mean], [float(s) for s in image_std]
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean and image_std take one value a channel, got {image_mean!r}, {image_std!r}")
        self.rescale_factor = float(rescale_factor)
        self.do_rescale, self.do_normalize = bool(do_rescale), bool(do_normalize)
        #: (a setting transformers' processors take; images always reach RGB here, transparent pixels over white)
        self.do_convert_rgb = True

    @classmethod
    def for_checkpoint(cls, mm_config: Any, path: str | None) -> ImageProcessor:
        """The processor of a checkpoint's ``preprocessor_config.json`` (transformers' defaults at the tower's size
        where it has none)."""
        side = int(mm_config.vision_config.image_size)
        file = Path(path) / "preprocessor_config.json" if path is not None else None
        if file is None or not file.is_file():
            return cls(size=side)
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: cannot read it: {exc}") from exc
        size = raw.get("size", {"height": side, "width": side})
        if not isinstance(size, dict) or size.get("height") != size.get("width") or not isinstance(
                size.get("height"), int):
            raise ModelLoadError(f"{file}: Llama 4's tiles are square; size {size!r}")
        if raw.get("resample", 2) != 2:
            raise ModelLoadError(f"{file}: resample {raw.get('resample')!r}; plinth resizes Llama 4's images "
                                 "bilinearly (2), as its checkpoints are configured")
        if raw.get("do_resize", True) is False:
            raise ModelLoadError(f"{file}: do_resize false; Llama 4 always resizes images to a canvas of tiles")
        if int(size["height"]) != side:
            raise ModelLoadError(f"{file}: tiles of {size['height']} pixels; the vision tower takes {side}")
        keys = ("max_patches", "resize_to_max_canvas", "image_mean", "image_std", "rescale_factor", "do_rescale",
                "do_normalize")
        given = {k: raw[k] for k in keys if raw.get(k) is not None}
        most = given.get("max_patches", 16)
        if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_TILES_SETTING:
            raise ModelLoadError(f"{file}: max_patches must be an integer from 1 to {MAX_TILES_SETTING}, got {most!r}")
        for key in ("image_mean", "image_std"):   # (one number for every channel, as transformers takes it)
            value = given.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                given[key] = [float(value)] * 3
        try:
            return cls(size=side, **given)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{file}: settings plinth cannot read: {exc}") from exc

    def canvases(self) -> list[tuple[int, int]]:
        """The ``(height, width)`` canvases of at most ``max_patches`` tiles, in the order transformers lists them
        (by aspect ratio as first met, most tiles first), which settles ties."""
        by_ratio: dict[float, list[tuple[int, int]]] = {}
        for count in range(self.max_patches, 0, -1):
            for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
                by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
        return [(r * self.size, c * self.size) for pairs in by_ratio.values() for r, c in pairs]

    def canvas(self, height: int, width: int) -> tuple[int, int]:
        """The canvas an image of ``height x width`` is fitted into: the least enlargement that fits (the most, with
        ``resize_to_max_canvas``), else the least reduction; of those, the smallest canvas."""
        canvases = torch.tensor(self.canvases())
        # (float32, as transformers compares the scales)
        scales = torch.minimum(canvases[:, 1] / width, canvases[:, 0] / height)
        up = scales[scales >= 1]
        if len(up):
            chosen = up.max() if self.resize_to_max_canvas else up.min()
        else:
            chosen = scales[scales < 1].max()
        fits = canvases[scales == chosen]
        best = fits[torch.argmin(fits[:, 0] * fits[:, 1])]
        return int(best[0]), int(best[1])

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of tiles an image of ``height x width`` is cut into."""
        h, w = self.canvas(height, width)
        return h // self.size, w // self.size

    def tiles(self, height: int, width: int) -> int:
        return tile_count(*self.grid(height, width))

    def fitted(self, height: int, width: int, canvas_h: int, canvas_w: int) -> tuple[int, int]:
        """The size an image of ``height x width`` is resized to in its canvas: without distortion, enlarged at most
        to one tile's side (unless ``resize_to_max_canvas``). Where a bound is the canvas's side, transformers
        computes its scale in float32 (the canvas is a tensor there), else in float64; the rounding down of the
        other side follows it, so it is done here the same way."""
        bounds = [(canvas_h, True), (canvas_w, True)]
        if not self.resize_to_max_canvas:
            # (Python's min keeps its first argument on a tie: the image's side, a float64 bound)
            bounds = [(max(side, self.size), False) if max(side, self.size) <= canvas else (canvas, True)
                      for side, canvas in ((height, canvas_h), (width, canvas_w))]
        (bound_h, f32_h), (bound_w, f32_w) = bounds
        scale_w = np.float32(bound_w) / np.float32(width) if f32_w else bound_w / width
        scale_h = np.float32(bound_h) / np.float32(height) if f32_h else bound_h / height
        if f32_w or f32_h:
            smaller = np.float32(scale_w) < np.float32(scale_h)
        else:
            smaller = scale_w < scale_h
        if smaller:
            grown = np.float32(height) * scale_w if f32_w else height * scale_w
            return max(min(math.floor(grown), bound_h), 1), max(bound_w, 1)
        grown = np.float32(width) * scale_h if f32_h else width * scale_h
        return max(bound_h, 1), max(min(math.floor(grown), bound_w), 1)

    def _resized(self, image: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``[C, H, W]`` uint8 resized (bilinear, antialiased, rounded to uint8 as torchvision does)."""
        if tuple(image.shape[-2:]) == (height, width):
            return image
        return F.interpolate(image[None], size=(height, width), mode="bilinear", align_corners=False,
                             antialias=True)[0]

    def _normalized(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 pixels scaled and normalised, as float32: both in bfloat16 (the checkpoints' processing), as
        transformers does; either alone in float32."""
        x = image.to(torch.bfloat16) if self.do_rescale and self.do_normalize else image.float()
        if self.do_rescale:
            x = x * self.rescale_factor
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=x.dtype)[:, None, None]
            std = torch.tensor(self.image_std, dtype=x.dtype)[:, None, None]
            x = (x - mean) / std
        return x.float()

    def tile(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """A PIL image's ``[tiles, C, S, S]`` float32 pixels and its ``(rows, cols)`` grid."""
        from plinth.multimodal.images import _rgb

        # (transparent pixels over white, as transformers converts images)
        pixels = torch.from_numpy(np.asarray(_rgb(image), dtype=np.uint8).copy()).permute(2, 0, 1)
        pixels = pixels.contiguous()
        height, width = int(pixels.shape[1]), int(pixels.shape[2])
        canvas_h, canvas_w = self.canvas(height, width)
        new_h, new_w = self.fitted(height, width, canvas_h, canvas_w)
        resized = self._resized(pixels, new_h, new_w)
        canvas = torch.zeros(3, canvas_h, canvas_w, dtype=torch.uint8)
        canvas[:, :resized.shape[1], :resized.shape[2]] = resized
        rows, cols, s = canvas_h // self.size, canvas_w // self.size, self.size
        tiles = self._normalized(canvas).reshape(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
        if rows * cols > 1:
            tiles = torch.cat([tiles, self._normalized(self._resized(pixels, s, s))[None]])
        return tiles, (rows, cols)

    def __call__(self, images: Sequence[Any], return_tensors: str = "pt") -> dict[str, Any]:
        """transformers' processor call: ``pixel_values`` ``[all tiles, C, S, S]`` and ``aspect_ratios``."""
        out = [self.tile(img) for img in images]
        return {"pixel_values": torch.cat([t for t, _ in out]),
                "aspect_ratios": torch.tensor([list(g) for _, g in out])}


class PromptTokens:
    """The tokens of a Llama 4 image's prompt (the tokenizer's ``<|image_start|>``, ``<|image_end|>``,
    ``<|image|>``, ``<|tile_x_separator|>``, ``<|tile_y_separator|>``; the patches take the config's image token).

    Raises:
        ValueError: the tokenizer lacks one of them.
    """

    def __init__(self, mm_config: Any, tokenizer: Any):
        self.image = int(mm_config.image_token_index)
        self.per_tile = positions_per_tile(mm_config)
        names = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|tile_x_separator|>", "<|tile_y_separator|>")
        ids = [tokenizer.convert_tokens_to_ids(t) for t in names]
        missing = [n for n, i in zip(names, ids, strict=True)
                   if not isinstance(i, int) or i < 0 or i == getattr(tokenizer, "unk_token_id", None)]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s)")
        self.start, self.end, self.placeholder, self.x_sep, self.y_sep = (int(i) for i in ids)

    def layout(self, rows: int, cols: int) -> list[int]:
        """An image's prompt tokens (``rows x cols`` tiles; the global view after more than one)."""
        patches = [self.image] * self.per_tile
        out = [self.start]
        if rows * cols > 1:
            for _ in range(rows):
                for c in range(cols):
                    out += patches
                    if c + 1 < cols:
                        out.append(self.x_sep)
                out.append(self.y_sep)
        return [*out, self.placeholder, *patches, self.end]

    def laid_out(self, ids: Sequence[int]) -> bool:
        """Whether a prompt carries an image's layout already (its ``<|image_start|>``)."""
        return self.start in ids
