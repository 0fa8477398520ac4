"""Decode steps of a standard decoder model on the CPU, as a flat list of prepared calls.

A decode step of a small model on a CPU spends about as long in Python as in arithmetic: every
layer goes through a dozen ``nn.Module`` calls, each with its hooks, argument checks and attention
metadata, around kernels that take microseconds. A :class:`CpuDecodePlan` does the same work with
the same kernels in the same order — the layers' own GEMM methods, the native fused ops of
:mod:`plinth.kernels.cpu_native` and the ``cpu_paged`` attention kernel — from per-layer records
resolved once at start-up, so a step's results are bit-identical to the module path's and its Python
cost is a loop over layers.

It serves what the module path would run with those kernels: a bfloat16 model (or a float32 one: the
default GGUF model on CPUs without native bfloat16) built from
:class:`~plinth.model_registry.models.decoder.DecoderForCausalLM` layers (a dense gated MLP, RMSNorms or Gemma's
whose weights are in the model's dtype, per-head q/k norms or none, norms on the block outputs (Gemma 2/3); any
biases and sliding windows, a second RoPE for sliding layers, layers without RoPE, embedding and residual
multipliers), one process (no tensor or pipeline parallelism), the ``cpu_paged`` attention backend and the native
ops available. :func:`build_decode_plan` says why not otherwise. ``PLINTH_CPU_DECODE_PLAN=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from plinth.kernels import cpu_native, ops
from plinth.worker.cpu_linear import decode_step

if TYPE_CHECKING:
    from plinth.worker.cpu_linear import Int4Weight

logger = logging.getLogger(__name__)


Linear = Callable[[torch.Tensor], torch.Tensor]


def _linear(layer: torch.nn.Module) -> Linear:
    """``x -> layer(x)`` without the module call: the layer's method, its bias in the GEMM (a row-parallel layer of one
    rank too, as ``RowParallelLinear.forward`` runs it)."""
    method, bias = layer.linear_method, layer.bias
    matmul = getattr(method, "matmul", None)
    if matmul is not None:              # plinth.worker.cpu_linear.CpuLinearMethod: bias added inside
        return (lambda x: matmul(x, bias)) if bias is not None else matmul
    return lambda x: method.apply(layer, x, bias)


def _int4_copy(layer: torch.nn.Module) -> Int4Weight | None:
    """The layer's 4-bit copy when one-row inputs go straight to it (bias-free, no other kernel first)."""
    method = layer.linear_method
    kernel_for = getattr(method, "int4_kernel_for", None)
    if kernel_for is None or layer.bias is not None:
        return None
    return kernel_for(1, layer.weight.dtype)


def _f32_rows(layer: torch.nn.Module) -> int:
    """The most float32 rows the layer's method sends to its 4-bit copy's float32 GEMV (0: none, or a bias)."""
    rows = getattr(layer.linear_method, "gemv_f32_max_rows", None)
    return rows() if rows is not None and layer.bias is None else 0


def _f32_copy(layer: torch.nn.Module) -> Int4Weight | None:
    """The 4-bit copy whose float32 GEMV the layer's method runs one float32 row on, or None."""
    return layer.linear_method.int4 if _f32_rows(layer) > 0 else None


def _matmul(lay: _Layer, name: str, x: torch.Tensor) -> torch.Tensor:
    """``lay.<name>(x)``; one contiguous row goes straight to the layer's 4-bit copy where it has one."""
    copy = lay.int4_copies.get(name) if x.shape[0] == 1 else None
    return copy.matmul(x) if copy is not None else getattr(lay, name)(x)


