"""Paged attention through the ``flash_attn`` package, when it is installed.

``flash_attn_varlen_func`` takes the paged cache directly with ``block_table``; its causal
mask is aligned to the end of each key sequence, which is this project's convention (the new
tokens are the last positions of their sequence). The package is imported inside methods so
that a machine without it only sees this backend declared unsupported.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import ClassVar

import torch

from plinth.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Support,
    write_kv_cache,
)

#: flash_attn's paged-KV path needs pages of a multiple of this many tokens
_PAGE_MULTIPLE = 256


@dataclasses.dataclass(frozen=True)
class FlashAttnStepData:
    """Per-step tensors shared by every layer."""

    cu_seqlens_k: torch.Tensor   # [B + 1] int32: cumulative seq_lens
    num_real_tokens: int         # query_start_loc[-1]: rows past it are graph padding


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 varlen attention over the paged KV cache (NVIDIA GPUs, fp16/bf16)."""

    decode_rows_may_share_sequences = True   # every key and value is written before attention

    name: ClassVar[str] = "flash_attn"
    priority: ClassVar[int] = 30

    @classmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        try:
            flash_attn = importlib.import_module("flash_attn")
        except ImportError:
            return Support.no("flash_attn not installed")
        if not hasattr(flash_attn, "flash_attn_varlen_func"):
            return Support.no("the installed flash_attn has no flash_attn_varlen_func")
        if device_type != "cuda":
            return Support.no(f"flash_attn runs on cuda devices, not {device_type!r}")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return Support.no(f"dtype {spec.dtype} unsupported (float16, bfloat16)")
        if spec.head_size > 256 or spec.head_size % 8 != 0:
            return Support.no(f"head size {spec.head_size} unsupported (multiples of 8 up to 256)")
        if spec.num_heads % spec.num_kv_heads != 0:
            return Support.no(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
        if spec.block_size % _PAGE_MULTIPLE != 0:
            return Support.no(f"flash_attn's paged KV needs a block size that is a multiple of {_PAGE_MULTIPLE}, "
                              f"got {spec.block_size}")
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 8:
            return Support.no("flash_attn needs compute capability 8.0 or newer")
        return Support.yes()

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Build the cumulative key lengths once for all layers."""
        seq_lens = metadata.seq_lens
        cu = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=seq_lens.device)  # [B + 1]
        torch.cumsum(seq_lens, dim=0, out=cu[1:])
        metadata.backend_data = FlashAttnStepData(cu, metadata.query_start_loc_cpu[-1])

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
    ) -> torch.Tensor:           # [T, num_heads, head_size]
        """Write the new keys/values into ``kv_cache``, then attend (see the ABC)."""
        from flash_attn import flash_attn_varlen_func

        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        step = metadata.backend_data
        if not isinstance(step, FlashAttnStepData):
            self.prepare(metadata)
            step = metadata.backend_data
        out = torch.zeros_like(query)
        n = step.num_real_tokens
        if n == 0:
            return out
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        out[:n] = flash_attn_varlen_func(
            query[:n],
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=step.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=metadata.block_tables,
        )
        return out
