"""Dequantizing GGUF tensors at load time, fast for the block types small models ship in.

``Q4_0``, ``Q4_1`` and ``Q8_0`` (ggml's published block layouts; see
:mod:`plinth.quantization.kernels.gguf_blocks`) are expanded into one preallocated float32 buffer with
in-place torch ops: no concatenations or per-element temporaries, a tenth of the time of the generic
per-type functions on a 135M-parameter model; where the native CPU library is built
(:func:`plinth.kernels.cpu_native.gguf_dequantize_into`), its kernel does the same arithmetic several times
faster still. :func:`dequantize_group` expands the blocks of many
tensors of one type in one go: a few large torch ops instead of seven small ones per tensor, which
matters on a busy machine, where every parallel region waits for a descheduled thread. The arithmetic is the reference's, in float32 and in the
same order (``d * q + m``, ``d * (q - 8)``, ``d * q``), then rounded once to the target dtype, so the
result is bit-identical to ``gguf.quants.dequantize`` followed by ``.to(dtype)``. Other block types go
through the generic torch functions, and types without one through ``gguf.quants``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30  # ggml type ids, fixed by the file format
_BLOCK = 32


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """A float16 field at byte ``start`` of every block -> ``[rows, n_blocks, 1]`` float32."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles_into(out: torch.Tensor, qs: torch.Tensor) -> None:
    """``[rows, n_blocks, 16]`` bytes -> ``out`` ``[rows, n_blocks, 32]``: low nibbles are elements 0-15."""
    out[..., :16] = qs & 0xF
    out[..., 16:] = qs >> 4


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _nibbles_into(out, blocks[..., 2:18])
    return out.sub_(8).mul_(_scale(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _nibbles_into(out, blocks[..., 4:20])
    return out.mul_(_scale(blocks, 0)).add_(_scale(blocks, 2))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(blocks[..., 2:34].contiguous().view(torch.int8))
    return out.mul_(_scale(blocks, 0))


_FAST = {Q4_0: (18, _q4_0), Q4_1: (20, _q4_1), Q8_0: (34, _q8_0)}


def _storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (torch's own count), or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None


class Scratch:
    """float32 buffers that :func:`dequantize_group` expands blocks into, reused from one group to the next
    once nothing else holds a view of them (two, since a reader still holds the last tensor of a group while
    it asks for the next). A fresh buffer's first touch costs more than the expansion itself on machines with
    slow page faults; one that is still referenced by a tensor is never reused (a new one is made). A reader
    that keeps only a result's ``untyped_storage()`` and no tensor is not seen: copy the values instead."""

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.Tensor, int]] = []   # (buffer, its storage count when free)

    def take(self, n: int) -> torch.Tensor:
        """``n`` float32 values (uninitialized) of a buffer nothing else uses."""
        for i, (buf, free) in enumerate(self._buffers):
            if buf.numel() >= n and _storage_uses(buf) == free:
                self._buffers.append(self._buffers.pop(i))   # most recently used last
                return buf[:n]
        buf = torch.empty(n, dtype=torch.float32)
        free = _storage_uses(buf)
        if free is not None:
            self._buffers = [*self._buffers[-1:], (buf, free)]
        return buf


def dequantize_group(items: list[tuple[np.ndarray, Any, tuple[int, ...]]], dtype: torch.dtype,
                     scratch: Scratch | None = None) -> list[torch.Tensor]:
    """Several tensors, as :func:`dequantize_tensor` would give each: those of one fast block type are
    expanded together (their blocks concatenated), the others one by one. The results of one type are
    views of one buffer, which lives as long as any of them.

    Args:
        items: ``(data, ggml_type, shape)`` per tensor, as for :func:`dequantize_tensor`.
        dtype: the results' dtype.
        scratch: where the float32 expansions go (float32 results are views of its buffers, which it
            reuses only once they are no longer referenced); None: a new buffer per type.
    """
    out: list[torch.Tensor | None] = [None] * len(items)
    by_type: dict[int, list[int]] = {}
    for i, (_, ggml_type, _) in enumerate(items):
        if int(ggml_type) in _FAST:
            by_type.setdefault(int(ggml_type), []).append(i)
        else:
            out[i] = dequantize_tensor(*items[i], dtype)
    for kind, members in by_type.items():
        type_size, expand = _FAST[kind]
        n_values = sum(items[i][0].size for i in members) // type_size * _BLOCK
        buf = scratch.take(n_values) if scratch is not None else torch.empty(n_values, dtype=torch.float32)
        if not _native_expand(kind, [items[i][0] for i in members], buf):
            raw = np.concatenate([items[i][0].reshape(-1) for i in members])  # all blocks, one after another
            expand(torch.from_numpy(raw).reshape(1, -1, type_size), buf.view(1, -1, _BLOCK))
        values = buf.to(dtype)   # [n_elements]
        del buf
        start = 0
        for i in members:
            shape = items[i][2]
            n = int(np.prod(shape, dtype=np.int64))
            out[i] = values[start:start + n].view(shape)
            start += n
    return out  # type: ignore[return-value]


def native_expansion() -> bool:
    """Whether the fast block types expand through the native CPU kernel here (the library built, not switched off
    by ``PLINTH_CPU_NATIVE_OPS=0``)."""
    from plinth.kernels import cpu_native

    return cpu_native.native_ops_on() and cpu_native.load_library().library is not None


def _native_expand(kind: int, blocks: list[np.ndarray], out: torch.Tensor) -> bool:
    """The tensors' blocks expanded one after another into ``out`` by the native CPU kernel (same bits as the
    torch code above, several times faster); False where it does not run (then nothing was written)."""
    from plinth.kernels import cpu_native

    start = 0
    for data in blocks:
        n = data.size // _FAST[kind][0] * _BLOCK
        if not cpu_native.gguf_dequantize_into(np.ascontiguousarray(data).reshape(-1), kind, out[start:start + n]):
            return False   # only ever at the first tensor: the library's presence does not change in between
        start += n
    return True


def can_dequantize(ggml_type: Any) -> bool:
    """Whether :func:`dequantize_tensor` handles this ``gguf.GGMLQuantizationType``."""
    from plinth.quantization.kernels.gguf_blocks import BLOCK_TYPES

    kind = int(ggml_type)
    if kind in (F32, F16, BF16) or kind in _FAST or kind in BLOCK_TYPES:
        return True
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)  # one zero block
    except NotImplementedError:
        return False
    return True