@dataclasses.dataclass
class _Layer:
    in_norm: torch.Tensor          # [H] in the model's dtype (bfloat16 or float32)
    post_norm: torch.Tensor        # [H]
    eps: float
    post_eps: float
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    kv_cache: torch.Tensor         # [2, num_blocks, block_size, Hkv, D]
    int4_copies: dict[str, Int4Weight] = dataclasses.field(default_factory=dict)   # one-row 4-bit copies by GEMM
    rope: bool = True              # q and k rotated (False: a NoPE layer, SmolLM3)
    q_norm: torch.nn.Module | None = None   # per-head RMSNorms of q and k before the rotation (Qwen3)
    k_norm: torch.nn.Module | None = None
    residual_multiplier: float = 1.0   # the attention and MLP outputs scaled before the residual add (Granite)
    attn_out_norm: tuple[torch.Tensor, float] | None = None   # Gemma 2/3: (weight, eps) of the attention output's norm
    mlp_out_norm: tuple[torch.Tensor, float] | None = None    # and of the MLP output's
    act: Callable[[torch.Tensor], torch.Tensor] | None = None  # a gated activation other than SiLU (the module's)
    local_rope: bool = False       # a sliding layer with the model's second RoPE (Gemma 3)

    @property
    def llama_shaped(self) -> bool:
        """What the native whole-step call runs: norms before the blocks only, SiLU, one RoPE on every layer."""
        return (self.rope and self.residual_multiplier == 1.0 and self.q_norm is None and self.act is None
                and self.attn_out_norm is None and not self.local_rope)


def _why_not(model: torch.nn.Module, backend: object) -> str:
    """Why the plan cannot run ``model`` (empty when it can)."""
    from plinth.attention_backends.cpu_paged import CpuPagedBackend
    from plinth.model_registry.layers.layernorm import GemmaRMSNorm, RMSNorm
    from plinth.model_registry.models.decoder import (
        DecoderAttention,
        DecoderForCausalLM,
        DecoderLayer,
        DenseMLP,
        SandwichDecoderLayer,
    )

    if not isinstance(model, DecoderForCausalLM):
        return f"{type(model).__name__} is not a standard decoder model"
    if not isinstance(backend, CpuPagedBackend):
        return f"attention backend {getattr(backend, 'name', backend)} (needs cpu_paged)"
    inner = model.model
    if model.lm_head is None or inner.embed_tokens is None or inner.norm is None or inner.embed_tokens.tp_size != 1:
        return "pipeline or tensor parallelism"
    embed = inner.embed_tokens.weight
    dtype = embed.dtype
    if not cpu_native.layer_ops_enabled(embed):   # bfloat16 or float32, the library built and switched on
        return "not a bfloat16 or float32 model with the native CPU ops"
    if not ops.fused_ops_enabled(embed):   # PLINTH_FUSED_OPS=0: the modules run the torch code
        return "the fused ops are off (PLINTH_FUSED_OPS=0)"
    for layer in inner.layers:
        if type(layer) not in (DecoderLayer, SandwichDecoderLayer) or not isinstance(layer.self_attn, DecoderAttention):
            return f"layer {type(layer).__name__} is not a standard decoder layer"
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn).forward is not DecoderAttention.forward:
            return f"attention block {type(attn).__name__} has a forward pass of its own"
        if attn.rope_interleaved:
            return "RoPE over adjacent pairs of features"
        if attn.attn.attention_chunk is not None:
            return "chunked local attention"
        if attn.q_norm is not None and (attn.qk_norm_full or type(attn.q_norm) not in (RMSNorm, GemmaRMSNorm)):
            return "q/k norms over all heads"
        if not isinstance(mlp, DenseMLP):
            return f"feed-forward block {type(mlp).__name__} is not a dense MLP"
        if attn.qkv_proj.tp_size != 1 or attn.attn.kv_cache is None:
            return "tensor parallelism, or no KV cache"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if isinstance(layer, SandwichDecoderLayer):
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        for norm in norms:
            # the native norm multiplies by the weight: a Gemma norm's holds 1 + w, in the model's dtype when it
            # computes in float32 (in a bfloat16 model it stays float32: caught here)
            if type(norm) not in (RMSNorm, GemmaRMSNorm):
                return f"{type(norm).__name__} norms"
            if norm.weight.dtype != dtype:
                return f"norm weights are not {dtype}"
        if attn.attn.kv_cache.dtype != dtype and not _narrow_cache_ok(attn.attn.kv_cache, dtype, attn.head_dim):
            return (f"the KV cache is not {dtype} (nor FP8 E4M3 with a bfloat16 model, head size 64 or 128, nor "
                    f"bfloat16 with a float32 model on an AVX2 build)")
    if inner.norm.weight.dtype != dtype:
        return f"norm weights are not {dtype}"
    return ""


