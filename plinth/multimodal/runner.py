"""The runner's side of image inputs: the image encoder, its recent outputs, and the rows of a step's batch that
take image embeddings instead of token embeddings."""

from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plinth.multimodal.gemma3 import Gemma3ImageEncoder, is_gemma3
from plinth.multimodal.idefics3 import Idefics3ImageEncoder, is_idefics3
from plinth.multimodal.images import ImageItem
from plinth.multimodal.internvl import InternVLImageEncoder, is_internvl
from plinth.multimodal.llama4 import Llama4ImageEncoder, is_llama4
from plinth.multimodal.pixtral import PixtralEncoder, is_pixtral
from plinth.multimodal.qwen_vision import QwenVisionEncoder, is_qwen_vl
from plinth.multimodal.vision import ImageEncoder

logger = logging.getLogger(__name__)

#: the bytes of image embeddings kept between steps (a long prompt's image is encoded once, not once per chunk)
CACHE_BYTES = 256 << 20

#: the most images or tiles the encoder takes in one pass
MAX_TILES = 32
#: Qwen2-VL: the most patches the encoder takes in one pass (an image with more goes alone)
MAX_PATCHES = 16384

#: ``(first row of the flat batch, rows, image, first of the image's positions)``: a step's rows that take an
#: image's embeddings
ImageRows = tuple[int, int, ImageItem, int]


