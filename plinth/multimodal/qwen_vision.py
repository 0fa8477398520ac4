"""The image encoder of a Qwen2-VL or Qwen2.5-VL checkpoint: a vision transformer over an image's 14-pixel patches
(any number of them: the image processor resizes each image to a multiple of the merge size's patches) and the patch
merger that maps each ``spatial_merge_size`` x ``spatial_merge_size`` group of patch features into one embedding of
the language model.

The pixels come as the image processor lays them out: a row per patch (``C * temporal_patch_size * P * P`` values),
each image's patches frame by frame, a frame's in merge groups (rows of groups, then rows within a group), the
images one after the other. ``grid_thw`` gives each image's frames, rows and columns of patches.

Both generations embed the patches with a Conv3d of stride = kernel (run here as one matmul), rotate queries and keys
by a 2D rotary embedding (a quarter of each head's frequencies for the patch's row, a quarter for its column, the
angles in float32), and attend bidirectionally within each frame of each image, never across images.

- Qwen2-VL: LayerNorm blocks, an MLP ``fc1`` -> ``hidden_act`` -> ``fc2``, every block attending over the whole frame;
  the merger (``ln_q`` LayerNorm, ``mlp.0``, GELU, ``mlp.2``) ends in ``vision_config.hidden_size``.
- Qwen2.5-VL: RMSNorm blocks, a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, with biases), and window
  attention: the merge groups are reordered into windows of ``window_size`` pixels a side (the frame's last row and
  column of windows cut short where the frame is not a multiple of them); the blocks of ``fullatt_block_indexes``
  attend over the whole frame, the others within each window; the merged embeddings are put back in the image
  order. The merger's ``ln_q`` is an RMSNorm and it ends in ``out_hidden_size``.
- Qwen3-VL: Qwen2-VL's blocks (LayerNorm, an MLP ``linear_fc1`` -> ``hidden_act`` -> ``linear_fc2``), a biased patch
  embedding plus a learned square table of position embeddings resampled (bilinear, corners aligned) to each image's
  grid, and DeepStack: the blocks of ``deepstack_visual_indexes`` feed mergers of their own (normalizing the merged
  features), whose embeddings the language model adds to the image positions' hidden states after its first layers.
  The encoder returns the main merger's embeddings and then each DeepStack merger's, side by side (``[N, (1 + k) *
  out_hidden_size]``), so that they travel and are kept together.

Attention runs with ``F.scaled_dot_product_attention``, segments of the same length (images of the same grid,
windows of the same size) batched together.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.errors import UnsupportedModelError
from plinth.model_registry.layers.rotary import apply_rotary
from plinth.multimodal.vision import QWEN_ENCODER_PREFIXES, activation, load_encoder_weights

#: ``mm_config.model_type`` values this module runs
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: tensors some checkpoints carry that are derived, not learned (the rotary frequencies): skipped
_DERIVED = ("rotary_pos_emb.inv_freq",)


def is_qwen_vl(mm_config: Any) -> bool:
    """Whether ``mm_config`` is a Qwen2-VL or Qwen2.5-VL checkpoint's."""
    return getattr(mm_config, "model_type", None) in QWEN_VL_TYPES