def _narrow_cache_ok(cache: torch.Tensor, dtype: torch.dtype, head_size: int) -> bool:
    """A cache narrower than the model's dtype that the decode kernel reads: FP8 E4M3 under a bfloat16 model (head
    size 64 or 128, an AVX512-BF16 build), or bfloat16 under a float32 model (an AVX2 build)."""
    from plinth.attention_backends.cpu_paged import (
        FP8_CACHE_DTYPE,
        FP8_HEAD_SIZES,
        f32_bf16_available,
        fp8_decode_available,
    )

    if cache.dtype == torch.bfloat16 and dtype == torch.float32:
        return f32_bf16_available()
    return (cache.dtype == FP8_CACHE_DTYPE and dtype == torch.bfloat16 and head_size in FP8_HEAD_SIZES
            and fp8_decode_available())


class _Native:
    """The native entry points a step calls, looked up once: calling them straight with pointers skips
    the checks, conversions and allocations of the Python wrappers (a few microseconds per call, ten calls
    a layer, which at one sequence is a tenth of the step)."""

    def __init__(self, dtype: torch.dtype) -> None:
        from plinth.attention_backends.cpu_paged_build import load_kernel

        lib = cpu_native.load_library().library
        attn = load_kernel().library
        assert lib is not None and attn is not None
        suffix = "bf16" if dtype == torch.bfloat16 else "f32"
        self.rms_norm = getattr(lib, f"plinth_rms_norm_{suffix}")
        self.silu_mul = getattr(lib, f"plinth_silu_mul_{suffix}")
        self.rotary = getattr(lib, f"plinth_rotary_{suffix}")
        self.kv_write = lib.plinth_kv_write
        self.kv_write_e4m3 = lib.plinth_kv_write_e4m3   # bfloat16 rows into an FP8 E4M3 cache (strides in elements)
        self.kv_write_bf16 = lib.plinth_kv_write_f32_bf16   # float32 rows into a bfloat16 cache (the same)
        self.decode = attn.plinth_cpu_paged_decode
        self.dtype_code = 1 if dtype == torch.bfloat16 else 0   # the attention entry point's dtype argument


@dataclasses.dataclass
class _Buffers:
    """The normed activations and the attention output for up to ``C`` rows (a batch of ``B <= C`` uses the first
    ``B``), reused by every layer and step; replaced by a larger set when a larger batch comes."""

    normed: torch.Tensor     # [C, H] in the model's dtype
    attn: torch.Tensor       # [C, Hq * D]
    fused: _FusedBuffers | None = None


@dataclasses.dataclass
class _FusedBuffers:
    """For the native whole-step call, for up to ``C`` rows: every GEMV output and the step's argument block, its
    buffer pointers filled once (a call sets only the step's rows, inputs and thread count)."""

    tensors: list[torch.Tensor]
    out: torch.Tensor        # [C, H]: the final norm's output
    step: cpu_native.DecodeStep


