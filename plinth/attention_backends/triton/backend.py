"""The Triton paged-attention backend: one prefill/extend kernel, one split-KV decode kernel."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import ClassVar

import torch

from plinth.attention_backends.interface import (
    FP8_KV_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Support,
)
from plinth.attention_backends.triton import tiles
from plinth.kernels import ops

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_DEVICE_TYPES = ("cuda", "xpu")
#: programs-per-SM figure used by the interpreter (there is no real device to fill)
_INTERPRETER_SMS = 4


def interpret_requested() -> bool:
    """Whether the kernels should run in Triton's interpreter (CPU tensors, tests)."""
    return os.environ.get("PLINTH_TRITON_INTERPRET") == "1" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class _Kernels:
    write_kv_cache: ModuleType
    prefill: ModuleType
    decode: ModuleType


@functools.lru_cache(maxsize=1)
def _load_kernels() -> _Kernels:
    """Import the kernel modules; switches Triton to its interpreter first when asked to.

    Triton decides between compiling and interpreting when a kernel is decorated, so
    ``TRITON_INTERPRET`` must be set before these modules are imported.
    """
    if os.environ.get("PLINTH_TRITON_INTERPRET") == "1":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pkg = "plinth.attention_backends.triton"
    return _Kernels(
        write_kv_cache=importlib.import_module(f"{pkg}.cache_write"),
        prefill=importlib.import_module(f"{pkg}.prefill"),
        decode=importlib.import_module(f"{pkg}.decode"),
    )


@functools.lru_cache(maxsize=16)
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count
    if device_type == "xpu":
        props = torch.xpu.get_device_properties(index if index is not None else 0)
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units", 64))
    return _INTERPRETER_SMS


