"""Gemma 3's images (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b): the SigLIP vision tower, all of its
layers and its final LayerNorm, then Gemma 3's projector (the patch grid average-pooled to ``mm_tokens_per_image``
positions, a Gemma RMSNorm, one matrix).

An image's prompt is Gemma 3's processor's: the ``<start_of_image>`` a prompt carries becomes ``"\\n\\n"``, itself,
the image's positions, ``<end_of_image>``, ``"\\n\\n"`` (:func:`expand_prompt`, which joins the new line breaks with
those beside them as the tokenizer would have). The language model attends bidirectionally among one image's
positions (each image position sees the whole image, in the sliding-window layers too): see
:func:`plinth.attention_backends.interface.attend_within_images`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from plinth.core.scheduler import RequestRejectedError
from plinth.multimodal.vision import FullTower, load_encoder_weights, tower_parameter

#: the most images the encoder takes in one pass (896-pixel images are 4,096 patches each)
IMAGES_PER_PASS = 4

#: the pan-and-scan settings of Gemma 3's image processor, where its config leaves them unset: transformers'
#: ``Gemma3Processor`` defaults (crops off)
PAN_AND_SCAN_DEFAULTS: dict[str, Any] = {"do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256,
                                         "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
#: the text Gemma 3's processor writes around an image that has pan-and-scan crops
ORIGINAL_TEXT, CROPS_TEXT = "Here is the original image ", " and here are some crops to help you see better "


def crop_count(height: int, width: int, processor: Any) -> int:
    """How many pan-and-scan crops Gemma 3's image processor cuts from a ``height`` x ``width`` image (0 with
    ``do_pan_and_scan`` off): 2 up to ``pan_and_scan_max_num_crops`` along the longer side, about its ratio to the
    shorter one, when that ratio reaches ``pan_and_scan_min_ratio_to_activate`` and the crops keep at least
    ``pan_and_scan_min_crop_size`` pixels a side (transformers' ``Gemma3ImageProcessor.pan_and_scan``)."""
    if not getattr(processor, "do_pan_and_scan", False):
        return 0
    min_size = int(processor.pan_and_scan_min_crop_size)
    most = int(processor.pan_and_scan_max_num_crops)
    ratio = float(processor.pan_and_scan_min_ratio_to_activate)
    long, short = (width, height) if width >= height else (height, width)
    if long / short < ratio:
        return 0
    count = min(math.floor(long / min_size), math.floor(long / short + 0.5))
    count = min(most, max(2, count))
    if min(math.ceil(long / count), short) < min_size:
        return 0
    return count


def is_gemma3(mm_config: Any) -> bool:
    """Whether ``mm_config`` is Gemma 3's image-and-text config."""
    return getattr(mm_config, "model_type", None) == "gemma3"


class Gemma3ImageEncoder(FullTower):
    """Pixels ``[N, C, S, S]`` to ``[N, mm_tokens_per_image, text hidden]`` embeddings."""

    #: the most images a pass takes (the runner's batching, start-up's profile)
    tiles_per_pass = IMAGES_PER_PASS

    def __init__(self, mm_config: Any):
        vcfg = mm_config.vision_config
        super().__init__(vcfg)
        self.mm_config = mm_config
        tokens = int(mm_config.mm_tokens_per_image)
        per_side = int(round(tokens ** 0.5))
        if per_side * per_side != tokens or per_side < 1 or self.side % per_side:
            from plinth.errors import UnsupportedModelError

            raise UnsupportedModelError(f"Gemma 3: mm_tokens_per_image {tokens} is not a square grid that divides the "
                                        f"vision tower's {self.side}x{self.side} patches")
        self.kernel = self.side // per_side
        self.norm_weight = nn.Parameter(torch.zeros(vcfg.hidden_size))
        self.norm_eps = float(vcfg.layer_norm_eps)
        self.projection = nn.Parameter(torch.zeros(vcfg.hidden_size, mm_config.text_config.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_features(pixel_values)                                              # [N, P, Hv]
        n, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)   # [N, T, Hv]
        y = pooled.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps) * (1.0 + self.norm_weight.float())
        return torch.matmul(y.to(x.dtype), self.projection)

    def pack(self, features: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's ``[positions, hidden]`` embeddings (its single tile's)."""
        return features[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from the checkpoint's ``vision_tower.*`` and ``multi_modal_projector.*`` tensors
        (either layout transformers writes; SigLIP's pooling head, unused, is skipped).

        Raises:
            ModelLoadError: see :func:`~plinth.multimodal.vision.load_encoder_weights`.
        """
        load_encoder_weights(self, weights, _parameter_name, partial, write)


def _parameter_name(name: str) -> str | None:
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return {"mm_input_projection_weight": "projection", "mm_soft_emb_norm.weight": "norm_weight"}.get(
                rest, rest)
    for prefix in ("model.vision_tower.", "vision_tower."):
        if name.startswith(prefix):
            return tower_parameter(name[len(prefix):].removeprefix("vision_model."))
    return None


class PromptLayout:
    """How Gemma 3 lays out an image in a prompt's tokens.

    Args:
        mm_config: the checkpoint's ``Gemma3Config``.
        tokenizer: the model's (its line-break tokens; ``None``: line breaks are not joined).
    """

    def __init__(self, mm_config: Any, tokenizer: Any):
        self.begin = int(mm_config.boi_token_index)
        self.end = int(mm_config.eoi_token_index)
        self.image = int(mm_config.image_token_index)
        self.tokenizer = tokenizer
        self.breaks: list[int] = self._encode("\n\n") if tokenizer is not None else []
        self._newline_ids: dict[int, bool] = {}

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _is_newlines(self, token: int) -> bool:
        """Whether ``token`` is line breaks only."""
        known = self._newline_ids.get(token)
        if known is None:
            text = self.tokenizer.decode([token])
            known = self._newline_ids[token] = bool(text) and set(text) == {"\n"}
        return known

    def expand_prompt(self, ids: Sequence[int], crops: Sequence[int] = ()) -> list[int]:
        """``ids`` with each ``<start_of_image>`` not already followed by image tokens made into ``"\\n\\n"``,
        ``<start_of_image>``, one image token (widened later to the image's positions), ``<end_of_image>``,
        ``"\\n\\n"``; a run of line-break tokens that takes new ones is tokenized again as one text (as the tokenizer
        would have made the processor's text). ``crops``: each such image's pan-and-scan crops (none where not
        given); an image with crops becomes its processor's sentence around the image and each crop, each laid out
        as above, and the text between the special tokens around it is tokenized again as one text."""
        out: list[int | str] = []   # token ids, and text (pan-and-scan's sentences) tokenized with its neighbours
        fresh: list[bool] = []   # whether out[i] is a line break put in here
        k = 0
        laid_out = any(t == self.begin and nxt == self.image for t, nxt in zip(ids, ids[1:], strict=False))
        if any(crops) and laid_out and any(t == self.begin for i, t in enumerate(ids)
                                          if i + 1 == len(ids) or ids[i + 1] != self.image):
            raise RequestRejectedError("with pan-and-scan crops, a prompt lays out all of its images or none of them "
                                       "(it has both an image laid out and a bare <start_of_image>)",
                                       param="multi_modal_data")
        for i, token in enumerate(ids):
            if token != self.begin or (i + 1 < len(ids) and ids[i + 1] == self.image):
                out.append(token)
                fresh.append(False)
                continue
            count = crops[k] if k < len(crops) else 0
            k += 1
            if not count:
                for part, new in ((self.breaks, True), ([self.begin, self.image, self.end], False),
                                  (self.breaks, True)):
                    out.extend(part)
                    fresh.extend([new] * len(part))
                continue
            image = [self.begin, self.image, self.end]
            parts: list[int | str] = [ORIGINAL_TEXT + "\n\n", *image, "\n\n" + CROPS_TEXT + "\n\n", *image]
            for _ in range(count - 1):
                parts += ["\n\n \n\n", *image]
            parts.append("\n\n")
            out.extend(parts)
            fresh.extend([False] * len(parts))
        if any(isinstance(t, str) for t in out):
            out, fresh = self._tokenize_texts(out, fresh)
        if self.tokenizer is None or not any(fresh):
            return out   # type: ignore[return-value]
        joined: list[int] = []
        i = 0
        while i < len(out):
            if not self._is_newlines(out[i]):   # type: ignore[arg-type]
                joined.append(out[i])   # type: ignore[arg-type]
                i += 1
                continue
            j = i
            while j < len(out) and self._is_newlines(out[j]):   # type: ignore[arg-type]
                j += 1
            if any(fresh[i:j]) and j - i > 1:
                joined.extend(self._encode(self.tokenizer.decode(out[i:j])))
            else:
                joined.extend(out[i:j])   # type: ignore[arg-type]
            i = j
        return joined

    def _tokenize_texts(self, out: list[int | str], fresh: list[bool]) -> tuple[list[int], list[bool]]:
        """``out`` with each run between special tokens that holds text made into tokens: its tokens decoded, joined
        with the text, and tokenized as one text (as the tokenizer reads the processor's text)."""
        if self.tokenizer is None:
            raise RequestRejectedError("Gemma 3's pan-and-scan crops need the model's tokenizer")
        special = {*self.tokenizer.all_special_ids, self.begin, self.end, self.image}
        ids: list[int] = []
        flags: list[bool] = []
        i = 0
        while i < len(out):
            if isinstance(out[i], int) and out[i] in special:
                ids.append(out[i])   # type: ignore[arg-type]
                flags.append(fresh[i])
                i += 1
                continue
            j = i
            while j < len(out) and not (isinstance(out[j], int) and out[j] in special):
                j += 1
            run = out[i:j]
            if any(isinstance(t, str) for t in run):
                text, pending = "", []
                for t in run:
                    if isinstance(t, str):
                        text += self.tokenizer.decode(pending, clean_up_tokenization_spaces=False) + t
                        pending = []
                    else:
                        pending.append(t)
                text += self.tokenizer.decode(pending, clean_up_tokenization_spaces=False)
                new = self._encode(text)
                ids.extend(new)
                flags.extend([False] * len(new))
            else:
                ids.extend(run)   # type: ignore[arg-type]
                flags.extend(fresh[i:j])
            i = j
        return ids, flags