def dequantize_tensor(data: np.ndarray, ggml_type: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as stored -> ``[*shape]`` of ``dtype``.

    Args:
        data: as :meth:`plinth.model_registry.gguf_file.GGUFFile.tensor_data` gives it: values for
            float types, ``[*shape[:-1], bytes_per_row]`` uint8 blocks otherwise.
        ggml_type: its ``gguf.GGMLQuantizationType``.
        shape: the dequantized shape (outermost first).
        dtype: the result's dtype.

    Raises:
        NotImplementedError: a type nothing here or in ``gguf.quants`` can dequantize.
    """
    kind = int(ggml_type)
    if kind in (F32, F16):
        return torch.from_numpy(np.array(data, copy=True)).reshape(shape).to(dtype)
    if kind in _FAST:
        type_size, expand = _FAST[kind]
        out = torch.empty(data.size // type_size * _BLOCK, dtype=torch.float32)
        if not _native_expand(kind, [data], out):
            blocks = torch.from_numpy(np.array(data, copy=True).reshape(1, -1, type_size))  # [1, n_blocks, type_size]
            expand(blocks, out.view(1, -1, _BLOCK))
        return out.reshape(shape).to(dtype)
    rows = torch.from_numpy(np.array(data, copy=True).reshape(-1, data.shape[-1]))  # [rows, bytes_per_row]
    if kind == BF16:
        return rows.view(torch.bfloat16).reshape(shape).to(dtype)
    from plinth.quantization.kernels.gguf_blocks import BLOCK_TYPES, dequantize_blocks

    if kind in BLOCK_TYPES:
        return dequantize_blocks(rows, kind, shape[-1]).reshape(shape).to(dtype)
    import gguf

    values = gguf.quants.dequantize(data, ggml_type)  # float32 [*shape]; may raise NotImplementedError
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(shape)).to(dtype)
