"""Rotary position embeddings (rotate-half layout) with default, linear, llama3 and YaRN frequencies.

The inverse frequencies are a non-persistent float32 buffer; cos/sin are computed from the
positions of each step (no table sized by the maximum context).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.kernels import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE parameters of a config, as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads ``rope_parameters`` (transformers >= 5; where it is keyed by layer type, as Gemma 3's, the entry of
    ``layer_type``) or the older ``rope_theta`` + ``rope_scaling`` (and ``rope_local_base_freq`` for sliding
    layers, as older Gemma 3 configs have it).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    elif layer_type == "sliding_attention" and local_base is not None:
        out = {"rope_type": "default", "rope_theta": local_base}
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    if out["rope_type"] == "mrope":   # Qwen2-VL's multimodal RoPE in older configs: default frequencies, by section
        out["rope_type"] = "default"
    theta = out["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
        raise ModelLoadError(f"config: rope_theta must be a positive number, got {theta!r}")
    return out


def context_length(hf_config: Any) -> int:
    """The longest context a config supports, as vLLM derives it: ``max_position_embeddings`` (2048 without
    one) times the RoPE scaling ``factor`` for ``linear`` and ``dynamic`` scaling, and YaRN's
    ``original_max_position_embeddings`` times its factor (``llama3`` and ``longrope`` configs already state the
    extended length; so do Gemma 3's, whose ``linear`` factor is not applied again)."""
    base = getattr(hf_config, "max_position_embeddings", None) or 2048
    if str(getattr(hf_config, "model_type", "")).startswith("gemma3"):
        return base
    try:
        params = rope_parameters(hf_config)
    except ModelLoadError:
        return base   # the model's load names the bad parameter
    factor = params.get("factor")
    if params["rope_type"] not in ("linear", "dynamic", "yarn") or isinstance(factor, bool) \
            or not isinstance(factor, int | float) or not 1 < factor < math.inf:
        return base
    if params["rope_type"] == "yarn":
        original = params.get("original_max_position_embeddings")
        base = original if isinstance(original, int) and not isinstance(original, bool) and original > 0 else base
    return int(base * factor)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))  # [dim/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_between, smoothed, scaled)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` times the original: ``0.1 * m * ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / orig
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(base: float, dim: int, p: dict[str, Any], max_positions: int,
                       context: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's ``longrope``: per-frequency divisors, ``long_factor`` when the engine's context
    (``max_model_len``, else the config's ``max_position_embeddings``) exceeds the original one, else
    ``short_factor``, fixed for the run as llama.cpp chooses them (transformers switches per forward pass on the
    longest position in it, which makes a sequence's result depend on its batch)."""
    orig = p.get("original_max_position_embeddings")
    if not orig or "long_factor" not in p or "short_factor" not in p:
        raise UnsupportedModelError("longrope RoPE scaling needs original_max_position_embeddings, long_factor "
                                    "and short_factor")
    use_long = (context or max_positions) > orig
    factors = torch.tensor(p["long_factor"] if use_long else p["short_factor"], dtype=torch.float32)
    if factors.shape != (dim // 2,):
        raise UnsupportedModelError(f"longrope: {factors.numel()} factors for {dim // 2} rotary frequencies")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        # the config's factor where it gives one, else the context's growth (Phi-3 raises max_position_embeddings)
        factor = p.get("factor") or max_positions / orig
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (factors * base ** exponents), float(attention_factor)


def compute_inv_freq(params: dict[str, Any], rotary_dim: int, max_positions: int,
                     context: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32) and the cos/sin scaling factor (``context``: the
    engine's ``max_model_len``, which picks ``longrope``'s factors).

    Raises:
        UnsupportedModelError: an unsupported ``rope_type``.
    """
    rope_type, base = params["rope_type"], float(params["rope_theta"])
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(base, rotary_dim), params), 1.0
    if rope_type == "dynamic":   # NTK-aware: the base raised for the run's context, fixed for the run
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 <= factor < math.inf:
            raise UnsupportedModelError(f"dynamic RoPE scaling needs a factor of at least 1, got {factor!r}")
        length = max(context or max_positions, max_positions)   # within the config's length: the default RoPE
        scaled = base * ((factor * length / max_positions) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(scaled, rotary_dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, params, max_positions)
    if rope_type in ("longrope", "su"):
        return _longrope_inv_freq(base, rotary_dim, params, max_positions, context)
    raise UnsupportedModelError(
        f"RoPE scaling type {rope_type!r} is not supported by plinth's native models; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding over the first ``rotary_dim`` features of each head.

    Args:
        head_size: features per head.
        params: from :func:`rope_parameters`.
        max_positions: the config's ``max_position_embeddings`` (used by YaRN's default factor).
        rotary_dim: rotated features (default: all of them).
        context: the engine's ``max_model_len`` (``longrope`` picks its factors by it).
    """

    def __init__(self, head_size: int, params: dict[str, Any], max_positions: int, rotary_dim: int | None = None,
                 context: int | None = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        self.params = dict(params)
        self.max_positions = max_positions
        self.context = context
        target = torch.empty(0).device   # the build's default device (meta while a model is built to load into)
        with torch.device("cpu"):         # arithmetic on meta tensors would import torch._dynamo (~1 s per start)
            inv_freq, self.attention_scaling = compute_inv_freq(self.params, self.rotary_dim, max_positions, context)
        self.register_buffer("inv_freq", inv_freq.to(device=target, dtype=torch.float32), persistent=False)
        #: multimodal RoPE (Qwen2-VL): which of a position's (time, height, width) components each frequency
        #: takes, ``[rotary_dim / 2]``; ``None`` for a plain RoPE. Text positions have three equal components,
        #: so they rotate as a plain RoPE does; only image positions take :meth:`cos_sin_3d`.
        self.mrope_components: list[int] | None = None
        sections = self.params.get("mrope_section")
        if sections is not None:
            half = self.rotary_dim // 2
            if not isinstance(sections, list | tuple) or sum(int(n) for n in sections) != half:
                raise UnsupportedModelError(f"mrope_section {sections!r} must split the {half} rotary frequencies "
                                            "of a head")
            if self.params.get("mrope_interleaved"):   # Qwen3-VL: (t, h, w, t, h, w, ...), time past the others
                h, w = int(sections[1]), int(sections[2])
                self.mrope_components = [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
                                         for j in range(half)]
            else:
                self.mrope_components = [i % 3 for i, n in enumerate(sections) for _ in range(int(n))]

    def init_buffers(self) -> None:
        """Recompute the frequencies (after the model was materialised from the meta device)."""
        inv_freq, _ = compute_inv_freq(self.params, self.rotary_dim, self.max_positions, self.context)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, rotary_dim]`` for ``positions`` ``[T]``, in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                               # [T, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def cos_sin_3d(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE's ``cos, sin`` ``[K, rotary_dim]`` for positions ``[K, 3]`` (time, height, width): each
        frequency rotates by the component its section names."""
        assert self.mrope_components is not None, "a plain RoPE has no 3-component positions"
        comp = torch.tensor(self.mrope_components, device=positions.device)                  # [R / 2]
        picked = positions.to(torch.float32).index_select(1, comp)                            # [K, R / 2]
        freqs = picked * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def deinterleave_pairs(x: torch.Tensor, rot_dim: int | None = None) -> torch.Tensor:
    """The first ``rot_dim`` features (all by default) of ``x`` ``[..., D]`` from pairs ``(x0, y0, x1, y1, ...)``, as
    an interleaved (GPT-J style) RoPE rotates them, to ``(x0, x1, ..., y0, y1, ...)``, the layout of a rotate-half
    RoPE; the rest passes through. Queries and keys permuted alike keep their products."""
    r = x.shape[-1] if rot_dim is None else rot_dim
    rot = x[..., :r].unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` with ``cos``/``sin`` ``[T, R]`` (R <= D; the rest passes through)."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` rotated: in place by the fused kernel where it runs,
    else as new tensors (:func:`apply_rotary`)."""
    if ops.fused_ops_enabled(q):
        ops.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
