"""4-bit copies of a GGUF model's ``Q4_0``/``Q4_1`` projections, for the CPU's small-batch GEMM.

A ``Q4_1`` block holds 32 weights as ``w = d * q + m`` (``d``, ``m`` float16, ``q`` in 0..15; the low
nibbles of its 16 bytes are weights 0..15, the high nibbles 16..31); ``Q4_0`` is ``w = d * (q - 8)``.
torch's CPU int4 GEMM computes ``w = (q - 8) * scale + zero`` per group of 32, so a block maps onto
it exactly with ``scale = d`` and ``zero = m + 8 d`` (``Q4_0``: ``zero = 0``); only the rounding of
scale and zero to the copy's dtype differs from the file (and, where a float32 model's rows go to torch's
kernel rather than the native float32 GEMV over the panels, their rounding to bfloat16).

Fused layers (``qkv_proj``, ``gate_up_proj``) get their checkpoint projections stacked in the
layer's shard order; a layer gets a copy only when every one of its projections is 4-bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plinth.config import shared_mode
from plinth.kernels.cpu_native import Q4Panels
from plinth.worker.cpu_linear import INT4_GROUP, Int4Weight

logger = logging.getLogger(__name__)

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
INT4_ROWS = 16   # torch's CPU int4 packing needs the output rows in multiples of this


def decode_q4_blocks(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``raw`` ``uint8 [N, K / 32 * block_bytes]`` -> ``(q [N, K] int32, scale [N, K/32], zero [N, K/32])``."""
    size = _BLOCK_BYTES[type_name]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, size)                 # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)   # [N, K/32]
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                        # [N, K/32, 32]
    return (torch.from_numpy(q.reshape(n, -1).astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero))


def _module_shards(model: torch.nn.Module) -> dict[str, list[Any]]:
    """Fused module name -> its shard ids in layout order (``["q", "k", "v"]``, ``[0, 1]``, ``[None]``)."""
    from plinth.model_registry.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear

    out: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.tp_size != 1 or module.bias is not None:
            continue
        if isinstance(module, QKVParallelLinear):
            out[name] = ["q", "k", "v"]
        elif isinstance(module, MergedColumnParallelLinear):
            out[name] = list(range(len(module.output_sizes)))
        else:
            out[name] = [None]
    return out