class ImageFeatures:
    """Encodes a step's images (those not encoded lately) and gives the embeddings of its image rows.

    Args:
        encoder: the checkpoint's image encoder, on the runner's device and in the model's dtype; ``None``: a text
            model that takes prompts given as embeddings only (:mod:`plinth.core.prompt_embeds`).
        capacity_bytes: the most bytes of embeddings kept between steps (a step's own are always kept).
        device, dtype: where and in which dtype the embeddings go (default: the encoder's).
    """

    def __init__(self, encoder: ImageEncoder | QwenVisionEncoder | PixtralEncoder | None,
                 capacity_bytes: int = CACHE_BYTES, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        self.encoder = encoder
        self.capacity_bytes = capacity_bytes
        if encoder is not None:
            first = next(encoder.parameters())
            device, dtype = first.device, first.dtype
        assert device is not None and dtype is not None, "embeddings without an encoder need a device and a dtype"
        self.device: torch.device = device
        self.dtype: torch.dtype = dtype
        #: Mistral 3: the patches of start-up's encoder pass (a batch of images takes at most as many); 0: none ran
        self.pass_patches = 0
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        #: GPUs: two pinned host buffers of one encoder pass's tiles (see :meth:`_passes`), made when first needed
        self._staging: list[torch.Tensor] | None = None

    @torch.inference_mode()
    def embeddings(self, items: Sequence[ImageItem]) -> list[torch.Tensor]:
        """Each item's ``[length, hidden]`` embeddings (encoded now where not kept from an earlier step)."""
        todo = {item.key: item for item in items if item.key not in self._cache}
        for key in [key for key, item in todo.items() if item.embeds is not None]:   # given as embeddings
            item = todo.pop(key)
            self._keep(key, item, item.embeds.to(self.device, self.dtype))
        if todo and self.encoder is None:
            raise RuntimeError("image inputs reached a runner that takes prompt embeddings only")
        if todo and todo[next(iter(todo))].grid is not None:   # Qwen2-VL: images and videos of any patch count
            merged = self.encoder.merge ** 2
            parts: dict[str, list[torch.Tensor]] = {}
            for group in _patch_groups([piece for item in todo.values() for piece in _pieces(item)]):
                pixels = torch.cat([p for _, p, _ in group]).to(self.device)
                grids = torch.tensor([g for _, _, g in group], dtype=torch.int64)
                out = self.encoder(pixels, grids).split([t * h * w // merged for _, _, (t, h, w) in group])
                for (key, _, _), features in zip(group, out, strict=True):
                    parts.setdefault(key, []).append(features)
            for key, item in todo.items():
                self._keep(key, item, torch.cat(parts[key]) if len(parts[key]) > 1 else parts[key][0].clone())
        elif todo and isinstance(self.encoder, PixtralEncoder):   # Mistral 3: the images of each size together
            by_size: dict[tuple[int, ...], list[tuple[str, ImageItem]]] = {}
            for key, item in todo.items():
                by_size.setdefault(tuple(item.pixel_values.shape), []).append((key, item))
            enc = self.encoder
            # (at most the patches of start-up's pass a batch: its memory was left free)
            largest = self.pass_patches or (int(enc.mm_config.vision_config.image_size) // enc.patch_size) ** 2
            for group in by_size.values():
                h, w = group[0][1].pixel_values.shape[-2:]
                step = max(1, min(MAX_TILES, largest // max(1, (h // enc.patch_size) * (w // enc.patch_size))))
                for part in (group[i:i + step] for i in range(0, len(group), step)):
                    out = self.encoder(torch.stack([item.pixel_values for _, item in part]))
                    for (key, item), features in zip(part, out, strict=True):
                        self._keep(key, item, features.clone())
        elif todo:
            # at most MAX_TILES tiles a pass: the tower's activations stay within what start-up left free
            per_pass = getattr(self.encoder, "tiles_per_pass", MAX_TILES)
            tiles = torch.cat([self.encoder(chunk) for chunk in self._passes(
                [item.pixel_values for item in todo.values()], per_pass)]).split(
                [len(item.pixel_values) for item in todo.values()])
            for (key, item), features in zip(todo.items(), tiles, strict=True):
                # (a copy: a view would keep the whole pass's output alive while the cache holds one image)
                self._keep(key, item, self.encoder.pack(features, item.image_size).clone())
        wanted = [item.key for item in items]
        for key in wanted:
            self._cache.move_to_end(key)
        keep = set(wanted)
        while self._bytes > self.capacity_bytes:
            key = next((k for k in self._cache if k not in keep), None)
            if key is None:
                break
            old = self._cache.pop(key)
            self._bytes -= old.numel() * old.element_size()
        return [self._cache[key] for key in wanted]

    def _passes(self, pixels: list[torch.Tensor], per_pass: int) -> Iterator[torch.Tensor]:
        """The tiles of ``pixels`` (``[tiles, C, S, S]`` each) in passes of at most ``per_pass``, on the device. On a
        GPU each pass is gathered into one of two pinned host buffers and copied without waiting, so that gathering
        and copying the next pass overlap the encoder's run of this one (a pageable copy would hold the host until
        the GPU is idle)."""
        if self.device.type != "cuda":
            yield from (chunk.to(self.device) for chunk in torch.cat(pixels).split(per_pass))
            return
        passes: list[list[torch.Tensor]] = [[]]
        room = per_pass
        for tiles in pixels:
            start = 0
            while start < len(tiles):
                if not room:
                    passes.append([])
                    room = per_pass
                take = min(room, len(tiles) - start)
                passes[-1].append(tiles[start:start + take])
                start += take
                room -= take
        shape, dtype = tuple(pixels[0].shape[1:]), pixels[0].dtype
        if self._staging is None or self._staging[0].shape != (per_pass, *shape) or self._staging[0].dtype != dtype:
            self._staging = [torch.empty((per_pass, *shape), dtype=dtype, pin_memory=True) for _ in range(2)]
        copied: list[Any] = [None, None]   # each buffer's copy to the device, as an event
        for i, parts in enumerate(passes):
            buffer = self._staging[i % 2]
            if copied[i % 2] is not None:
                copied[i % 2].synchronize()   # (the buffer's copy two passes ago has left it)
            rows = sum(len(p) for p in parts)
            torch.cat([p.to(dtype) for p in parts], out=buffer[:rows])
            on_device = buffer[:rows].to(self.device, non_blocking=True)
            copied[i % 2] = torch.cuda.Event()
            copied[i % 2].record()
            yield on_device

    def _keep(self, key: str, item: ImageItem, features: torch.Tensor) -> None:
        if features.shape[0] != item.embedded:
            raise RuntimeError(f"an image's embeddings fill {features.shape[0]} positions, its prompt {item.embedded}")
        self._cache[key] = features
        self._bytes += features.numel() * features.element_size()

    def rows(self, image_rows: Sequence[ImageRows]) -> tuple[torch.Tensor, ...]:
        """``(rows [K] int64, embeddings [K, hidden])``: the flat batch's rows that take image embeddings, and
        theirs; for a multimodal RoPE (Qwen2-VL) a third item, the rows' ``[K, 3]`` rotary positions."""
        features = self.embeddings([item for _, _, item, _ in image_rows])
        parts = [f[first:first + count] if item.mask is None else f[_ranks(item, first, count)]
                 for f, (_, count, item, first) in zip(features, image_rows, strict=True)]
        width = max(p.shape[1] for p in parts)   # (Qwen3-VL: a prompt's embedded rows have no DeepStack rows: zeros)
        values = torch.cat([p if p.shape[1] == width else torch.nn.functional.pad(p, (0, width - p.shape[1]))
                            for p in parts])
        rows, *positions = image_rows_without_embeddings(image_rows, self.device)
        return rows, values, *positions

    @torch.inference_mode()
    def profile(self, max_model_len: int, image_patches: int | None = None) -> None:
        """Run the encoder's largest pass on random pixels, so that start-up's peak memory (what the KV cache leaves
        free) counts its activations: :data:`MAX_TILES` tiles (LLaVA), or for Qwen2-VL one image of as many patches
        as a pass may take: :data:`MAX_PATCHES`, or the largest image, of at most ``image_patches`` patches (the
        processor's ``max_pixels``) and as many as a prompt of ``max_model_len`` positions holds."""
        enc = self.encoder
        if isinstance(enc, PixtralEncoder):   # one square image of the processor's largest side (whole merged patches)
            unit = enc.patch_size * enc.merge
            side = (math.isqrt(image_patches - 1) + 1) * enc.patch_size if image_patches else \
                int(enc.mm_config.vision_config.image_size)
            side = -(-side // unit) * unit
            enc(torch.randn(int(enc.mm_config.vision_config.num_channels), side, side, device=self.device))
            self.pass_patches = (side // enc.patch_size) ** 2
        elif isinstance(enc, QwenVisionEncoder):
            merge = enc.merge
            largest = max_model_len * merge * merge if image_patches is None else min(image_patches,
                                                                                      max_model_len * merge * merge)
            side = max(1, math.ceil(max(MAX_PATCHES, largest) ** 0.5 / merge))   # merged units a side (rounded up)
            grid = torch.tensor([[1, side * merge, side * merge]], dtype=torch.int64)
            pixels = torch.randn(int(grid.prod()), enc.patch_embed.proj.weight[0].numel(), device=self.device)
            enc(pixels, grid)
        else:
            from plinth.multimodal.internvl import square_size

            size = square_size(enc.mm_config.vision_config.image_size)   # (InternVL's configs give a pair)
            enc(torch.randn(getattr(enc, "tiles_per_pass", MAX_TILES), 3, size, size, device=self.device))

    def clear(self) -> None:
        """Drop the kept embeddings (new weights)."""
        self._cache.clear()
        self._bytes = 0


def image_rows_without_embeddings(image_rows: Sequence[ImageRows], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(rows [K] int64,)`` the flat batch's rows of image positions, and for a multimodal RoPE (Qwen2-VL) their
    ``[K, 3]`` rotary positions too: what a pipeline stage after the first needs of a step's images (the first
    stage embeds them)."""
    rows = torch.tensor(list(itertools.chain.from_iterable(
        range(row, row + count) if item.mask is None else (row + np.flatnonzero(item.mask[first:first + count])).tolist()
        for row, count, item, first in image_rows)), dtype=torch.int64).to(device, non_blocking=True)
    if image_rows[0][2].rope is None:
        return (rows,)
    positions = torch.from_numpy(np.concatenate([item.rope[first:first + count]
                                                 for _, count, item, first in image_rows]))
    return rows, positions.to(device, non_blocking=True)


def _ranks(item: ImageItem, first: int, count: int) -> torch.Tensor:
    """The embedding rows of an image's positions ``[first, first + count)`` that take embeddings (Mistral 3's
    image tokens, not its row breaks)."""
    mask = item.mask
    ranks = np.cumsum(mask) - 1
    return torch.from_numpy(ranks[first:first + count][mask[first:first + count]])


def load_image_features(source: Any, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ImageFeatures | None:
    """The image encoder of ``source`` (a LLaVA or Qwen2-VL checkpoint; ``None`` for any other), its weights read from
    the checkpoint's vision tower and projector tensors (random for dummy weights)."""
    mm_config = getattr(source, "mm_config", None)
    if mm_config is None:
        return None
    from plinth.model_registry.loader import widened_if_bnb
    from plinth.model_registry.weights import SafetensorsWeights, list_safetensors_files
    from plinth.multimodal.vision import ENCODER_PREFIXES, is_next, positions_per_tile

    encoder: Any = (QwenVisionEncoder(mm_config) if is_qwen_vl(mm_config) else PixtralEncoder(mm_config)
                    if is_pixtral(mm_config) else Gemma3ImageEncoder(mm_config) if is_gemma3(mm_config)
                    else Idefics3ImageEncoder(mm_config) if is_idefics3(mm_config)
                    else InternVLImageEncoder(mm_config) if is_internvl(mm_config)
                    else Llama4ImageEncoder(mm_config) if is_llama4(mm_config) else ImageEncoder(mm_config))
    if source.kind == "hf_dir":
        files = list_safetensors_files(Path(source.path))
        # (a bitsandbytes checkpoint's tower is quantized too: widened as it is read, as the language model is)
        encoder.load_weights(itertools.chain.from_iterable(
            widened_if_bnb(SafetensorsWeights(files, only=prefix), source, torch.float32, torch.device("cpu"))
            for prefix in ENCODER_PREFIXES))
    else:   # dummy weights
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in encoder.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    encoder = encoder.to(device=device, dtype=dtype).eval()
    if is_pixtral(mm_config):
        logger.info("image encoder: pixtral, %d of its layers, a position per %dx%d patches",
                    len(encoder.layers), encoder.merge, encoder.merge)
    elif is_qwen_vl(mm_config):
        logger.info("image encoder: %s, %d layers, a position per %dx%d patches", mm_config.vision_config.model_type,
                    mm_config.vision_config.depth, mm_config.vision_config.spatial_merge_size,
                    mm_config.vision_config.spatial_merge_size)
    elif is_internvl(mm_config) or is_idefics3(mm_config) or is_llama4(mm_config):
        from plinth.multimodal import idefics3, internvl, llama4

        per_tile = (internvl if is_internvl(mm_config) else llama4 if is_llama4(mm_config)
                    else idefics3).positions_per_tile(mm_config)
        logger.info("image encoder: %s, %d positions per tile", mm_config.vision_config.model_type, per_tile)
    else:
        logger.info("image encoder: %s, %d of its layers, %d positions per %s", mm_config.vision_config.model_type,
                    len(encoder.tower.layers), positions_per_tile(mm_config),
                    "tile (LLaVA-NeXT)" if is_next(mm_config) else "image")
    from plinth.multimodal.qwen_vision import deepstack_count

    # (Qwen3-VL's rows carry their DeepStack embeddings too: as many positions kept as for the other models)
    return ImageFeatures(encoder, CACHE_BYTES * (1 + deepstack_count(mm_config)))


#: ``(key, patches, grid)``: an image, or a run of a video's frame groups, that the encoder takes in one pass
_Piece = tuple[str, torch.Tensor, tuple[int, int, int]]


def _pieces(item: ImageItem) -> list[_Piece]:
    """An image whole; a video of more than :data:`MAX_PATCHES` patches as runs of its frame groups (the vision tower
    attends within a group, so the runs' features, in order, are the video's)."""
    from plinth.multimodal.video import split_groups

    t, h, w = item.grid
    if t * h * w <= MAX_PATCHES:
        return [(item.key, item.pixel_values, item.grid)]
    counts = split_groups(item.grid, MAX_PATCHES)
    runs = item.pixel_values.split([c * h * w for c in counts])
    return [(item.key, run, (c, h, w)) for run, c in zip(runs, counts, strict=True)]


def _patch_groups(pieces: list[_Piece]) -> list[list[_Piece]]:
    """``pieces`` in order, in groups of at most :data:`MAX_PATCHES` patches (a piece with more alone)."""
    groups: list[list[_Piece]] = []
    total = 0
    for piece in pieces:
        n = len(piece[1])
        if not groups or total + n > MAX_PATCHES:
            groups.append([])
            total = 0
        groups[-1].append(piece)
        total += n
    return groups
