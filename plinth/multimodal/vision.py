"""The image encoder of a LLaVA or LLaVA-NeXT checkpoint: a CLIP or SigLIP vision transformer and the projector that
maps its patch features into the language model's embedding space.

LLaVA-NeXT ("anyres") encodes an image as tiles: the image resized to one tile, then the grid of tiles of the
resolution among ``image_grid_pinpoints`` that fits it best; their features are laid out as the grid, the rows and
columns of padding cut off, a learned ``image_newline`` after each row (:func:`pack_next`).

Only the layers up to the one LLaVA reads (``vision_feature_layer``, usually the next-to-last) are built and run.
Attention is bidirectional over the image's patches (``F.scaled_dot_product_attention``); the encoder runs in the
model's dtype on the engine's device, once per image (the runner keeps recent features, see
:class:`~plinth.multimodal.runner.ImageFeatures`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.errors import ModelLoadError, UnsupportedModelError

#: vision towers this module runs (``vision_config.model_type``)
VISION_TOWERS = ("clip_vision_model", "siglip_vision_model")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


def activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise UnsupportedModelError(f"vision activation {name!r} is not supported")
    return ACT2FN[name]


def feature_layers(mm_config: Any) -> list[int]:
    """The vision layers whose outputs LLaVA reads (``vision_feature_layer``: one index or a list), as indices into
    the hidden states ``[embeddings, layer 1, ..., layer L]``."""
    layers = mm_config.vision_feature_layer
    layers = list(layers) if isinstance(layers, list | tuple) else [layers]
    total = int(mm_config.vision_config.num_hidden_layers)
    out = []
    for layer in layers:
        index = layer if layer >= 0 else total + 1 + layer
        if not 0 <= index <= total:
            raise ModelLoadError(f"vision_feature_layer {layer} is outside the vision tower's {total} layers")
        out.append(index)
    return out


def positions_per_tile(mm_config: Any) -> int:
    """The features one tile (a whole image for LLaVA) gives: a patch each, CLIP's class token too, less the first
    under the ``default`` strategy (transformers' rule, whatever the tower); Gemma 3: its pooled grid's."""
    if getattr(mm_config, "model_type", None) == "gemma3":
        return int(mm_config.mm_tokens_per_image)
    vcfg = mm_config.vision_config
    clip = vcfg.model_type == "clip_vision_model"
    drop = getattr(mm_config, "vision_feature_select_strategy", "default") == "default"
    return (vcfg.image_size // vcfg.patch_size) ** 2 + (1 if clip else 0) - (1 if drop else 0)


def is_next(mm_config: Any) -> bool:
    """Whether ``mm_config`` is LLaVA-NeXT's (tiles of several resolutions, packed)."""
    return getattr(mm_config, "model_type", None) == "llava_next"


def check_layout(mm_config: Any) -> None:
    """Refuse a LLaVA-NeXT config whose tiles' features cannot be laid out as a grid (the ``full`` strategy on a
    CLIP tower, or ``default`` on SigLIP, leave one feature more or fewer than the patches).

    Raises:
        UnsupportedModelError: as above.
    """
    side = mm_config.vision_config.image_size // mm_config.vision_config.patch_size
    if is_next(mm_config) and positions_per_tile(mm_config) != side * side:
        raise UnsupportedModelError(
            f"LLaVA-NeXT with a {mm_config.vision_config.model_type} tower and the "
            f"{getattr(mm_config, 'vision_feature_select_strategy', 'default')!r} feature strategy: its "
            f"{positions_per_tile(mm_config)} features a tile do not form the {side}x{side} grid the packing needs")


def num_tiles(mm_config: Any, image_size: tuple[int, int]) -> int:
    """The tiles an image of ``image_size`` (height, width) is encoded as (1 for LLaVA)."""
    if not is_next(mm_config):
        return 1
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return int(image_size_to_num_patches(list(image_size), mm_config.image_grid_pinpoints,
                                         mm_config.vision_config.image_size))


def tokens_per_image(mm_config: Any, image_size: tuple[int, int] | None = None) -> int:
    """How many prompt positions an image's embeddings fill (LLaVA-NeXT: an image of ``image_size``; the count of
    the packing itself, run on features of width 1)."""
    per_tile = positions_per_tile(mm_config)
    if not is_next(mm_config):
        return per_tile
    assert image_size is not None, "a LLaVA-NeXT image's count depends on its size"
    tiles = num_tiles(mm_config, image_size)
    return pack_next(torch.zeros(tiles, per_tile, 1), image_size, mm_config, torch.zeros(1)).shape[0]


def pack_next(features: torch.Tensor, image_size: tuple[int, int], mm_config: Any,
              newline: torch.Tensor) -> torch.Tensor:
    """LLaVA-NeXT's layout of one image's tile features ``[tiles, P, H]``: the base tile's, then the grid's rows with
    the padding cut off (transformers' ``unpad_image``), ``newline`` ``[H]`` after each; ``[positions, H]``."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    if features.shape[0] == 1:
        return torch.cat([features[0], newline[None].to(features.dtype)], dim=0)
    side = mm_config.vision_config.image_size // mm_config.vision_config.patch_size
    rows, cols = get_anyres_image_grid_shape(list(image_size), mm_config.image_grid_pinpoints,
                                             mm_config.vision_config.image_size)
    grid = features[1:].reshape(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    grid = unpad_image(grid, torch.tensor(image_size))                                   # [H, rows', cols']
    grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.dtype)], dim=-1)
    return torch.cat([features[0], grid.flatten(1, 2).transpose(0, 1)], dim=0)


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(h, eps=eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [N, P, H]
        n, p, h = x.shape
        y = self.layer_norm1(x)
        q, k, v = (proj(y).view(n, p, self.heads, h // self.heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v)            # [N, heads, P, D]; scale D ** -0.5
        x = x + self.out_proj(attn.transpose(1, 2).reshape(n, p, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision transformer, its first ``num_layers`` layers."""

    def __init__(self, cfg: Any, num_layers: int):
        super().__init__()
        self.clip = cfg.model_type == "clip_vision_model"
        h = cfg.hidden_size
        self.patch_size = cfg.patch_size
        self.image_size = cfg.image_size
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, stride=cfg.patch_size,
                                         bias=not self.clip)
        self.class_embedding = nn.Parameter(torch.empty(h)) if self.clip else None
        self.position_embedding = nn.Embedding(num_patches + (1 if self.clip else 0), h)
        self.pre_layrnorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if self.clip else None
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        """The hidden states ``wanted`` (0: the embeddings, ``i``: after layer ``i``) of ``pixel_values``
        ``[N, C, S, S]``, each ``[N, P (+1 class token for CLIP), H]``."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))   # [N, H, S/p, S/p]
        x = x.flatten(2).transpose(1, 2)                                               # [N, P, H]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.layers):
            x = layer(x)
            states[i + 1] = x
        return [states[i] for i in wanted]


class FullTower(nn.Module):
    """A SigLIP vision tower whose every layer runs, then its final LayerNorm: the base of the encoders that read its
    patches' last features (Gemma 3, Idefics3 / SmolVLM)."""

    def __init__(self, vcfg: Any):
        super().__init__()
        self.tower = VisionTower(vcfg, int(vcfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.side = int(vcfg.image_size) // int(vcfg.patch_size)   # patches a side

    def patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, side * side, H]``."""
        return self.post_layernorm(self.tower(pixel_values, [len(self.tower.layers)])[0])


def pixel_shuffle(x: torch.Tensor, side: int, s: int) -> torch.Tensor:
    """Patch features ``[N, side * side, H]`` (rows of patches) to ``[N, (side / s)^2, H * s * s]``: each ``s x s``
    block of patches becomes one position, its patches' features side by side (rows, then columns within the block),
    as transformers' pixel shuffle lays them out (Idefics3 / SmolVLM, InternVL, Llama 4)."""
    n, _, hidden = x.shape
    x = x.reshape(n, side, side // s, hidden * s).permute(0, 2, 1, 3)
    x = x.reshape(n, side // s, side // s, hidden * s * s).permute(0, 2, 1, 3)
    return x.reshape(n, -1, hidden * s * s)


def tower_parameter(rest: str) -> str | None:
    """The :class:`FullTower` parameter of a SigLIP tower tensor (its name after ``vision_model.``); ``None`` for
    the pooling head, which these encoders do not read."""
    if rest.startswith(("head.", "position_ids")):
        return None
    if rest.startswith("post_layernorm."):
        return rest
    if _LAYER.match(rest) is not None:
        rest = "layers." + rest[len("encoder."):].removeprefix("layers.")
        rest = re.sub(r"\.(self_attn|mlp)\.", ".", rest)
    return "tower." + rest.removeprefix("embeddings.")


class ImageEncoder(nn.Module):
    """Pixels to the language model's embeddings: the vision tower's selected features, then LLaVA's projector
    (``linear_1``, the activation, ``linear_2``).

    Args:
        mm_config: the checkpoint's ``LlavaConfig``.
    """

    def __init__(self, mm_config: Any):
        super().__init__()
        vcfg = mm_config.vision_config
        if vcfg.model_type not in VISION_TOWERS:
            raise UnsupportedModelError(f"vision tower {vcfg.model_type!r} is not supported; supported: "
                                        f"{', '.join(VISION_TOWERS)}")
        check_layout(mm_config)
        self.wanted = feature_layers(mm_config)
        self.tower = VisionTower(vcfg, max(self.wanted))
        strategy = getattr(mm_config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        # "default" drops the first feature (CLIP's class token; transformers drops it whatever the tower)
        self.skip = 1 if strategy == "default" else 0
        bias = bool(getattr(mm_config, "multimodal_projector_bias", True))
        text_hidden = mm_config.text_config.hidden_size
        self.linear_1 = nn.Linear(vcfg.hidden_size * len(self.wanted), text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(getattr(mm_config, "projector_hidden_act", "gelu"))
        self.mm_config = mm_config
        #: LLaVA-NeXT: the learned embedding after each row of tiles' features
        self.image_newline = nn.Parameter(torch.empty(text_hidden)) if is_next(mm_config) else None

    def pack(self, features: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's embeddings ``[positions, hidden]`` from its tiles' ``[tiles, P, hidden]``."""
        if self.image_newline is None:
            return features[0]
        assert image_size is not None
        return pack_next(features, image_size, self.mm_config, self.image_newline)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` pixels (images or tiles) -> ``[N, positions_per_tile, text hidden]`` embeddings."""
        states = self.tower(pixel_values, self.wanted)
        features = torch.cat([s[:, self.skip:] for s in states], dim=-1)
        return self.linear_2(self.act(self.linear_1(features)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from a checkpoint's ``vision_tower.*`` and ``multi_modal_projector.*`` tensors
        (either layout transformers writes; the vision layers past the last one read are skipped). ``partial``:
        any subset (new weights in place); ``write=False``: check the shapes only.

        Raises:
            ModelLoadError: a missing tensor (unless ``partial``), one of another shape, or a non-float one.
        """
        def target_of(name: str) -> str | None:
            target = _parameter_name(name, len(self.tower.layers))
            if target is None or target == _SKIPPED or target.startswith(_UNUSED_PARTS):
                return None   # a layer past those run, the post-layernorm, SigLIP's pooling head: not read by LLaVA
            return target

        load_encoder_weights(self, weights, target_of, partial, write)


def load_encoder_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         target_of: Any, partial: bool, write: bool) -> None:
    """Copy checkpoint tensors into an image encoder's parameters: ``target_of(name)`` names each tensor's parameter
    (``None``: not the encoder's, skipped). ``partial``: any subset; ``write=False``: check only.

    Raises:
        ModelLoadError: a missing tensor (unless ``partial``), one with no parameter, of another shape, or not
            floating-point.
    """
    params = dict(module.named_parameters())
    seen: set[str] = set()
    for name, tensor in weights:
        target = target_of(name)
        if target is None:
            continue
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{name}: no such tensor in the image encoder ({target})")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if not tensor.dtype.is_floating_point:
            raise ModelLoadError(f"{name}: a {tensor.dtype} tensor; the image encoder takes floating-point ones")
        if write:
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
        seen.add(target)
    missing = sorted(set(params) - seen)
    if missing and not partial:
        raise ModelLoadError(f"the checkpoint lacks the image encoder's tensors {', '.join(missing[:4])}"
                             + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))


_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_NEWLINE_NAMES = ("model.image_newline", "image_newline")
_SKIPPED = "(skipped)"
#: the tower's tensors LLaVA never reads (after the prefix is mapped)
_UNUSED_PARTS = ("tower.post_layernorm.", "tower.head.", "tower.position_ids")
#: the checkpoint prefixes of Qwen2-VL's encoder tensors (transformers 5's layout, then the original one)
QWEN_ENCODER_PREFIXES = ("model.visual.", "visual.")
#: the checkpoint prefixes of an image encoder's tensors (both layouts transformers writes; LLaVA's, then Qwen2-VL's)
ENCODER_PREFIXES = _TOWER_PREFIXES + _PROJECTOR_PREFIXES + _NEWLINE_NAMES + QWEN_ENCODER_PREFIXES + (
    "model.vision_model.", "model.connector.",   # (and Idefics3's / SmolVLM's)
    "vision_model.")   # (and Llama 4's)


def _parameter_name(name: str, num_layers: int) -> str | None:
    """The :class:`ImageEncoder` parameter of checkpoint tensor ``name`` (``None``: not the encoder's, or a layer
    past those run)."""
    if name in _NEWLINE_NAMES:
        return "image_newline"
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):].removeprefix("vision_model.")
            m = _LAYER.match(rest)
            if m is not None:
                if int(m[1]) >= num_layers:
                    return _SKIPPED   # a layer past those run
                rest = "layers." + rest[len("encoder."):].removeprefix("layers.")
                rest = re.sub(r"\.(self_attn|mlp)\.", ".", rest)
            rest = rest.removeprefix("embeddings.")
            return "tower." + rest
    return None

