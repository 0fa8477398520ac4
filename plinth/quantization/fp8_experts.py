"""FP8 experts: the stacked weights of a mixture-of-experts layer (:class:`~plinth.model_registry.layers.moe.FusedMoE`)
stored as FP8 E4M3 with their scales, half the bytes of bfloat16.

Layouts (``E`` experts, ``I`` this rank's intermediate features, ``H`` the hidden size):

- ``w13_weight`` ``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]``: the FP8 bytes (uint8);
- per output channel: ``w13_weight_scale`` ``[E, 2I]``, ``w2_weight_scale`` ``[E, H]`` (float32; a checkpoint's
  per-tensor scale is broadcast over its rows);
- per ``(bn, bk)`` block (``weight_block_size``): ``w13_weight_scale_inv`` ``[E, 2 * ceil(I / bn), ceil(H / bk)]``
  (the gate's blocks, then the up projection's) and ``w2_weight_scale_inv`` ``[E, ceil(H / bn), ceil(I / bk)]``.
  A gate whose rows end inside a block (``I`` not a multiple of ``bn``, one process only) gets one scale row
  per weight row after loading, so the stacked scales tile the stacked weight.

Sources: FP8 checkpoints (``quant_method: fp8``: ``experts.{e}.{proj}.weight`` in float8_e4m3fn with
``weight_scale`` or ``weight_scale_inv``), or float experts quantized per output channel once loaded
(``--quantization fp8``). The experts compute on each chosen expert's weights widened to the model's dtype
(:meth:`FusedMoE.expert_weight`), or, for a few tokens on a Triton device, read as FP8 by the per-slot GEMV
kernel (:func:`plinth.kernels.ops.moe_gemv`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.errors import ModelLoadError
from plinth.quantization.formats import FP8Weights
from plinth.quantization.quantizers import quantize_fp8_per_channel


@dataclasses.dataclass(frozen=True)
class ExpertScales:
    """How one stacked FP8 expert weight ``[E, N, K]`` is scaled: ``scale`` ``[E, ceil(N / rows), ceil(K / cols)]``
    with ``(rows, cols)`` features per value (per output channel: ``(1, K)``)."""

    scale: torch.Tensor
    rows: int
    cols: int

    def block(self, k: int) -> tuple[int, int] | None:
        return None if self.cols >= k and self.rows == 1 else (self.rows, self.cols)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FP8ExpertMethod:
    """The FP8 storage of a :class:`FusedMoE` layer's experts (see the module docstring).

    Args:
        from_checkpoint: the checkpoint holds FP8 experts (else float ones are quantized after loading).
        block: ``(bn, bk)`` of a checkpoint's block scales, or ``None`` (per-tensor or per-channel scales).
        static_input: the checkpoint carries per-projection ``input_scale`` tensors (read and not used:
            activations stay in the model's dtype).
        block_scale: the checkpoint's name of block scales (``weight_scale_inv``; compressed-tensors says
            ``weight_scale``).
    """

    def __init__(self, *, from_checkpoint: bool, block: tuple[int, int] | None = None, static_input: bool = False,
                 block_scale: str = "weight_scale_inv"):
        self.from_checkpoint = from_checkpoint
        self.block = block
        self.static_input = static_input
        self.block_scale = block_scale

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: replace ``layer``'s float expert weights by the checkpoint's FP8 layout (checkpoint
        sources), or keep them and record each row's ``max |w|`` over the whole checkpoint row (float sources, so
        tensor-parallel shards of ``w2`` are quantized with the unsharded scales)."""
        if not self.from_checkpoint:
            self._track_row_absmax(layer)
            return
        e, i, h = layer.num_experts, layer.intermediate_per_rank, layer.w2_weight.shape[1]
        tp = layer.tp_size
        self.loaded: dict[str, set[tuple[int, str]]] = {"fp8": set(), "float": set(), "scale": set()}
        self.float_experts: dict[str, torch.Tensor] = {}
        for which, shape in (("w13", (e, 2 * i, h)), ("w2", (e, h, i))):
            old = getattr(layer, f"{which}_weight")
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=old.device), requires_grad=False)
            param.weight_loader = functools.partial(self._load_weight, layer, which, old.dtype)  # type: ignore[attr-defined]
            param.expected_shards = old.expected_shards  # type: ignore[attr-defined]
            setattr(layer, f"{which}_weight", param)
            if self.block is None:
                rows = shape[1]
                scale = nn.Parameter(torch.empty((e, rows), dtype=torch.float32, device=old.device),
                                     requires_grad=False)
                name = f"{which}_weight_scale"
            else:
                bn, bk = self.block
                if tp > 1 and (i % bn if which == "w13" else i % bk):
                    raise ConfigError(f"fp8: the experts' {i * tp} intermediate features split {tp} ways leave {i} "
                                      f"per rank, which does not fall on the checkpoint's {bn}x{bk} scale blocks; "
                                      f"use a tensor-parallel size that does")
                blocks = (2 * _cdiv(i, bn), _cdiv(h, bk)) if which == "w13" else (_cdiv(h, bn), _cdiv(i, bk))
                scale = nn.Parameter(torch.empty((e, *blocks), dtype=torch.float32, device=old.device),
                                     requires_grad=False)
                name = f"{which}_{self.block_scale}"
            scale.weight_loader = functools.partial(self._load_scale, layer)  # type: ignore[attr-defined]
            scale.expected_shards = ()  # type: ignore[attr-defined] # checked once loaded: float experts have none
            layer.register_parameter(name, scale)
            if self.static_input:
                ignored = nn.Parameter(torch.empty(0), requires_grad=False)
                ignored.weight_loader = _ignore  # type: ignore[attr-defined]
                ignored.expected_shards = ()  # type: ignore[attr-defined]
                layer.register_parameter(f"{which}_input_scale", ignored)

    def _load_weight(self, layer: nn.Module, which: str, dtype: torch.dtype, param: nn.Parameter,
                     loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One expert projection's FP8 bytes, or its float weight where the checkpoint left the experts float (room
        for the float experts is made when the first one comes)."""
        if loaded.dtype == torch.float8_e4m3fn:
            layer.weight_loader(param, loaded.view(torch.uint8), shard_id)
            self.loaded["fp8"].add(shard_id)
            return
        if not loaded.is_floating_point():
            raise ModelLoadError(f"expected a float8_e4m3fn or floating-point expert weight, checkpoint has "
                                 f"{str(loaded.dtype).removeprefix('torch.')}")
        if which not in self.float_experts:
            self.float_experts[which] = torch.empty(param.shape, dtype=dtype, device=param.device)
        layer.weight_loader(self.float_experts[which], loaded, shard_id)
        self.loaded["float"].add(shard_id)

    def _settle(self, layer: nn.Module) -> bool:
        """Whether the checkpoint held the experts float (all of them), checking it held each FP8 one's scales.

        Raises:
            ModelLoadError: some experts float and others FP8, or an FP8 expert without its scales.
        """
        names = layer.__dict__.get("expert_checkpoint_names", {})
        floats, fp8 = self.loaded["float"], self.loaded["fp8"]
        if floats and fp8:
            a, b = sorted(floats)[0], sorted(fp8)[0]
            raise ModelLoadError(f"{names.get(a, a)} is float and {names.get(b, b)} FP8: plinth stores a layer's "
                                 f"experts alike")
        missing = sorted(fp8 - self.loaded["scale"])
        if missing:
            scale = "weight_scale" if self.block is None else self.block_scale
            raise ModelLoadError(f"checkpoint is missing tensor '{names.get(missing[0], missing[0])}.{scale}'")
        return bool(floats)

    def _load_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: tuple[int, str]) -> None:
        """One expert projection's scales: this rank's rows (and, for ``w2``'s blocks, its columns)."""
        self.loaded["scale"].add(shard_id)
        expert, role = shard_id
        if not 0 <= expert < layer.num_experts:
            raise ModelLoadError(f"expert index {expert} out of range (the layer has {layer.num_experts} experts)")
        if not loaded.is_floating_point():
            raise ModelLoadError(f"expected floating-point scales, checkpoint has {loaded.dtype}")
        i, r, tp = layer.intermediate_per_rank, layer.tp_rank, layer.tp_size
        h = layer.w2_weight.shape[1]
        dst = param.data[expert]
        if self.block is None:                       # [N] or [N, 1] per channel, or one value
            if role != "down":
                dst = dst.narrow(0, 0 if role == "gate" else i, i)
            if loaded.numel() == 1:
                dst.fill_(loaded.reshape(()).item())
                return
            full = h if role == "down" else i * tp
            if loaded.numel() != full:
                raise ModelLoadError(f"shape mismatch: expected {full} per-channel scales, checkpoint has "
                                     f"{tuple(loaded.shape)}")
            rows = loaded.reshape(-1)
            dst.copy_(rows if role == "down" else rows.narrow(0, r * i, i))
            return
        bn, bk = self.block
        if role == "down":                          # [ceil(H / bn), ceil(I_full / bk)], this rank's columns
            want = (_cdiv(h, bn), _cdiv(i * tp, bk))
            cols = dst.shape[1]
            src = _check_shape(loaded, want).narrow(1, r * i // bk if tp > 1 else 0, cols)
        else:                                       # [ceil(I_full / bn), ceil(H / bk)], this rank's rows
            want = (_cdiv(i * tp, bn), _cdiv(h, bk))
            rows = _cdiv(i, bn)
            src = _check_shape(loaded, want).narrow(0, r * i // bn if tp > 1 else 0, rows)
            dst = dst.narrow(0, 0 if role == "gate" else rows, rows)
        dst.copy_(src)

    def _track_row_absmax(self, layer: nn.Module) -> None:
        if layer.tp_size == 1 or not getattr(layer, "loads_per_expert_tensors", True):
            return
        layer.fp8_w2_row_absmax = torch.zeros(layer.num_experts, layer.w2_weight.shape[1], dtype=torch.float32)
        inner = layer.w2_weight.weight_loader

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
            layer.fp8_w2_row_absmax[shard_id[0]] = loaded.detach().abs().amax(dim=1).to(torch.float32)
            inner(param, loaded, shard_id)

        layer.w2_weight.weight_loader = load  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize float experts (per output channel), or make a checkpoint's gate/up block scales tile the
        stacked weight; then record the scales on ``layer`` (:attr:`FusedMoE.fp8_scales`)."""
        e, i, h = layer.num_experts, layer.intermediate_per_rank, layer.w2_weight.shape[1]
        scales = {}
        if self.from_checkpoint and self._settle(layer):   # float experts: the float paths run them
            for which in ("w13", "w2"):
                for kind in ("weight", "weight_scale", self.block_scale, "input_scale"):
                    layer._parameters.pop(f"{which}_{kind}", None)
                layer.register_parameter(f"{which}_weight", nn.Parameter(self.float_experts.pop(which),
                                                                         requires_grad=False))
            layer.weight_method = None
            return
        if not self.from_checkpoint:
            absmax = layer.__dict__.pop("fp8_w2_row_absmax", None)
            for which in ("w13", "w2"):
                weight = getattr(layer, f"{which}_weight")
                q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
                s = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
                for x in range(e):
                    row_absmax = absmax[x].to(weight.device) if which == "w2" and absmax is not None else None
                    fp8 = quantize_fp8_per_channel(weight[x], row_absmax)
                    q[x].copy_(fp8.weight.view(torch.uint8))
                    s[x].copy_(fp8.scale)
                setattr(layer, f"{which}_weight", nn.Parameter(q, requires_grad=False))
                layer.register_parameter(f"{which}_weight_scale", nn.Parameter(s, requires_grad=False))
                scales[which] = ExpertScales(s[..., None], 1, weight.shape[2])
        elif self.block is None:
            for which, k in (("w13", h), ("w2", i)):
                s = getattr(layer, f"{which}_weight_scale")
                scales[which] = ExpertScales(s[..., None], 1, k)
        else:
            bn, bk = self.block
            name13 = f"w13_{self.block_scale}"
            s13 = getattr(layer, name13).data
            if i % bn:      # the gate's last block row also covers the first up rows: one scale row per weight row
                rows = _cdiv(i, bn)
                per_row = torch.cat([s13[:, :rows].repeat_interleave(bn, 1)[:, :i],
                                     s13[:, rows:].repeat_interleave(bn, 1)[:, :i]], dim=1)
                setattr(layer, name13, nn.Parameter(per_row.contiguous(), requires_grad=False))
                scales["w13"] = ExpertScales(getattr(layer, name13), 1, bk)
            else:
                scales["w13"] = ExpertScales(getattr(layer, name13), bn, bk)
            scales["w2"] = ExpertScales(getattr(layer, f"w2_{self.block_scale}"), bn, bk)
        layer.fp8_scales = scales


    def widen(self, layer: nn.Module, which: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s ``[N, K]`` weight in ``dtype``."""
        return expert_fp8_weights(getattr(layer, f"{which}_weight"), layer.fp8_scales[which], expert).dequantize(dtype)

    def gemv_args(self, layer: nn.Module, which: str) -> dict[str, Any]:
        """What the experts' GEMV kernel reads ``which`` with (:func:`plinth.kernels.ops.moe_gemv`)."""
        return {"scales": layer.fp8_scales[which]}

    def widen_range(self, layer: nn.Module, which: str, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``first..last-1``'s ``[n, N, K]`` weights in ``dtype``, in one conversion: their rows stacked
        into one ``[n * N, K]`` FP8 weight (where no scale block spans two experts' rows)."""
        weight, scales = getattr(layer, f"{which}_weight")[first:last], layer.fp8_scales[which]
        n, rows, k = weight.shape
        if rows % scales.rows:
            return torch.stack([self.widen(layer, which, e, dtype) for e in range(first, last)])
        block = scales.block(k)
        s = scales.scale[first:last].reshape(-1, scales.scale.shape[2])
        stacked = FP8Weights(weight.reshape(n * rows, k).view(torch.float8_e4m3fn), s[:, 0] if block is None else s,
                             block)
        return stacked.dequantize(dtype).view(n, rows, k)


def expert_fp8_weights(weight: torch.Tensor, scales: ExpertScales, expert: int) -> FP8Weights:
    """Expert ``expert`` of a stacked FP8 weight ``[E, N, K]`` (uint8 bytes) as :class:`FP8Weights`."""
    k = weight.shape[2]
    block = scales.block(k)
    s = scales.scale[expert]
    return FP8Weights(weight[expert].view(torch.float8_e4m3fn), s[:, 0] if block is None else s, block)


def _check_shape(loaded: torch.Tensor, want: tuple[int, int]) -> torch.Tensor:
    if tuple(loaded.shape) != want:
        raise ModelLoadError(f"shape mismatch: expected block scales {want}, checkpoint has {tuple(loaded.shape)}")
    return loaded


def _ignore(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Static activation scales are read and not used."""
