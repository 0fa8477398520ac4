"""Idefics3 and SmolVLM images (``Idefics3ForConditionalGeneration``: Idefics3-8B, SmolVLM-256M/500M/2B-Instruct;
``SmolVLMForConditionalGeneration``: SmolVLM2): each image as tiles of the vision tower's size and a global view.

The image processor resizes an image (its longest side to ``size["longest_edge"]``), then to whole tiles of
``max_image_size`` pixels, cuts it into ``rows x cols`` tiles and adds the whole image resized to one tile (an image
that fits one tile is that tile alone). Each tile runs through the SigLIP tower (all its layers and its final
LayerNorm), a pixel shuffle (``scale_factor``: each ``s x s`` patches become one position) and one matrix: ``(S / P /
s)^2`` positions a tile. The prompt's ``<image>`` becomes the processor's layout (:func:`layout`): per tile
``<fake_token_around_image>``, ``<row_i_col_j>``, its image tokens, a line break after each row of tiles, then
``<fake_token_around_image><global-img>``, the global view's image tokens and ``<fake_token_around_image>``; only the
image tokens take embeddings. The language model (Llama) attends causally, as for text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from plinth.multimodal.vision import FullTower, load_encoder_weights, pixel_shuffle, tower_parameter

#: tiles the encoder takes in one pass (SmolVLM's images are up to 17 tiles: one pass each)
TILES_PER_PASS = 32
#: the image processor's bound on a resized image's longest side (transformers' ``MAX_IMAGE_SIZE``)
MAX_IMAGE_SIDE = 4096


def is_idefics3(mm_config: Any) -> bool:
    """Whether ``mm_config`` is Idefics3's or SmolVLM's image-and-text config."""
    return getattr(mm_config, "model_type", None) in ("idefics3", "smolvlm")


def positions_per_tile(mm_config: Any) -> int:
    """The positions one tile's embeddings fill."""
    v = mm_config.vision_config
    return (int(v.image_size) // int(v.patch_size)) ** 2 // int(mm_config.scale_factor) ** 2


class Idefics3ImageEncoder(FullTower):
    """Tiles ``[N, C, S, S]`` to ``[N, positions_per_tile, text hidden]`` embeddings."""

    tiles_per_pass = TILES_PER_PASS

    def __init__(self, mm_config: Any):
        v = mm_config.vision_config
        super().__init__(v)
        self.mm_config = mm_config
        self.scale = int(mm_config.scale_factor)
        if self.side % self.scale:
            from plinth.errors import UnsupportedModelError

            raise UnsupportedModelError(f"scale_factor {self.scale} does not divide the vision tower's {self.side} "
                                        "patches a side")
        self.proj = nn.Linear(v.hidden_size * self.scale ** 2, mm_config.text_config.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_shuffle(self.patch_features(pixel_values), self.side, self.scale))

    def pack(self, features: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's ``[positions, hidden]`` embeddings: its tiles' in order (the global view last)."""
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from the checkpoint's ``model.vision_model.*`` and ``model.connector.*`` tensors.

        Raises:
            ModelLoadError: see :func:`~plinth.multimodal.vision.load_encoder_weights`.
        """
        load_encoder_weights(self, weights, _parameter_name, partial, write)


def _parameter_name(name: str) -> str | None:
    if name.startswith("model.connector.modality_projection.proj."):
        return "proj." + name[len("model.connector.modality_projection.proj."):]
    if name.startswith("model.vision_model."):
        return tower_parameter(name[len("model.vision_model."):])
    return None


def grid_of(processor: Any, size: tuple[int, int]) -> tuple[int, int]:
    """``(rows, cols)`` of tiles the image processor cuts an image of ``size`` (height, width) into; ``(0, 0)``: the
    image is one tile alone. Raises ``KeyError`` / ``AttributeError`` for a processor of other settings."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        _resize_output_size_rescale_to_max_len,
        _resize_output_size_scale_below_upper_bound,
    )

    height, width = size
    if not getattr(processor, "do_image_splitting", True):
        return 0, 0
    if getattr(processor, "do_resize", True):
        longest = processor.size["longest_edge"]
        if not longest:   # (a size given as height and width: the caller runs the processor instead)
            raise KeyError("longest_edge")
        height, width = _resize_output_size_rescale_to_max_len(height, width, max_len=longest)
        height, width = _resize_output_size_scale_below_upper_bound(height, width, max_len=MAX_IMAGE_SIDE)
    tile = int(processor.max_image_size["longest_edge"])
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return height // tile, width // tile
    return 0, 0


class PromptTokens:
    """The tokens an Idefics3 / SmolVLM image's prompt is made of (the tokenizer's).

    Raises:
        ValueError: the tokenizer lacks ``<fake_token_around_image>``.
    """

    def __init__(self, mm_config: Any, tokenizer: Any):
        self.image = int(mm_config.image_token_id)
        self.per_tile = positions_per_tile(mm_config)
        self.fake = self._token(tokenizer, "<fake_token_around_image>")
        self.tokenizer = tokenizer
        self.global_ids = self._encode("<global-img>")
        self.newline, self.newlines = self._encode("\n"), self._encode("\n\n")
        self._row_col: dict[tuple[int, int], list[int]] = {}

    @staticmethod
    def _token(tokenizer: Any, text: str) -> int:
        token = tokenizer.convert_tokens_to_ids(text)
        if not isinstance(token, int) or token < 0 or token == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer has no {text} token")
        return int(token)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def layout(self, rows: int, cols: int) -> list[int]:
        """An image's prompt tokens (``rows x cols`` tiles and the global view; ``(0, 0)``: one tile alone)."""
        images = [self.image] * self.per_tile
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                tag = self._row_col.get((r, c))
                if tag is None:
                    tag = self._row_col[(r, c)] = self._encode(f"<row_{r + 1}_col_{c + 1}>")
                out += [self.fake, *tag, *images]
            # (a line break after each row; the last row's joins the one before the global view)
            out += self.newline if r + 1 < rows else self.newlines
        return out + [self.fake, *self.global_ids, *images, self.fake]

    def laid_out(self, ids: Sequence[int]) -> bool:
        """Whether a prompt carries an image's layout already (its ``<fake_token_around_image>``)."""
        return self.fake in ids