def _cache_file(path: str, dtype: torch.dtype) -> Path | None:
    """Where the repacked copies of ``path`` are kept (keyed by the file's identity and torch's version: its inode
    and change time too, so another file put in its place with the same size and modification time is not taken
    for it)."""
    from plinth.config import cache_dir
    from plinth.errors import ModelLoadError
    from plinth.model_registry.gguf_file import open_gguf

    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        parts = [[p, *identity] for p, identity in open_gguf(path).part_files]   # (a split model's other files)
    except ModelLoadError:   # (a file it cannot parse: its own identity keys it, as before)
        parts = []
    key = json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, *_made_for(dtype),
                      2, *parts])
    return Path(cache_dir()) / "cpu_int4" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def _made_for(dtype: torch.dtype) -> list[str]:
    """What an entry's contents depend on besides the file: torch's version, the dtype, and the instruction set
    torch packs for (``_convert_weight_to_int4pack_for_cpu`` lays the codes out differently for AVX512, AVX2 and
    none, and the matching GEMM reads only its own layout: a cache shared by two kinds of CPU, or a start with
    ``ATEN_CPU_CAPABILITY`` set, must not read the other's)."""
    return [torch.__version__, str(dtype), torch.backends.cpu.get_cpu_capability()]


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' names, shapes, dtypes and bytes, in name order (a cache entry's checksum)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def _metadata(file: Path) -> dict[str, str]:
    """The safetensors header's metadata of a cache entry ({} when it has none or cannot be read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - a damaged header: the entry is reported when it is loaded
        return {}


def _load_cached(file: Path, names: set[str]) -> dict[str, Int4Weight] | None:
    from safetensors import SafetensorError, safe_open

    try:   # the tensors and the checksum from one open file (another process may replace or remove it meanwhile)
        with safe_open(str(file), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        logger.warning("ignoring the unreadable int4 cache %s: %s", file, exc)
        return None
    if meta.get("sha256") != _digest(tensors):   # damaged on disk (or written before checksums)
        logger.warning("ignoring the int4 cache %s: its contents do not match their checksum; rebuilding it", file)
        return None
    out = {}
    for name in {k.rsplit(".", 1)[0] for k in tensors}:
        if name not in names or f"{name}.packed" not in tensors or f"{name}.scale_zeros" not in tensors:
            return None
        sz = tensors[f"{name}.scale_zeros"]
        panels = None
        if f"{name}.q4p_codes" in tensors:
            panels = Q4Panels(tensors[f"{name}.q4p_codes"], tensors[f"{name}.q4p_scales"],
                              tensors[f"{name}.q4p_offsets"], sz.shape[1])
        out[name] = Int4Weight(tensors[f"{name}.packed"], sz, sz.shape[1], panels)
    return out


def _store_cached(file: Path, weights: dict[str, Int4Weight], source_path: str, dtype: torch.dtype) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {}
    for name, w in weights.items():
        tensors[f"{name}.packed"] = w.packed.contiguous()
        tensors[f"{name}.scale_zeros"] = w.scale_zeros.contiguous()
        if w.panels is not None:
            tensors[f"{name}.q4p_codes"] = w.panels.codes
            tensors[f"{name}.q4p_scales"] = w.panels.scales
            tensors[f"{name}.q4p_offsets"] = w.panels.offsets
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    source = os.path.realpath(source_path)
    # what else keys the entry (torch's version, the dtype, the instruction set): entries of the same file under
    # other settings stay
    made_for = json.dumps(_made_for(dtype))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"sha256": _digest(tensors), "source": source, "made_for": made_for})
        with open(tmp, "rb") as f:   # on disk before it is named: a crash leaves no entry that reads as whole
            os.fsync(f.fileno())
        os.chmod(tmp, shared_mode(0o644))   # safetensors writes it private (0600); the cache is shared
        os.replace(tmp, file)
    except BaseException as exc:   # safetensors' own error for a full disk; Ctrl-C: no half-written file stays
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(exc, (OSError, SafetensorError)):
            raise
        logger.warning("could not write the int4 cache %s: %s", file, exc)
        return
    # the entries of earlier states of the same file (touched, replaced, copied over) are of no further use
    for other in file.parent.glob("*.safetensors"):
        meta = _metadata(other) if other != file else {}
        if meta.get("source") == source and _same_settings(meta.get("made_for"), made_for):
            with contextlib.suppress(OSError):
                other.unlink()


def _same_settings(theirs: str | None, ours: str) -> bool:
    """Whether an entry's ``made_for`` is this start's, or this one's before the instruction set was part of it
    (those entries are keyed as no start reads them now)."""
    if theirs == ours:
        return True
    try:
        old = json.loads(theirs) if theirs else None
    except ValueError:
        return False
    return isinstance(old, list) and len(old) == 2 and old == json.loads(ours)[:2]


def int4_weights_from_gguf(path: str, model: Any, dtype: torch.dtype, use_cache: bool = True) -> dict[str, Int4Weight]:
    """4-bit copies of every linear layer of ``model`` whose GGUF tensors are all ``Q4_0``/``Q4_1``.

    The repacked copies are kept in ``$PLINTH_CACHE_DIR/cpu_int4`` (safetensors), keyed by the file's
    path, size and modification time and torch's version; a later start reads them from there.
    """
    file = _cache_file(path, dtype) if use_cache else None
    shards = _module_shards(model)
    if file is not None and file.exists():
        cached = _load_cached(file, set(shards))
        if cached is not None:
            logger.info("int4 copies of %d of %d linear layers from the cache %s", len(cached), len(shards), file)
            return cached
    out = _int4_from_file(path, model, dtype, shards)
    if file is not None and out:
        _store_cached(file, out, path, dtype)
    return out


def _int4_from_file(path: str, model: Any, dtype: torch.dtype, shards: dict[str, list[Any]]) -> dict[str, Int4Weight]:
    from plinth.model_registry.gguf_loader import iter_gguf_raw

    pieces: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for hf_name, data, ggml_type, hf_shape in iter_gguf_raw(path):
        target = model.map_weight_name(hf_name)
        if target is None or not target[0].endswith(".weight"):
            continue
        module_name = target[0].removesuffix(".weight")
        if module_name not in shards:
            continue
        if ggml_type.name not in _BLOCK_BYTES or hf_shape[-1] % INT4_GROUP:
            pieces.setdefault(module_name, {})["unusable"] = None  # type: ignore[assignment]
            continue
        pieces.setdefault(module_name, {})[target[1]] = decode_q4_blocks(np.asarray(data), ggml_type.name)
    out: dict[str, Int4Weight] = {}
    for module_name, parts in pieces.items():
        order = shards[module_name]
        if "unusable" in parts or any(s not in parts for s in order):
            continue
        q, scale, zero = (torch.cat([parts[s][i] for s in order]) for i in range(3))
        if q.shape[0] % INT4_ROWS:
            continue   # torch's int4 packing takes whole groups of 16 output rows: the float path runs it
        out[module_name] = Int4Weight.from_blocks(q, scale, zero, dtype)
    logger.info("int4 copies of %d of %d linear layers from %s", len(out), len(shards), path)
    return out


def q8_0_lm_head_from_gguf(path: str, model: Any) -> torch.Tensor | None:
    """The LM head's GGUF ``Q8_0`` blocks (``uint8 [vocab, hidden / 32 * 34]``), or None.

    The head is the file's ``output.weight``, or for a model with tied embeddings its token embedding.
    None when that tensor is not ``Q8_0`` or its shape is not the head's (for instance a vocabulary
    padded or split over tensor-parallel ranks).
    """
    from plinth.model_registry.gguf_loader import iter_gguf_raw

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or getattr(head, "tp_size", 1) != 1:
        return None
    tied = bool(getattr(model, "tie_word_embeddings", False))
    found: dict[str, tuple[np.ndarray, str, tuple[int, ...]]] = {}
    for hf_name, data, ggml_type, hf_shape in iter_gguf_raw(path):
        if hf_name in ("lm_head.weight", "model.embed_tokens.weight"):
            found[hf_name] = (data, ggml_type.name, tuple(hf_shape))
    entry = found.get("lm_head.weight") or (found.get("model.embed_tokens.weight") if tied else None)
    if entry is None:
        return None
    data, type_name, shape = entry
    if type_name != "Q8_0" or shape != tuple(weight.shape) or shape[-1] % 32:
        return None
    blocks = torch.from_numpy(np.ascontiguousarray(data).copy())       # [vocab, hidden / 32 * 34] uint8
    logger.info("LM head: the file's Q8_0 blocks (%.1f MiB) for decode rows", blocks.numel() / 2**20)
    return blocks
