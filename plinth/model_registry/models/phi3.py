"""Phi-3 (and models that reuse its layout, such as Phi-4-mini): Llama's blocks with the checkpoint's
projections already fused (``qkv_proj``, ``gate_up_proj``) and RoPE over ``partial_rotary_factor`` of each
head. The fused checkpoint tensors are split into q/k/v and gate/up as they load, so tensor parallelism
shards them as it shards Llama's. ``longrope`` RoPE scaling (the 128k-context models, Phi-3.5, Phi-4-mini) takes
its long factors when the engine's context exceeds the original one (see
:func:`~plinth.model_registry.layers.rotary.compute_inv_freq`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from plinth.errors import ModelLoadError
from plinth.model_registry.models.decoder import DecoderForCausalLM, head_dim_of


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 with fused checkpoint projections."""

    config_biases: ClassVar[tuple[str, ...]] = ()

    partial_rotary: ClassVar[bool] = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.ctx.hf_config
        d = head_dim_of(cfg)
        q = cfg.num_attention_heads * d
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * d
        for name, tensor in weights:
            fused = ".self_attn.qkv_proj." in name or ".mlp.gate_up_proj." in name
            if not fused:
                yield name, tensor
                continue
            if ".qkv_proj." in name:
                sizes, parts, old = [q, kv, kv], (".q_proj.", ".k_proj.", ".v_proj."), ".qkv_proj."
            else:
                rows = 2 * cfg.intermediate_size
                sizes, parts, old = [rows // 2, rows // 2], (".gate_proj.", ".up_proj."), ".gate_up_proj."
            for part, piece in zip(parts, _split_rows(name, tensor, sizes), strict=True):
                yield name.replace(old, part), piece


_SPLITTABLE = (".weight", ".bias", ".weight_scale", ".weight_scale_inv", ".input_scale")


def _split_rows(name: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """A fused tensor's parts: rows split by ``sizes`` (a weight, a bias, per-channel scales), by ``sizes`` over
    the block height (FP8 block scales), or the same scalar for each part (per-tensor scales)."""
    total = sum(sizes)
    if not name.endswith(_SPLITTABLE):
        raise ModelLoadError(f"tensor {name!r}: Phi-3's fused projections load from float and FP8 checkpoints "
                             f"(a packed quantized layout of them is not supported)")
    if tensor.numel() == 1:
        return [tensor] * len(sizes)
    rows = tensor.shape[0]
    if rows != total and (rows == 0 or total % rows or any(s % (total // rows) for s in sizes)):
        raise ModelLoadError(f"tensor {name!r}: {rows} rows do not split into the fused projection's {sizes}")
    block = total // rows
    return list(tensor.split([s // block for s in sizes], dim=0))