class FloatRMSNorm(nn.Module):
    """The vision towers' RMSNorm (Qwen2.5-VL's, Pixtral's): normalized in float32, cast back to the input's dtype,
    then scaled."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _norm(qwen25: bool, size: int) -> nn.Module:
    return FloatRMSNorm(size, eps=1e-6) if qwen25 else nn.LayerNorm(size, eps=1e-6)


class _Segments:
    """A partition of the sequence ``[0, S)`` into contiguous segments, attention confined to each: the segments of
    each length gathered as one ``[n, L]`` index tensor (``None`` when one batch of equal segments covers the whole
    sequence in order: a reshape does)."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.total = sum(lengths)
        by_length: dict[int, list[int]] = {}
        start = 0
        for length in lengths:
            if length:
                by_length.setdefault(length, []).append(start)
            start += length
        if len(by_length) == 1:
            ((length, starts),) = by_length.items()
            if len(starts) * length == self.total:   # contiguous, in order: [n, L] is a view of [S]
                self.groups: list[tuple[int, torch.Tensor | None]] = [(length, None)]
                return
        self.groups = [(length, (torch.tensor(starts, dtype=torch.int64)[:, None]
                                 + torch.arange(length)).to(device))
                       for length, starts in by_length.items()]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention of ``q``, ``k``, ``v`` ``[S, heads, D]`` within each segment; ``[S, heads, D]``."""
        out = None if self.groups[0][1] is None else torch.empty_like(q)
        for length, index in self.groups:
            if index is None:
                qs, ks, vs = (t.view(-1, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
                return F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(q.shape)
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))         # [n, heads, L, D]
            out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return out


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.heads, -1).unbind(1)            # each [S, heads, D]
        q, k = (apply_rotary(t.float(), cos, sin).to(x.dtype) for t in (q, k))
        return self.proj(segments.attend(q, k, v).reshape(s, -1))


class _MLP(nn.Module):
    """Qwen2-VL's: ``fc1``, the activation, ``fc2``."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMLP(nn.Module):
    """Qwen2.5-VL's: ``down_proj(act(gate_proj(x)) * up_proj(x))``, with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Qwen3MLP(nn.Module):
    """Qwen3-VL's: ``linear_fc1``, the activation, ``linear_fc2``."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, vcfg: Any, dim: int, qwen25: bool, qwen3: bool = False):
        super().__init__()
        self.norm1 = _norm(qwen25, dim)
        self.norm2 = _norm(qwen25, dim)
        self.attn = _Attention(dim, int(vcfg.num_heads))
        if qwen3:
            self.mlp: nn.Module = _Qwen3MLP(dim, int(vcfg.intermediate_size), vcfg.hidden_act)
        elif qwen25:
            self.mlp = _GatedMLP(dim, int(vcfg.intermediate_size), vcfg.hidden_act)
        else:
            self.mlp = _MLP(dim, int(dim * vcfg.mlp_ratio), vcfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    """The Conv3d of stride = kernel, run as a matmul over the processor's flattened patches (the parameter keeps
    the Conv3d's shape, as checkpoints store it)."""

    def __init__(self, vcfg: Any, dim: int, bias: bool = False):
        super().__init__()
        t, p = int(vcfg.temporal_patch_size), int(vcfg.patch_size)
        self.proj = nn.Conv3d(int(vcfg.in_channels), dim, kernel_size=(t, p, p), stride=(t, p, p), bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        out = pixel_values.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()
        return out + self.proj.bias if self.proj.bias is not None else out


class _Merger(nn.Module):
    """Each merge group's patch features, normalized and concatenated, through ``mlp`` (Linear, GELU, Linear)."""

    def __init__(self, dim: int, out: int, merge: int, qwen25: bool):
        super().__init__()
        self.ln_q = _norm(qwen25, dim)
        width = dim * merge * merge
        self.width = width
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class _Qwen3Merger(nn.Module):
    """Qwen3-VL's merger: each merge group's patch features concatenated, a LayerNorm (over each patch's features, or
    after the concatenation: ``postshuffle``, the DeepStack mergers'), ``linear_fc1``, GELU, ``linear_fc2``."""

    def __init__(self, dim: int, out: int, merge: int, postshuffle: bool):
        super().__init__()
        self.width = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def deepstack_count(mm_config: Any) -> int:
    """How many DeepStack embeddings a Qwen3-VL image position carries (0 for the other models)."""
    if not str(getattr(mm_config, "model_type", "")).startswith("qwen3_vl"):
        return 0
    return len(getattr(mm_config.vision_config, "deepstack_visual_indexes", None) or ())


class QwenVisionEncoder(nn.Module):
    """Pixels to the language model's embeddings for Qwen2-VL and Qwen2.5-VL (see the module's docstring).

    Args:
        mm_config: the checkpoint's ``Qwen2VLConfig`` or ``Qwen2_5_VLConfig``.

    Raises:
        UnsupportedModelError: another model type, an unknown activation, or a window smaller than a merge group.
    """

    def __init__(self, mm_config: Any):
        super().__init__()
        if not is_qwen_vl(mm_config):
            raise UnsupportedModelError(f"{getattr(mm_config, 'model_type', None)!r} is not a Qwen-VL model; "
                                        f"supported: {', '.join(QWEN_VL_TYPES)}")
        vcfg = mm_config.vision_config
        self.qwen25 = mm_config.model_type == "qwen2_5_vl"
        self.qwen3 = mm_config.model_type.startswith("qwen3_vl")
        dim = int(vcfg.hidden_size if self.qwen25 or self.qwen3 else vcfg.embed_dim)
        out = int(vcfg.out_hidden_size if self.qwen25 or self.qwen3 else vcfg.hidden_size)
        heads = int(vcfg.num_heads)
        if dim % heads or (dim // heads) % 4:
            raise UnsupportedModelError(f"vision width {dim} over {heads} heads: the 2D rotary embedding needs a "
                                        "head size that is a multiple of 4")
        self.merge = int(vcfg.spatial_merge_size)
        self.patch_size = int(vcfg.patch_size)
        self.patch_embed = _PatchEmbed(vcfg, dim, bias=self.qwen3)
        self.blocks = nn.ModuleList(_Block(vcfg, dim, self.qwen25, self.qwen3) for _ in range(int(vcfg.depth)))
        self.merger: nn.Module = (_Qwen3Merger(dim, out, self.merge, False) if self.qwen3
                                  else _Merger(dim, out, self.merge, self.qwen25))
        self.out_features = out
        #: Qwen3-VL: the learned position table (``side`` x ``side``) and the DeepStack blocks and their mergers
        self.deepstack: list[int] = [int(i) for i in vcfg.deepstack_visual_indexes] if self.qwen3 else []
        if self.qwen3:
            self.pos_embed = nn.Embedding(int(vcfg.num_position_embeddings), dim)
            self.side = int(int(vcfg.num_position_embeddings) ** 0.5)
            self.deepstack_merger_list = nn.ModuleList(_Qwen3Merger(dim, out, self.merge, True)
                                                       for _ in self.deepstack)
        rope = getattr(vcfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(vcfg, "rope_theta", 10000.0)))
        half = dim // heads // 2
        #: the rotary frequencies of one axis (a quarter of a head's dimensions: angles for half, rotate-half pairs)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        self.full_blocks = frozenset(int(i) for i in vcfg.fullatt_block_indexes) if self.qwen25 else None
        #: Qwen2.5-VL: a window's side in merge groups
        self.window = int(vcfg.window_size) // self.merge // self.patch_size if self.qwen25 else 0
        if self.qwen25 and self.window < 1:
            raise UnsupportedModelError(f"vision window_size {vcfg.window_size} is smaller than a merge group of "
                                        f"{self.merge}x{self.merge} patches of {self.patch_size} pixels")

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[S, head]`` (float32) of the patches in the processor's order: each patch's row angles,
        its column angles, and the two again (rotate-half layout)."""
        m = self.merge
        positions, made = [], {}   # (images of one grid share their positions)
        for t, h, w in grids:
            if (h, w) not in made:
                rows = torch.arange(h, device=device)[:, None].expand(h, w)
                cols = torch.arange(w, device=device)[None, :].expand(h, w)
                made[h, w] = torch.stack([rows, cols], dim=-1).view(h // m, m, w // m, m, 2).transpose(1, 2).reshape(-1, 2)
            positions.append(made[h, w].repeat(t, 1) if t > 1 else made[h, w])
        pos = torch.cat(positions).float()                                               # [S, 2]
        angles = (pos[:, :, None] * self.inv_freq.to(device)).flatten(1)                 # [S, head / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Qwen3-VL: each patch's position embedding, in the processor's order: the learned ``side`` x ``side`` table
        resampled to the image's grid (bilinear, corners aligned), as merge groups, repeated over the frames."""
        m = self.merge
        # (the first side x side rows, as transformers reads the table: a count that is no square leaves some over)
        table = self.pos_embed.weight[:self.side * self.side].float().t().reshape(1, -1, self.side, self.side)
        out, made = [], {}   # (images of one grid share their resampled table)
        for t, h, w in grids:
            if (h, w) not in made:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]   # [dim, h, w]
                made[h, w] = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
            out.append(made[h, w].repeat(t, 1) if t > 1 else made[h, w])
        return torch.cat(out)

    def _windows(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's window order: the merge groups' indices (over all images) window by window, and each
        window's length in patches."""
        order, lengths, offset = [], [], 0
        win, unit = self.window, self.merge * self.merge
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            nh, nw = -(-gh // win), -(-gw // win)
            index = F.pad(torch.arange(gh * gw).view(gh, gw), (0, nw * win - gw, 0, nh * win - gh), value=-1)
            index = index.view(nh, win, nw, win).transpose(1, 2).reshape(nh * nw, win * win)
            valid = index >= 0
            frame = index[valid]
            counts = (valid.sum(1) * unit).tolist()
            for f in range(t):
                order.append(frame + offset + f * gh * gw)
                lengths.extend(counts)
            offset += t * gh * gw
        return torch.cat(order).to(device), lengths

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[N, C*T*P*P]`` (as ``Qwen2VLImageProcessor`` makes them, several images
        concatenated) and ``grid_thw`` ``[n, 3]`` (each image's frames, rows and columns of patches) ->
        ``[N // merge**2, out_hidden]`` embeddings, the images in order."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        if any(h % self.merge or w % self.merge for _, h, w in grids):
            raise ValueError(f"image grids {grids}: rows and columns must be multiples of {self.merge}")
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches for image grids {grids}")
        device = self.device
        if not grids:
            dtype = self.patch_embed.proj.weight.dtype
            return torch.empty(0, self.out_features * (1 + len(self.deepstack)), device=device, dtype=dtype)
        pixel_values = pixel_values.to(device)
        x = self.patch_embed(pixel_values)                                               # [S, dim]
        cos, sin = self._rotary(grids, device)
        frames = _Segments([h * w for t, h, w in grids for _ in range(t)], device)
        if self.qwen3:
            x = x + self._positions(grids).to(x.dtype)
            deep = []
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, frames)
                if i in self.deepstack:
                    deep.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
            return torch.cat([self.merger(x), *deep], dim=-1)
        if not self.qwen25:
            for block in self.blocks:
                x = block(x, cos, sin, frames)
            return self.merger(x)
        order, lengths = self._windows(grids, device)
        unit = self.merge * self.merge
        patches = (order[:, None] * unit + torch.arange(unit, device=device)).flatten()  # window order, patches
        x, cos, sin = x[patches], cos[patches], sin[patches]
        windows = _Segments(lengths, device)
        for i, block in enumerate(self.blocks):
            # the window order keeps each frame's patches together, so a frame is still one segment
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        return torch.empty_like(merged).index_copy_(0, order, merged)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     write: bool = True) -> None:
        """Fill the parameters from a checkpoint's ``model.visual.*`` or ``visual.*`` tensors (other names are not
        the encoder's: skipped). ``partial``: any subset (new weights in place); ``write=False``: check only.

        Raises:
            ModelLoadError: a missing tensor (unless ``partial``), an unknown one under the encoder's prefix, one of
                another shape, or a non-float one.
        """
        def target_of(name: str) -> str | None:
            prefix = next((p for p in QWEN_ENCODER_PREFIXES if name.startswith(p)), None)
            if prefix is None or name.endswith(_DERIVED):
                return None
            return name[len(prefix):]

        load_encoder_weights(self, weights, target_of, partial, write)
