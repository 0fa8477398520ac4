"""bitsandbytes checkpoints (``quantization_config.quant_method = "bitsandbytes"``), read by the loader.

Such a checkpoint (``save_pretrained`` of a transformers model loaded with ``BitsAndBytesConfig``) stores each
quantized linear layer's weight in one of two layouts; layers it skipped (``llm_int8_skip_modules``, the LM head)
keep float weights. The loader widens the quantized weights to the model's dtype while it reads them (exactly as
bitsandbytes' own dequantization computes them, in float32 then rounded once), so every model, kernel and
parallel layout runs them as a float checkpoint of the same values, and ``--quantization`` methods that quantize
float weights (``int4``, ``fp8``, ...) may quantize them again. Memory is the model dtype's, not the file's.

4-bit (``load_in_4bit``; ``bnb_4bit_quant_type`` ``nf4`` or ``fp4``), per layer ``X`` with an ``[N, K]`` weight:

- ``X.weight``: ``ceil(N K / 2)`` bytes (``bnb_4bit_quant_storage`` may type them as another dtype; the bytes are
  what counts): the weight's elements in row-major order, two per byte, the first in the high nibble;
- ``X.weight.quant_map``: float32 ``[16]``, the value of each 4-bit code (the NF4 or FP4 table);
- ``X.weight.absmax``: one scale per ``blocksize`` consecutive elements: float32, or with double quantization
  (``bnb_4bit_use_double_quant``) uint8 codes into ``X.weight.nested_quant_map`` (float32 ``[256]``), each
  ``nested_blocksize`` consecutive codes scaled by one float32 of ``X.weight.nested_absmax``, plus
  ``nested_offset``;
- ``X.weight.quant_state.bitsandbytes__<quant_type>``: uint8 bytes of a JSON object with ``quant_type``,
  ``blocksize``, ``shape``, ``dtype`` and, with double quantization, ``nested_blocksize``, ``nested_offset`` and
  ``nested_dtype``.

``w = quant_map[code] * absmax[i // blocksize]`` for element ``i``, where a doubly quantized
``absmax[j] = nested_quant_map[code_j] * nested_absmax[j // nested_blocksize] + nested_offset``.

8-bit (``load_in_8bit``, LLM.int8()): ``X.weight`` int8 ``[N, K]``, ``X.SCB`` float32 ``[N]`` (each row's absolute
maximum), ``X.weight_format`` (0: row-major, the only layout written); ``w = weight * SCB / 127``. (bitsandbytes'
own matmul also rounds the activations to 8 bits outside the outlier columns; here they stay as they are.)

Only the JSON is parsed from the quantization state: nothing in the file is executed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from plinth.errors import ModelLoadError

BNB = "bitsandbytes"
_STATE = ".weight.quant_state.bitsandbytes__"
_PARTS_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_INT8_SCALE = 1.0 / 127.0


def is_bnb(quant_config: dict[str, Any] | None) -> bool:
    return quant_config is not None and str(quant_config.get("quant_method", "")).lower() == BNB


def quantized_layers(names: Iterable[str]) -> tuple[set[str], set[str]]:
    """``(4-bit, 8-bit)``: the layer prefixes (``X`` of ``X.weight``) whose weights a checkpoint with these tensor
    names stores quantized: those with a quantization state (4-bit) or row scales ``X.SCB`` (8-bit)."""
    four, eight = set(), set()
    for name in names:
        if _STATE in name:
            four.add(name.split(_STATE)[0])
        elif name.endswith(".SCB"):
            eight.add(name.removesuffix(".SCB"))
    return four, eight


#: bitsandbytes' largest block (its kernels take 32-4096 values per scale); a state naming more is refused, so
#: that memory stays bounded by the layer whatever the file says
MAX_BLOCKSIZE = 4096
#: a real quantization state is a few hundred bytes of JSON
_MAX_STATE_BYTES = 1 << 16


def _state(tensor: torch.Tensor, layer: str) -> dict[str, Any]:
    if tensor.numel() > _MAX_STATE_BYTES:
        raise ModelLoadError(f"layer {layer!r}: its bitsandbytes quantization state is {tensor.numel()} bytes "
                             f"(a few hundred expected)")
    try:
        state = json.loads(bytes(tensor.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"layer {layer!r}: its bitsandbytes quantization state is not JSON ({exc})") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"layer {layer!r}: its bitsandbytes quantization state is not a JSON object")
    return state


def _positive_int(state: dict[str, Any], key: str, layer: str, most: int | None = None) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (most is not None and value > most):
        raise ModelLoadError(f"layer {layer!r}: bitsandbytes quantization state has {key}={value!r} "
                             f"(a positive integer{f' of at most {most}' if most else ''} expected)")
    return value


def _count(tensor: torch.Tensor, want: int, what: str, layer: str) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if flat.numel() != want:
        raise ModelLoadError(f"layer {layer!r}: bitsandbytes {what} has {flat.numel()} values, expected {want}")
    return flat


def dequantize_4bit(parts: dict[str, torch.Tensor], layer: str, dtype: torch.dtype,
                    device: torch.device, state: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``[N, K]`` weight of one 4-bit layer from its tensors (keys: ``weight``, ``state`` (the JSON bytes),
    ``absmax``, ``quant_map`` and, doubly quantized, ``nested_absmax`` and ``nested_quant_map``); ``state``: the
    JSON already parsed, if it was."""
    if state is None:
        state = _state(parts["state"], layer)
    quant_type = state.get("quant_type")
    if quant_type not in ("nf4", "fp4"):
        raise ModelLoadError(f"layer {layer!r}: bitsandbytes 4-bit type {quant_type!r} is not supported "
                             f"(nf4 and fp4 are)")
    shape = state.get("shape")
    if not (isinstance(shape, list) and len(shape) >= 1
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise ModelLoadError(f"layer {layer!r}: bitsandbytes quantization state has shape={shape!r}")
    blocksize = _positive_int(state, "blocksize", layer, MAX_BLOCKSIZE)
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    packed = parts["weight"].contiguous().reshape(-1).view(torch.uint8)
    if packed.numel() != -(-n // 2):
        raise ModelLoadError(f"layer {layer!r}: bitsandbytes packed weight has {packed.numel()} bytes, expected "
                             f"{-(-n // 2)} for shape {shape}")
    code = _count(parts["quant_map"], 16, "quant_map", layer).to(device, torch.float32)
    nested = "nested_blocksize" in state
    absmax = _count(parts["absmax"], blocks, "absmax", layer).to(device)
    if nested:
        for key in ("nested_absmax", "nested_quant_map"):
            if key not in parts:
                raise ModelLoadError(f"checkpoint is missing tensor {layer + '.weight.' + key!r} (a doubly "
                                     f"quantized bitsandbytes layer)")
        nested_blocksize = _positive_int(state, "nested_blocksize", layer, MAX_BLOCKSIZE)
        offset = state.get("nested_offset", 0.0)
        try:
            finite = not isinstance(offset, bool) and isinstance(offset, (int, float)) and math.isfinite(float(offset))
        except OverflowError:   # an integer too large for a float
            finite = False
        if not finite:
            raise ModelLoadError(f"layer {layer!r}: bitsandbytes nested_offset={str(offset)[:40]!r}")
        if absmax.dtype != torch.uint8:
            raise ModelLoadError(f"layer {layer!r}: a doubly quantized absmax must be uint8, not {absmax.dtype}")
        nested_code = _count(parts["nested_quant_map"], 256, "nested_quant_map", layer).to(device, torch.float32)
        nested_absmax = _count(parts["nested_absmax"], -(-blocks // nested_blocksize), "nested_absmax",
                               layer).to(device, torch.float32)
        group = torch.arange(blocks, device=device) // nested_blocksize
        scales = nested_code[absmax.long()] * nested_absmax[group] + float(offset)
    else:
        if not absmax.dtype.is_floating_point:
            raise ModelLoadError(f"layer {layer!r}: bitsandbytes absmax must be float without double "
                                 f"quantization, not {absmax.dtype}")
        scales = absmax.to(torch.float32)
    # each byte's two values at once (high nibble first): a 256-row table, one gather per byte
    pairs = torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)          # [256, 2]
    values = pairs[packed.to(device).long()].reshape(-1)[:n]                            # [n]
    full = n // blocksize * blocksize
    out = torch.empty_like(values)
    out[:full] = (values[:full].view(-1, blocksize) * scales[:full // blocksize, None]).view(-1)
    out[full:] = values[full:] * scales[-1]    # a last, shorter block
    return out.reshape(shape).to(dtype)


def dequantize_8bit(weight: torch.Tensor, scb: torch.Tensor, layer: str, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The weight of one LLM.int8() layer: ``weight * SCB / 127`` per row."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ModelLoadError(f"layer {layer!r}: a bitsandbytes 8-bit weight must be a 2-D int8 tensor, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
    rows = _count(scb, weight.shape[0], "SCB (row scales)", layer).to(device, torch.float32)
    return (weight.to(device, torch.float32) * rows[:, None] * _INT8_SCALE).to(dtype)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], names: Iterable[str], dtype: torch.dtype,
                        device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each bitsandbytes-quantized layer's tensors replaced by its ``X.weight`` in ``dtype``
    (computed on ``device``); ``names``: every tensor name of the checkpoint (to know the quantized layers before
    their tensors arrive, in whatever order and shard)."""
    four, eight = quantized_layers(names)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    states: dict[str, dict[str, Any]] = {}   # each 4-bit layer's state, parsed once when it arrives
    for name, tensor in weights:
        layer, part = _owner(name, four, eight)
        if layer is None:
            yield name, tensor
            continue
        if part == "weight_format":
            fmt = tensor.reshape(-1)[0].item() if tensor.numel() == 1 else None
            if fmt not in (0, "row"):
                raise ModelLoadError(f"layer {layer!r}: bitsandbytes weight_format {fmt!r} is not supported "
                                     f"(0, row-major, is)")
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if part == "state":
            states[layer] = _state(tensor, layer)
        if all(p in parts for p in _needed(layer, eight, states)):
            del pending[layer]
            yield f"{layer}.weight", (dequantize_8bit(parts["weight"], parts["SCB"], layer, dtype, device)
                                      if layer in eight else
                                      dequantize_4bit(parts, layer, dtype, device, states.pop(layer)))
    for layer, parts in pending.items():
        missing = next(p for p in _needed(layer, eight, states) if p not in parts)
        suffix = {"weight": ".weight", "SCB": ".SCB", "state": _STATE + "<type>"}.get(missing, f".weight.{missing}")
        raise ModelLoadError(f"checkpoint is missing tensor {layer + suffix!r} of a bitsandbytes-quantized layer")


def _needed(layer: str, eight: set[str], states: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """The tensors a quantized layer needs (a 4-bit layer's state says whether the nested ones are among them)."""
    if layer in eight:
        return ("weight", "SCB")
    nested = "nested_blocksize" in states.get(layer, {})
    return ("weight", "state", "absmax", "quant_map") + (("nested_absmax", "nested_quant_map") if nested else ())


def _owner(name: str, four: set[str], eight: set[str]) -> tuple[str | None, str]:
    """``(layer, part)`` for a tensor of a quantized layer, ``(None, "")`` for any other tensor."""
    if _STATE in name:
        return name.split(_STATE)[0], "state"
    if name.endswith(".weight"):
        layer = name.removesuffix(".weight")
        if layer in four or layer in eight:
            return layer, "weight"
    for part in _PARTS_4BIT:
        if name.endswith(f".weight.{part}"):
            layer = name.removesuffix(f".weight.{part}")
            if layer in four:
                return layer, part
    for part in ("SCB", "weight_format"):
        if name.endswith(f".{part}"):
            layer = name.removesuffix(f".{part}")
            if layer in eight:
                return layer, part
    return None, ""
