"""Prompts given as embeddings (vLLM's ``prompt_embeds``): the rows the model's input embedding layer would give,
fed to its first layer in place of token embeddings.

A prompt of ``N`` embeddings runs as ``N`` positions whose token ids are a placeholder; image-like items, one per KV
block of positions (:class:`~plinth.multimodal.images.ImageItem` with ``embeds``), carry the rows to the runner, which
writes them over the placeholders' token embeddings, and give the prefix cache a digest of each block's rows: prompts
share cached blocks only where their embeddings are the same from the first row on.

An engine takes such prompts only when started with ``enable_prompt_embeds`` (``--enable-prompt-embeds``), on a model
whose forward pass takes embeddings (plinth's native decoders). Embeddings are what transformers'
``model.get_input_embeddings()(token_ids)`` gives: the scale a model applies inside that layer (Gemma's
``sqrt(hidden_size)``) is theirs already, a scale its forward pass applies after it (Granite's
``embedding_multiplier``) is applied to them as to token embeddings.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
from typing import Any

import torch

from plinth.core.scheduler import RequestRejectedError

#: the token id at the positions of a prompt given as embeddings (never read by the model: the rows replace it)
PLACEHOLDER_ID = 0

#: the dtypes prompt embeddings may come in (they are cast to the model's)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(eq=False)
class PromptEmbeds:
    """A prompt given as its input embeddings, ``[positions, hidden_size]`` (``[1, positions, hidden_size]`` too).

    Pass it where a prompt goes (``LLMEngine.add_request``, ``AsyncLLMEngine.generate``); ``LLM.generate`` takes vLLM's
    dict form, :class:`plinth.EmbedsPrompt` (``{"prompt_embeds": tensor}``)."""

    embeds: Any


def checked_embeds(value: Any, hidden_size: int, dtype: torch.dtype, param: str = "prompt_embeds") -> torch.Tensor:
    """``value`` as a ``[positions, hidden_size]`` CPU tensor in ``dtype`` (a copy: the caller's may change).

    Raises:
        RequestRejectedError: not a dense floating-point tensor, another shape, no positions, or values that are
            not finite in ``dtype``.
    """
    if not isinstance(value, torch.Tensor) or value.dtype not in FLOAT_DTYPES or value.layout != torch.strided \
            or value.is_meta:
        got = type(value).__name__ if not isinstance(value, torch.Tensor) else \
            f"a {str(value.layout).removeprefix('torch.')} tensor" if value.layout != torch.strided else \
            "a meta tensor" if value.is_meta else f"a {str(value.dtype).removeprefix('torch.')} tensor"
        raise RequestRejectedError(f"prompt embeddings must be a dense float32, float16, bfloat16 or float64 tensor, "
                                   f"got {got}", param=param)
    embeds = value.detach()
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise RequestRejectedError(f"prompt embeddings of shape {list(value.shape)}; this model takes [positions, "
                                   f"{hidden_size}]", param=param)
    if embeds.shape[0] < 1:
        raise RequestRejectedError("the prompt is empty (prompt embeddings of no positions)", param=param)
    embeds = embeds.to("cpu", dtype, copy=True).contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise RequestRejectedError(f"prompt embeddings with values that are not finite in the model's "
                                   f"{str(dtype).removeprefix('torch.')}", param=param)
    return embeds


def digest(embeds: torch.Tensor) -> str:
    """The prefix cache's key of a prompt's embeddings (``"p"`` and a digest of their values, dtype and shape)."""
    raw = embeds.contiguous().view(torch.uint8) if embeds.dtype == torch.bfloat16 else embeds.contiguous()
    h = hashlib.blake2b(raw.numpy().tobytes(), digest_size=16)
    h.update(repr((str(embeds.dtype), tuple(embeds.shape))).encode())
    return "p" + h.hexdigest()


def embeds_items(embeds: torch.Tensor, block_size: int, multimodal_rope: bool = False) -> list[Any]:
    """The items that carry a prompt's embeddings to the runner, one per KV block of positions, each keyed by its
    own rows: a block's cache key then chains the rows of every block up to it, so prompts that start with the
    same rows share those blocks (as token prompts share a prefix). ``multimodal_rope`` (Qwen2-VL's models): each
    item carries its positions' rotary positions, a text position's (its index, three times), as images carry
    theirs, so that a step may hold both."""
    import numpy as np

    from plinth.multimodal.images import ImageItem

    items = []
    for start in range(0, int(embeds.shape[0]), block_size):
        rows = embeds[start:start + block_size].clone()   # (its own storage: an item travels to worker processes)
        rope = (np.repeat(np.arange(start, start + len(rows), dtype=np.int64)[:, None], 3, axis=1)
                if multimodal_rope else None)
        items.append(ImageItem(offset=start, length=int(rows.shape[0]), pixel_values=torch.empty(0),
                               key=digest(rows), rope=rope, embeds=rows, prompt=True))
    return items


def decode_base64(text: Any, where: str = "prompt_embeds") -> torch.Tensor:
    """A tensor sent as base64 text of ``torch.save``'s bytes (vLLM's wire form). The bytes are read with
    ``torch.load(weights_only=True)``: tensors and plain containers only, never code.

    Raises:
        RequestRejectedError: not base64 text, not a file ``torch.save`` wrote, or something other than a tensor.
    """
    if not isinstance(text, str) or not text:
        raise RequestRejectedError(f"{where} must be base64 text of a tensor saved with torch.save", param=where)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestRejectedError(f"{where} is not valid base64 text", param=where) from None
    _check_stored(raw, where)
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:   # a corrupt file, or one holding more than tensors (refused by weights_only)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RequestRejectedError(f"{where} could not be read as a tensor saved with torch.save: {reason[:200]}",
                                   param=where) from None
    if not isinstance(value, torch.Tensor):
        raise RequestRejectedError(f"{where} holds a {type(value).__name__}, not a tensor", param=where)
    return value


def _check_stored(raw: bytes, where: str) -> None:
    """Refuse a ``torch.save`` archive whose entries are compressed: ``torch.save`` stores them as they are, and a
    compressed one could unpack to far more memory than the request's bytes."""
    import zipfile

    if not zipfile.is_zipfile(io.BytesIO(raw)):
        return   # (torch.save's legacy format: storages written as they are; torch.load refuses anything else)
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise RequestRejectedError(f"{where} is not a readable torch.save archive: {exc}", param=where) from None
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries) or sum(e.file_size for e in entries) > len(raw):
        raise RequestRejectedError(f"{where} holds compressed entries; send the bytes torch.save writes",
                                   param=where)