class CpuDecodePlan:
    """Runs decode batches of up to ``max_size`` sequences (the model runner's ``graphs`` interface).

    Args:
        model: the loaded model (its attention layers already hold their KV caches).
        block_size: tokens per KV block.
        max_size: the largest decode batch (the engine's ``max_num_seqs``).
    """

    def __init__(self, model: torch.nn.Module, block_size: int, max_size: int, fused: bool = True):
        inner = model.model
        self.model = model
        self.block_size = block_size
        self.max_size = max_size
        self.fused = fused
        self.embed = inner.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.final_eps = inner.norm.eps
        self.local_rotary = inner.local_rotary_emb   # Gemma 3's sliding layers' RoPE, else None
        self.layers = []
        from plinth.model_registry.layers.activation import SiluAndMul
        from plinth.model_registry.models.decoder import SandwichDecoderLayer

        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            sandwich = isinstance(layer, SandwichDecoderLayer)
            # the norm that adds the attention output to the residual stream before the MLP
            mlp_in = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            act = None
            if not isinstance(mlp.act_fn, SiluAndMul):   # as DenseMLP.forward calls it
                act = functools.partial(mlp.act_fn, quant=mlp.down_proj.input_quant())
            self.layers.append(_Layer(
                in_norm=layer.input_layernorm.weight, post_norm=mlp_in.weight,
                eps=layer.input_layernorm.eps, post_eps=mlp_in.eps,
                qkv=_linear(attn.qkv_proj), o=_linear(attn.o_proj), gate_up=_linear(mlp.gate_up_proj),
                down=_linear(mlp.down_proj), num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                head_size=attn.head_dim, scale=attn.attn.scale, sliding_window=attn.attn.sliding_window,
                kv_cache=attn.attn.kv_cache, int4_copies={
                    name: copy for name, proj in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                                                  ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))
                    if (copy := _int4_copy(proj)) is not None},
                rope=attn.use_rope, residual_multiplier=getattr(layer, "residual_multiplier", 1.0),
                q_norm=attn.q_norm, k_norm=attn.k_norm, act=act,
                attn_out_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
                if sandwich else None,
                mlp_out_norm=(layer.post_feedforward_layernorm.weight, layer.post_feedforward_layernorm.eps)
                if sandwich else None,
                local_rope=self.local_rotary is not None and attn.attn.sliding_window is not None))
        self.embed_scale = inner.embed_scale   # Gemma's sqrt(hidden_size), Granite's embedding multiplier
        self.native = _Native(self.dtype)
        self._buffers: _Buffers | None = None
        self.amx = False   # the fused step's GEMMs past the GEMV's rows on AMX tiles (any batch size)
        #: every layer's GEMMs on 4-bit panels with the native GEMV: batches of up to fused_max_rows (the rows
        #: the layers' methods send to the GEMV) run all layers in one native call (the same kernels in the same
        #: order: bit-identical)
        projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                       for layer in inner.layers]
        if self.dtype == torch.float32:   # float32 rows the layers' methods send to the float32 GEMV
            self._gemv_copies = [[_f32_copy(proj) for proj in projs] for projs in projections]
            self.fused_max_rows = min((_f32_rows(proj) for projs in projections for proj in projs), default=0)
        else:
            self._gemv_copies = [[lay.int4_copies.get(name) for name in ("qkv", "o", "gate_up", "down")]
                                 for lay in self.layers]
            self.fused_max_rows = min((min(getattr(proj.linear_method, "gemv_max_rows", 0), cpu_native.Q4_GEMV_MAX_ROWS)
                                       for projs in projections for proj in projs), default=0)
            # every projection's rows past the GEMV's on AMX tiles: the fused step takes any batch
            if self.fused_max_rows > 0 and self._amx_rows(projections):
                self.amx, self.fused_max_rows = True, max_size
        # float32 GEMMs with 8-bit inputs (PLINTH_CPU_INT8_ACT on AVX2): every copy alike, or no native step
        copies = [c for projs in self._gemv_copies for c in projs if c is not None]
        self.int8_inputs = bool(copies) and all(c.int8_inputs for c in copies)
        mixed = not self.int8_inputs and any(c.int8_inputs for c in copies)
        self.fused_layers = self._fused_layers() if fused and not mixed else None

    def rebuilder(self) -> Callable[[], CpuDecodePlan]:
        """What builds this plan again (after the KV cache moved: sleep mode)."""
        model, block_size, max_size, fused = self.model, self.block_size, self.max_size, self.fused
        return lambda: CpuDecodePlan(model, block_size, max_size, fused)

    @staticmethod
    def _amx_rows(projections: list[tuple[torch.nn.Module, ...]]) -> bool:
        """Whether every projection sends its rows past :data:`cpu_native.Q4_GEMV_AMX_MAX_ROWS` to the AMX panel
        GEMM (as ``plinth_decode_layers_amx`` does) and its fewer rows to the GEMV."""
        def routed(method: object) -> bool:
            return (getattr(method, "q4_panel_max_rows", 0) == sys.maxsize
                    and getattr(method, "gemv_max_rows", 0) == cpu_native.Q4_GEMV_AMX_MAX_ROWS
                    # rows up to int4_max_rows take the copy's own matmul, past vnni_min_rows the 8-bit GEMM
                    and getattr(method, "int4_max_rows", sys.maxsize) <= cpu_native.Q4_GEMV_AMX_MAX_ROWS
                    and getattr(method, "vnni", None) is None)

        return cpu_native.q4_amx_supported() and all(routed(proj.linear_method) for projs in projections
                                                     for proj in projs)

    def _fused_layers(self) -> ctypes.Array | None:
        """The layers' argument blocks for :func:`cpu_native.decode_layers`, or None where a layer lacks a
        4-bit copy with the native GEMV (bfloat16, or float32 for a float32 model) for one of its four GEMMs."""
        specs = []
        first = self.layers[0]
        first_copies = self._gemv_copies[0]
        for lay, copies in zip(self.layers, self._gemv_copies, strict=True):
            if not lay.llama_shaped:
                return None
            if (any(c is None or (c.gemv if self.dtype == torch.bfloat16 else c.gemv_f32) is None for c in copies)
                    or (lay.kv_cache.dtype != self.dtype
                        and not _narrow_cache_ok(lay.kv_cache, self.dtype, lay.head_size))):
                return None
            # the step's buffers are sized once, from the first layer: every layer must have its shapes
            if ((lay.num_heads, lay.num_kv_heads, lay.head_size) != (first.num_heads, first.num_kv_heads,
                                                                     first.head_size)
                    or [c.out_features for c in copies] != [c.out_features for c in first_copies]):
                return None
            cache = lay.kv_cache
            specs.append(cpu_native.DecodeLayer(
                *(cpu_native.PanelWeight.of(c.panels, c.gemm_q8.quad_codes if self.int8_inputs else None)
                  for c in copies),
                lay.in_norm.data_ptr(), lay.post_norm.data_ptr(), lay.eps, lay.post_eps, cache.data_ptr(),
                cache.shape[1], lay.num_heads, lay.num_kv_heads, lay.head_size, lay.scale, lay.sliding_window or 0,
                int(cache.dtype != self.dtype)))
        return (cpu_native.DecodeLayer * len(specs))(*specs)

    def _fused_buffers(self, bufs: _Buffers) -> _FusedBuffers:
        if bufs.fused is None:
            width, cap = self.embed.shape[1], bufs.normed.shape[0]
            qkv_n, gate_up_n = self._gemv_copies[0][0].out_features, self._gemv_copies[0][2].out_features
            tensors = [torch.empty((cap, n), dtype=self.dtype)
                       for n in (qkv_n, width, gate_up_n, gate_up_n // 2, width, width)]
            qkv, o, gate_up, act, down, out = tensors
            step = cpu_native.DecodeStep(
                rows=cap, width=width, block_size=self.block_size,
                normed=bufs.normed.data_ptr(), qkv=qkv.data_ptr(), attn=bufs.attn.data_ptr(), o=o.data_ptr(),
                gate_up=gate_up.data_ptr(), act=act.data_ptr(), down=down.data_ptr(), out=out.data_ptr(),
                final_norm=self.final_norm.data_ptr(), final_eps=self.final_eps,
                attention=ctypes.cast(self.native.decode, ctypes.c_void_p).value)
            bufs.fused = _FusedBuffers(tensors, out, step)
        return bufs.fused

    def _buffers_for(self, b: int) -> _Buffers:
        """Buffers for at least ``b`` rows: grown (doubling, up to ``max_size``) when ``b`` exceeds them, so the
        memory held follows the largest batch seen, not every batch size seen."""
        bufs = self._buffers
        if bufs is None or bufs.normed.shape[0] < b:
            cap = min(self.max_size, max(b, 2 * bufs.normed.shape[0])) if bufs is not None else b
            lay = self.layers[0]
            bufs = self._buffers = _Buffers(
                normed=torch.empty((cap, self.embed.shape[1]), dtype=self.dtype),
                attn=torch.empty((cap, lay.num_heads * lay.head_size), dtype=self.dtype))
        return bufs

    @torch.inference_mode()
    def run(self, token_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
            rope_shift: np.ndarray | None = None) -> torch.Tensor | None:
        """One decode step for ``B`` sequences (see :meth:`_run`), as a decode step for the layers' GEMMs."""
        with decode_step():
            return self._run(token_ids, positions, block_tables, rope_shift)

    def _run(self, token_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
             rope_shift: np.ndarray | None = None) -> torch.Tensor | None:
        """One decode step for ``B`` sequences: logits ``[B, vocab]`` float32 (None: not a batch it takes).

        Args:
            token_ids: ``[B]`` the last token of each sequence.
            positions: ``[B]`` its position (= tokens already in the cache).
            block_tables: ``[B, W]`` int32, each sequence's blocks, 0-padded.
            rope_shift: ``[B]`` added to the positions for the rotary embedding (multimodal RoPE), or ``None``.
        """
        b = len(token_ids)
        if not cpu_native.native_ops_on():   # switched off since the plan was built: the modules' routing
            return None
        if not 0 < b <= self.max_size or not isinstance(block_tables, np.ndarray) or block_tables.ndim != 2:
            return None
        bs = self.block_size
        pos = np.asarray(positions, dtype=np.int64)
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        if int(pos.max()) // bs >= tables.shape[1]:
            return None   # a sequence without a block for its new token (the module path reports it)
        slots = torch.from_numpy(tables[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs)   # [B]
        lens = torch.from_numpy((pos + 1).astype(np.int32))                                           # [B]
        starts = torch.arange(b + 1, dtype=torch.int32)                                               # [B + 1]
        tables_t = torch.from_numpy(tables)
        hidden = F.embedding(torch.from_numpy(np.asarray(token_ids, dtype=np.int64)), self.embed)     # [B, H]
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale   # as DecoderModel.run_stage
        rope_pos = torch.from_numpy(pos if rope_shift is None else pos + rope_shift)
        cos, sin = self.rotary.cos_sin(rope_pos, hidden.dtype)                                         # [B, R]
        cos, sin = cos.contiguous(), sin.contiguous()
        native, bufs = self.native, self._buffers_for(b)
        if self.fused_layers is not None and b <= self.fused_max_rows:
            fused = self._fused_buffers(bufs)
            step = fused.step
            step.rows = b
            step.residual, step.cos, step.sin = hidden.data_ptr(), cos.data_ptr(), sin.data_ptr()
            step.slots, step.lens, step.starts = slots.data_ptr(), lens.data_ptr(), starts.data_ptr()
            step.tables, step.table_width, step.rot_dim = tables_t.data_ptr(), tables.shape[1], cos.shape[-1]
            step.threads = torch.get_num_threads()
            cpu_native.decode_layers(self.fused_layers, step, self.dtype, int8_inputs=self.int8_inputs, amx=self.amx)
            return self.model.compute_logits(fused.out[:b])
        normed, attn_out = bufs.normed[:b], bufs.attn[:b]
        width = hidden.shape[1]
        slots_p, lens_p, starts_p, tables_p = slots.data_ptr(), lens.data_ptr(), starts.data_ptr(), tables_t.data_ptr()
        cos_p, sin_p, rot_dim = cos.data_ptr(), sin.data_ptr(), cos.shape[-1]
        local_p = (cos_p, sin_p, rot_dim)
        if self.local_rotary is not None:
            local_cos, local_sin = (t.contiguous() for t in self.local_rotary.cos_sin(rope_pos, hidden.dtype))
            local_p = (local_cos.data_ptr(), local_sin.data_ptr(), local_cos.shape[-1])
        threads = torch.get_num_threads()
        from plinth.attention_backends.cpu_paged import F32_BF16_DTYPE_CODE, FP8_DTYPE_CODE

        rms_norm = native.rms_norm

        def add_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
            """residual += x (in place); out = norm(residual)."""
            rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), width, weight.data_ptr(), out.data_ptr(),
                     residual.data_ptr(), b, width, eps)

        def norm_only(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
            """norm(x), the residual stream left alone (Gemma 2/3's norms on the block outputs)."""
            out = torch.empty((b, width), dtype=self.dtype)
            rms_norm(x.data_ptr(), x.stride(0), None, 0, weight_eps[0].data_ptr(), out.data_ptr(), None, b, width,
                     weight_eps[1])
            return out

        residual = hidden   # the embedding output, then the running residual stream, updated in place
        for i, lay in enumerate(self.layers):
            if i == 0:   # the residual stream starts as the embedding output itself: nothing to add
                rms_norm(hidden.data_ptr(), hidden.stride(0), None, 0, lay.in_norm.data_ptr(), normed.data_ptr(),
                         None, b, width, lay.eps)
            else:
                add_norm(hidden, lay.in_norm, lay.eps, normed)
            qkv = _matmul(lay, "qkv", normed)                                                         # [B, (Hq+2Hkv)D]
            d, hq, hkv = lay.head_size, lay.num_heads, lay.num_kv_heads
            row, elem = qkv.stride(0), qkv.element_size()
            q_p = qkv.data_ptr()
            k_p, v_p = q_p + hq * d * elem, q_p + (hq + hkv) * d * elem
            if lay.q_norm is not None:   # the modules' own norms on the same [B, H, D] views, written back in place
                q_view = qkv[:, :hq * d].view(b, hq, d)
                k_view = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
                q_view.copy_(lay.q_norm(q_view))
                k_view.copy_(lay.k_norm(k_view))
            if lay.rope:
                c_p, s_p, r_dim = local_p if lay.local_rope else (cos_p, sin_p, rot_dim)
                native.rotary(q_p, row, d, hq, k_p, row, d, hkv, c_p, s_p, r_dim, b, r_dim)
            cache = lay.kv_cache                                                   # [2, N, BS, Hkv, D]
            narrow = cache.dtype != self.dtype   # FP8 E4M3 or bfloat16 (_why_not checked it)
            if narrow:
                write = native.kv_write_e4m3 if self.dtype == torch.bfloat16 else native.kv_write_bf16
                write(k_p, row, v_p, row, cache.data_ptr(), cache.shape[1] * cache.shape[2], slots_p, b, hkv * d)
                code = FP8_DTYPE_CODE if self.dtype == torch.bfloat16 else F32_BF16_DTYPE_CODE
            else:
                code = native.dtype_code
                native.kv_write(k_p, row * elem, v_p, row * elem, cache.data_ptr(), cache.shape[1] * cache.shape[2],
                                slots_p, b, hkv * d * elem)
            native.decode(q_p, cache.data_ptr(), tables_p, lens_p, starts_p, attn_out.data_ptr(),
                          code, b, hq, hkv, d,
                          cache.shape[1], bs, tables.shape[1], row, hq * d, lay.scale, lay.sliding_window or 0,
                          threads)
            hidden = _matmul(lay, "o", attn_out)
            if lay.residual_multiplier != 1.0:
                hidden = hidden * lay.residual_multiplier   # as DecoderLayer.forward
            if lay.attn_out_norm is not None:
                hidden = norm_only(hidden, lay.attn_out_norm)   # as SandwichDecoderLayer.forward
            add_norm(hidden, lay.post_norm, lay.post_eps, normed)
            gate_up = _matmul(lay, "gate_up", normed)                                                 # [B, 2I]
            if lay.act is not None:
                act = lay.act(gate_up)
            else:
                inter = gate_up.shape[1] // 2
                act = torch.empty((b, inter), dtype=self.dtype)
                native.silu_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), b, inter)
            hidden = _matmul(lay, "down", act)
            if lay.residual_multiplier != 1.0:
                hidden = hidden * lay.residual_multiplier
            if lay.mlp_out_norm is not None:
                hidden = norm_only(hidden, lay.mlp_out_norm)
        out = torch.empty_like(normed)
        add_norm(hidden, self.final_norm, self.final_eps, out)
        return self.model.compute_logits(out)


def build_decode_plan(model: torch.nn.Module, backend: object, block_size: int,
                      max_size: int) -> tuple[CpuDecodePlan | None, str]:
    """A plan for ``model``, or ``(None, why not)``."""
    reason = _why_not(model, backend)
    if reason:
        return None, reason
    return CpuDecodePlan(model, block_size, max_size), ""