@dataclasses.dataclass(frozen=True)
class TritonStepPlan:
    """What :meth:`TritonAttentionBackend.prepare` works out once per step for every layer."""

    decode_only: bool
    max_blocks_per_seq: int     # the block-table width: the cache-capacity bound of the batch
    num_sms: int                # streaming multiprocessors (or equivalent) of the device


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels for CUDA (NVIDIA, ROCm) and XPU devices.

    Args:
        decode_splits: force the number of KV splits of the decode kernel (default: chosen
            from the batch size, the head count and the device's multiprocessor count).
    """

    decode_rows_may_share_sequences = True   # such steps skip the fused RoPE + cache-write decode kernel
    supports_soft_cap = True                 # the decode and prefill kernels cap the scores (SOFT_CAP)
    supports_sinks = True                    # ... and start each softmax from the head's sink (SINKS)
    shares_kv_cache = True                   # every kernel addresses the cache through its strides

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 20
    graph_safe: ClassVar[bool] = True
    fuses_rotary: ClassVar[bool] = True

    def __init__(self, decode_splits: int | None = None) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits must be >= 1, got {decode_splits}")
        self.decode_splits = decode_splits
        self.interpret = interpret_requested()

    @classmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        if importlib.util.find_spec("triton") is None:
            return Support.no("triton not installed")
        interpret = interpret_requested()
        if device_type == "cpu":
            if not interpret:
                return Support.no(
                    "triton kernels need a GPU; set PLINTH_TRITON_INTERPRET=1 to run them in the interpreter"
                )
            if spec.dtype == torch.bfloat16:
                return Support.no("bfloat16 is not computed correctly by Triton's interpreter")
        elif device_type not in _GPU_DEVICE_TYPES:
            return Support.no(f"triton kernels run on cuda and xpu devices, not {device_type!r}")
        if spec.dtype not in _DTYPES:
            return Support.no(f"dtype {spec.dtype} unsupported (float16, bfloat16, float32)")
        if not (16 <= spec.head_size <= tiles.MAX_HEAD_SIZE and spec.head_size % 16 == 0):
            return Support.no(f"head size {spec.head_size} unsupported (multiples of 16 from 16 to {tiles.MAX_HEAD_SIZE})")
        if spec.num_kv_heads < 1 or spec.num_heads % spec.num_kv_heads != 0:
            return Support.no(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
        if spec.block_size < 1:
            return Support.no(f"block size {spec.block_size} unsupported")
        return Support.yes()

    @classmethod
    def supports_kv_cache_dtype(cls, spec: AttentionSpec, device_type: str) -> Support:
        """The model's dtype, or an 8-bit float cache on CUDA GPUs that convert to and from FP8 (compute
        capability 8.9 and up: Ada, Hopper, Blackwell)."""
        if spec.cache_dtype == spec.dtype:
            return Support.yes()
        if spec.cache_dtype not in FP8_KV_DTYPES:
            return Support.no(f"KV cache of {spec.cache_dtype} unsupported")
        if device_type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
            return Support.no("an FP8 KV cache needs an NVIDIA GPU (compute capability 8.9 or higher)")
        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            return Support.no(f"an FP8 KV cache needs compute capability 8.9 or higher, this GPU has {major}.{minor}")
        return Support.yes()

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Record the decode/prefill choice, the capacity bound and the device size for this step."""
        metadata.backend_data = self._plan(metadata)

    def _plan(self, metadata: AttentionMetadata) -> TritonStepPlan:
        device = metadata.block_tables.device
        num_sms = _INTERPRETER_SMS if self.interpret else _num_sms(device.type, device.index)
        return TritonStepPlan(
            decode_only=metadata.is_decode_only,
            max_blocks_per_seq=metadata.block_tables.shape[1],
            num_sms=num_sms,
        )

    def forward(
        self,
        query: torch.Tensor,     # [T, num_heads, head_size]
        key: torch.Tensor,       # [T, num_kv_heads, head_size]
        value: torch.Tensor,     # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:           # [T, num_heads, head_size]
        """Write the new keys/values into ``kv_cache``, then attend (see the ABC).

        With ``rotary`` (``cos``, ``sin``) ``query`` and ``key`` arrive before their RoPE: a decode-only step
        with one token per sequence rotates them in the decode kernel, which also writes the new keys and
        values (one kernel instead of three); other steps rotate them in place first, as do decode steps whose
        rows may share a sequence (``metadata.rows_share_sequences``: a row reads the keys other rows write).
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if kv_cache.stride(-1) != 1:
            raise ValueError("the KV cache's last (head_size) dimension must be contiguous")
        query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        kernels = _load_kernels()
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_size]
        plan = metadata.backend_data
        if not isinstance(plan, TritonStepPlan):
            plan = self._plan(metadata)
        _, num_heads, head_size = query.shape
        fused_rotary = None
        if rotary is not None:
            cos, sin = rotary
            if cos.stride(-1) != 1 or cos.stride() != sin.stride():
                cos, sin = cos.contiguous(), sin.contiguous()
            if (plan.decode_only and metadata.num_seqs == metadata.num_tokens == metadata.slot_mapping.shape[0]
                    and cos.shape[-1] == head_size and not metadata.rows_share_sequences):
                fused_rotary = (key, value, cos, sin, metadata.slot_mapping)
            else:
                ops.rotary_(query, key, cos, sin)
        if fused_rotary is None:
            kernels.write_kv_cache.write_kv_cache_triton(key, value, k_cache, v_cache, metadata.slot_mapping)

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, num_heads, head_size]
        if metadata.num_seqs == 0:
            return out
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        chunks = tiles.latent_head_chunks(num_heads, num_kv_heads, head_size)
        if chunks > 1:   # the one KV head seen as `chunks` (stride 0), each serving `group / chunks` query heads
            k_cache, v_cache = (c.expand(-1, -1, chunks, -1) for c in (k_cache, v_cache))
            num_kv_heads, group = chunks, group // chunks
        if plan.decode_only:
            decode_tiles = tiles.decode_tiles(head_size, group, query.dtype, self.interpret)
            num_splits = self.decode_splits or tiles.decode_splits(
                metadata.num_seqs, num_kv_heads, plan.max_blocks_per_seq * k_cache.shape[1],
                decode_tiles.block_n, plan.num_sms,
            )
            kernels.decode.decode_attention(
                query, k_cache, v_cache, out, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, metadata.num_seqs, scale, sliding_window, decode_tiles, num_splits,
                rotary=fused_rotary, soft_cap=soft_cap, sinks=sinks,
            )
        else:
            prefill_tiles = tiles.prefill_tiles(head_size, group, query.dtype, self.interpret)
            kernels.prefill.prefill_attention(
                query, k_cache, v_cache, out, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, metadata.num_seqs, scale, sliding_window, prefill_tiles,
                soft_cap=soft_cap, sinks=sinks,
            )
        return out
