"""gpt-oss (``GptOssForCausalLM``): attention with per-head sinks, alternating sliding and full layers, and a
mixture of experts with biases and a clamped SwiGLU.

- Attention: biased q/k/v/o projections; each head's learned sink logit (``self_attn.sinks``) joins its
  softmax's denominator (the backend applies it: ``AttentionBackend.supports_sinks``); ``layer_types``
  alternates sliding-window and full layers; YaRN RoPE.
- MoE: a biased router (``mlp.router``, top-k logits, softmax over the k); each expert's fused ``gate_up_proj``
  ``[E, H, 2I]`` holds gate and up columns interleaved, ``down_proj`` ``[E, I, H]``, each with a bias;
  ``h = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``.
- Checkpoints: bfloat16 experts, or the released MXFP4 ones (``quantization_config.quant_method = "mxfp4"``:
  ``*_blocks`` and ``*_scales`` per expert tensor, OCP microscaling with FP4 E2M1 values and E8M0 scales over
  32 values), which are widened to the model's dtype while loading (the experts then take bfloat16 memory).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.errors import ModelLoadError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.layers.linear import ReplicatedLinear
from plinth.model_registry.layers.moe import FusedMoE
from plinth.model_registry.models.decoder import AttentionOptions, DecoderForCausalLM

#: the checkpoint format whose expert tensors this model reads itself (``quantization_config.quant_method``)
MXFP4 = "mxfp4"
#: FP4 E2M1 codes 0..15 (sign bit 3, two exponent bits, one mantissa bit)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)"
                            r"(?P<part>_bias|_blocks|_scales)?$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 ``blocks`` ``[..., G, 16]`` (uint8, two FP4 E2M1 codes a byte, the low nibble first) and ``scales``
    ``[..., G]`` (uint8 E8M0: ``2 ** (s - 127)``) -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                             f"(expected blocks [..., G, 16] and scales [..., G])")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales, flat_out = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1]), out.view(-1, out.shape[-1])
    for row in range(flat_blocks.shape[0]):   # one expert (or row) at a time: the float32 values stay small
        codes = torch.stack((flat_blocks[row] & 0x0F, flat_blocks[row] >> 4), dim=-1).flatten(-2).long()  # [G, 32]
        values = torch.ldexp(lut[codes], flat_scales[row].to(torch.int32)[:, None] - 127)
        flat_out[row] = values.flatten()
    return out


class GptOssExperts(FusedMoE):
    """gpt-oss's experts: :class:`FusedMoE` with biases and the clamped SwiGLU, loaded from the checkpoint's
    stacked tensors (one per projection for all experts) instead of per-expert ones."""

    loads_per_expert_tensors: ClassVar[bool] = False

    def __init__(self, ctx: ModelContext):
        cfg = ctx.hf_config
        self.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        self.limit = float(getattr(cfg, "swiglu_limit", 7.0))
        super().__init__(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                         renormalize=True, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size, bias=True,
                         activation=self._clamped_swiglu)
        for p in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias):
            p.weight_loader = self.load_stacked  # type: ignore[attr-defined]
            p.__dict__.pop("expected_shards", None)

    def _clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor for every expert, as transformers lays it out: ``gate_up_proj`` ``[E, H, 2I]``
        (gate and up columns interleaved) and its bias ``[E, 2I]``, ``down_proj`` ``[E, I, H]`` and its bias
        ``[E, H]``; this rank keeps its share of ``I``."""
        e, i, r = self.num_experts, self.intermediate_per_rank, self.tp_rank
        hidden = self.w2_weight.shape[1]
        full = i * self.tp_size
        want = {id(self.w13_weight): (e, hidden, 2 * full), id(self.w13_bias): (e, 2 * full),
                id(self.w2_weight): (e, full, hidden), id(self.w2_bias): (e, hidden)}[id(param)]
        if tuple(loaded.shape) != want:
            raise ModelLoadError(f"shape mismatch: expected {want}, checkpoint has {tuple(loaded.shape)}")
        if param is self.w2_bias:
            param.data.copy_(loaded)
        elif param is self.w2_weight:                       # [E, I, H] -> [E, H, I/tp]
            param.data.copy_(loaded.narrow(1, r * i, i).transpose(1, 2))
        else:                                               # gate columns even, up columns odd
            gate, up = loaded[..., 0::2], loaded[..., 1::2]
            mine = torch.cat((gate.narrow(-1, r * i, i), up.narrow(-1, r * i, i)), dim=-1)   # [E, (H,) 2I/tp]
            param.data.copy_(mine.transpose(1, 2) if param is self.w13_weight else mine)


class GptOssMoE(nn.Module):
    """The router (``router``, biased) and the experts (``experts``)."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        cfg = ctx.hf_config
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.experts(x, self.router(x))


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss-20b / gpt-oss-120b. Tensor parallelism splits the heads (and their sinks) and each expert's
    intermediate features; pipeline parallelism works as for every decoder."""

    #: ``quantization_config.quant_method`` values whose tensors the model reads itself (no quantization plugin)
    reads_checkpoint_formats: ClassVar[tuple[str, ...]] = (MXFP4,)
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    def attention_options(self, cfg: Any) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", True))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, ctx: ModelContext, layer_idx: int) -> nn.Module:
        return GptOssMoE(ctx)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        m = _EXPERT_TENSOR.match(name)
        if m is not None:
            param = {"gate_up_proj": "w13", "down_proj": "w2"}[m["name"]]
            return f"{m['prefix']}.{param}_{'bias' if m['part'] == '_bias' else 'weight'}", None
        return super().map_weight_name(name)

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        for ours, theirs in (("w13_weight", "gate_up_proj"), ("w13_bias", "gate_up_proj_bias"),
                             ("w2_weight", "down_proj"), ("w2_bias", "down_proj_bias")):
            if param_name.endswith(f".experts.{ours}"):
                return param_name.removesuffix(ours) + theirs
        return super().checkpoint_name(param_name, shard_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.ctx.pp_size > 1:   # only this stage's experts are widened
            weights = ((name, t) for name, t in weights if self._on_this_stage(name))
        super().load_weights(self._widened(weights))

    def _widened(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each MXFP4 pair (``X_blocks``, ``X_scales``) replaced by ``X`` in the
        model's dtype and transformers' layout (``[E, in, out]``)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            m = _EXPERT_TENSOR.match(name)
            if m is None or m["part"] not in ("_blocks", "_scales"):
                yield name, tensor
                continue
            base = name.removesuffix(m["part"])
            parts = pending.setdefault(base, {})
            parts[m["part"]] = tensor
            if len(parts) == 2:
                del pending[base]
                try:
                    # widened on the model's device (an accelerator does it in milliseconds)
                    values = dequantize_mxfp4(parts["_blocks"].to(self.ctx.device), parts["_scales"].to(self.ctx.device),
                                              self.ctx.dtype)
                except ModelLoadError as exc:
                    raise ModelLoadError(f"tensor {base!r}: {exc}") from exc
                yield base, values.transpose(1, 2)           # [E, out, in] -> [E, in, out]
        if pending:
            base, parts = next(iter(pending.items()))
            missing = "_scales" if "_blocks" in parts else "_blocks"
            raise ModelLoadError(f"checkpoint is missing tensor {base + missing!r} (MXFP4 experts come as "
                                 f"_blocks and _scales pairs)")

