"""Native fused ops for bfloat16 (and float32) models on CPUs (``csrc/cpu_ops.cpp``), called through ctypes.

On a CPU a decode step of a small model is dominated by per-op overhead: an RMSNorm in torch is
nine tensor ops (~17 us for one 576-feature row), a rotary embedding a dozen. The native kernels do
each in one call of a few microseconds, reproducing the reference code's bfloat16 rounding steps
(see the C++ file). :func:`enabled` says whether a tensor takes them: a CPU bfloat16 tensor, the
library built (the system C++ compiler, at first use, cached like the paged-attention kernel), not
inside ``torch.compile`` tracing, and ``PLINTH_CPU_NATIVE_OPS`` not ``0``; the per-layer ops (RMSNorm,
SiLU-and-mul, RoPE) also take float32 tensors (:func:`layer_ops_enabled`). The GEMV of GGUF
``Q8_0`` weights serves the LM head of GGUF models for a few rows (:mod:`plinth.worker.cpu_linear`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from plinth.kernels.native_build import NativeBuild, build_and_open

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
ABI_VERSION = 14
NATIVE_OPS_ENV = "PLINTH_CPU_NATIVE_OPS"
Q8_0_BLOCK, Q8_0_BYTES = 32, 34

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "plinth_rms_norm_bf16": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _D],
    "plinth_silu_mul_bf16": [_P, _I, _P, _I, _I],
    "plinth_rotary_bf16": [_P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I],
    "plinth_rms_norm_f32": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _D],
    "plinth_silu_mul_f32": [_P, _I, _P, _I, _I],
    "plinth_rotary_f32": [_P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I],
    "plinth_q8_0_gemv": [_P, _I, _P, _P, _I, _I, _I, _I],
    "plinth_q8_0_gemv_f32": [_P, _I, _P, _P, _I, _I, _I, _I],
    "plinth_q8_0r8_gemv_f32q8": [_P, _I, _P, _P, _I, _I, _I],
    "plinth_q8_0r8_gemm_f32": [_P, _I, _P, _P, _I, _I, _I],
    "plinth_kv_write": [_P, _I, _P, _I, _P, _I, _P, _I, _I],
    "plinth_kv_write_e4m3": [_P, _I, _P, _I, _P, _I, _P, _I, _I],
    "plinth_kv_write_f32_bf16": [_P, _I, _P, _I, _P, _I, _P, _I, _I],
    "plinth_q4p_gemm_bf16": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q4p_gemm_amx": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q4p_gemm_amx_silu": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q8p_gemm_amx": [_P, _I, _P, _P, _P, _I, _I, _I],
    "plinth_amx_init": [],
    "plinth_q8v_gemm_bf16": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q4p_gemv_bf16": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q4p_gemv_f32": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_q4p_gemm_f32q8": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
    "plinth_decode_layers_bf16": [_P, _I, _P],
    "plinth_decode_layers_amx": [_P, _I, _P],
    "plinth_decode_layers_f32": [_P, _I, _P],
    "plinth_decode_layers_f32q8": [_P, _I, _P],
    "plinth_sample_rows_bf16": [_P, _I, _I, _I, _P, _P, _P],
    "plinth_sample_rows_f32": [_P, _I, _I, _I, _P, _P, _P],
    "plinth_gguf_dequant_f32": [_P, _I, _I, _P],
    "plinth_gated_delta_step_f32": [_P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
}
_RETURNS = {"plinth_q8_0r8_gemv_f32q8": ctypes.c_int64, "plinth_q8_0r8_gemm_f32": ctypes.c_int64,
            "plinth_q4p_gemm_bf16": ctypes.c_int64, "plinth_q4p_gemm_amx": ctypes.c_int64,
            "plinth_q4p_gemm_amx_silu": ctypes.c_int64, "plinth_q8p_gemm_amx": ctypes.c_int64,
            "plinth_amx_init": ctypes.c_int64,
            "plinth_q8v_gemm_bf16": ctypes.c_int64,
            "plinth_q4p_gemv_bf16": ctypes.c_int64, "plinth_q4p_gemv_f32": ctypes.c_int64,
            "plinth_q4p_gemm_f32q8": ctypes.c_int64, "plinth_decode_layers_bf16": ctypes.c_int64,
            "plinth_decode_layers_amx": ctypes.c_int64,
            "plinth_decode_layers_f32": ctypes.c_int64, "plinth_decode_layers_f32q8": ctypes.c_int64,
            "plinth_gguf_dequant_f32": ctypes.c_int64, "plinth_gated_delta_step_f32": ctypes.c_int64}


@functools.cache
def load_library() -> NativeBuild:
    """The ops library, built on first use (never raises; ``reason`` says why there is none)."""
    build = build_and_open(SOURCE, "cpu_ops", "plinth_cpu_ops_abi", ABI_VERSION, "CPU fused-op kernels")
    if build.library is None:
        logger.info("native CPU ops unavailable (%s): the torch reference code runs", build.reason)
        return build
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(build.library, name)
        fn.restype = _RETURNS.get(name)
        fn.argtypes = argtypes
    return build


@functools.cache
def _env_enabled() -> bool:
    return os.environ.get(NATIVE_OPS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def native_ops_on() -> bool:
    """``PLINTH_CPU_NATIVE_OPS`` is not switched off (checked at call time by kernels built at load time; the
    switch is read once per process unless ``_env_enabled``'s cache is cleared, as benchmarks do)."""
    return _env_enabled()


def available(dtype: torch.dtype) -> bool:
    """Whether the native ops run for CPU tensors of ``dtype`` (bfloat16, switch on, library built)."""
    return dtype == torch.bfloat16 and _env_enabled() and load_library().library is not None


def enabled(x: torch.Tensor) -> bool:
    """Whether the native ops run for ``x`` (never while ``torch.compile`` traces)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and available(x.dtype)


def gguf_dequantize_into(blocks: np.ndarray, ggml_type: int, out: torch.Tensor) -> bool:
    """GGUF ``Q4_0``, ``Q4_1`` or ``Q8_0`` blocks (``uint8``, 32 weights each, contiguous) -> ``out`` (float32,
    contiguous, ``32 x`` the block count), bit for bit as the format's float32 reference; False (nothing written)
    where the library is not built, ``PLINTH_CPU_NATIVE_OPS=0`` or the type is another."""
    if not _env_enabled() or (lib := load_library().library) is None:
        return False
    if not (blocks.dtype == np.uint8 and blocks.flags.c_contiguous and out.dtype == torch.float32
            and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError("gguf_dequantize_into takes contiguous uint8 blocks and a contiguous float32 CPU tensor")
    type_size = {2: 18, 3: 20, 8: 34}.get(int(ggml_type))
    if type_size is None:
        return False
    n_blocks = blocks.size // type_size
    if n_blocks * type_size != blocks.size or out.numel() != 32 * n_blocks:
        raise ValueError(f"{blocks.size} bytes of ggml type {int(ggml_type)} do not fill {out.numel()} weights")
    return lib.plinth_gguf_dequant_f32(blocks.ctypes.data, n_blocks, int(ggml_type), out.data_ptr()) == 0


def layer_ops_enabled(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm`, :func:`silu_and_mul` and :func:`rotary_` run for ``x``: as :func:`enabled`,
    for float32 tensors too (float32 models: the torch code's chain of tensor ops in one call, without
    intermediate roundings). The same tensors as :func:`q8_0_enabled`."""
    return q8_0_enabled(x)


def q8_0_supported(dtype: torch.dtype) -> bool:
    """Whether :func:`q8_0_matmul` runs for inputs of ``dtype`` (bfloat16 or float32, switch on, library built)."""
    return dtype in (torch.bfloat16, torch.float32) and _env_enabled() and load_library().library is not None


@functools.cache
def q8_0_int8_supported() -> bool:
    """Whether :func:`q8_0_matmul` takes ``int8_inputs`` here (the library was built with AVX2; switch on)."""
    if not q8_0_supported(torch.float32):
        return False
    packed = pack_q8_0_rows8(torch.zeros(1, Q8_0_BYTES, dtype=torch.uint8))
    x, y = torch.zeros(1, Q8_0_BLOCK), torch.empty(1, 1)
    return _lib().plinth_q8_0r8_gemv_f32q8(x.data_ptr(), Q8_0_BLOCK, packed.data_ptr(), y.data_ptr(), 1, 1,
                                           Q8_0_BLOCK) == 0


def pack_q8_0_rows8(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF ``Q8_0`` rows ``blocks`` (``uint8 [N, K / 32 * 34]``) regrouped eight rows at a time for the 8-bit-input
    GEMV (``plinth_q8_0r8_gemv_f32q8``) and the float32 GEMM (``plinth_q8_0r8_gemm_f32``): ``uint8 [ceil(N / 8), K / 32,
    272]``, per tile of 8 rows and 32-feature
    block the 8 rows' float16 scales, then for ``j = 0..7`` the 8 rows' codes ``4 j .. 4 j + 3``; the last tile is
    padded with zero rows. Same bytes, another order (the file's ``[N, K]`` weight is unchanged)."""
    n = blocks.shape[0]
    nb = blocks.shape[1] // Q8_0_BYTES
    tiles = (n + 7) // 8
    rows = blocks.reshape(n, nb, Q8_0_BYTES)
    if tiles * 8 != n:
        rows = torch.cat([rows, rows.new_zeros(tiles * 8 - n, nb, Q8_0_BYTES)])
    rows = rows.reshape(tiles, 8, nb, Q8_0_BYTES).transpose(1, 2)                    # [T, nb, 8 rows, 34]
    scales = rows[..., :2].reshape(tiles, nb, 16)
    codes = rows[..., 2:].reshape(tiles, nb, 8, 8, 4).transpose(2, 3).reshape(tiles, nb, 256)   # [T, nb, j, row, 4]
    return torch.cat([scales, codes], -1).contiguous()


def q8_0_enabled(x: torch.Tensor) -> bool:
    """Whether :func:`q8_0_matmul` runs for ``x`` (never while ``torch.compile`` traces)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and q8_0_supported(x.dtype)


def _lib() -> ctypes.CDLL:
    lib = load_library().library
    assert lib is not None, "native CPU ops are unavailable (check enabled() first)"
    return lib


def _op(name: str, x: torch.Tensor) -> ctypes._CFuncPtr:
    """The ``_bf16`` or ``_f32`` entry point of op ``name`` for ``x``'s dtype."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the native {name} takes bfloat16 or float32 tensors, not {x.dtype}")
    return getattr(_lib(), f"plinth_{name}_{'bf16' if x.dtype == torch.bfloat16 else 'f32'}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x`` ``[T, H]`` (bfloat16 or float32, features contiguous); with ``residual``
    returns ``(norm(x + residual), x + residual)``."""
    t, n = x.shape
    weight = weight.to(x.dtype).contiguous()
    y = torch.empty((t, n), dtype=x.dtype)
    h = torch.empty((t, n), dtype=x.dtype) if residual is not None else None
    _op("rms_norm", x)(
        x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0, weight.data_ptr(), y.data_ptr(),
        h.data_ptr() if h is not None else None, t, n, eps)
    return y if h is None else (y, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[T, 2d]`` (bfloat16 or float32, features contiguous) ->
    ``[T, d]``."""
    t, two_d = x.shape
    d = two_d // 2
    y = torch.empty((t, d), dtype=x.dtype)
    _op("silu_mul", x)(x.data_ptr(), x.stride(0), y.data_ptr(), t, d)
    return y


def gated_delta_step_enabled(state: torch.Tensor) -> bool:
    """Whether :func:`gated_delta_step` runs on ``state`` (a float32 CPU tensor, the switch on, the library built)."""
    return (state.device.type == "cpu" and state.dtype == torch.float32 and not torch.compiler.is_compiling()
            and _env_enabled() and load_library().library is not None)


def gated_delta_step(state: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One decode token of a gated DeltaNet layer per sequence (see ``plinth_gated_delta_step_f32``): ``state``
    ``[rows, H, K, V]`` float32 (rows contiguous) updated in place at ``rows`` ``[B]``; ``q``, ``k`` ``[B, H, K]``,
    ``v`` ``[B, H, V]``, ``g``, ``beta`` ``[B, H]`` float32. Returns the outputs ``[B, H, V]``, or ``None`` where the
    kernel does not take the shapes (nothing written)."""
    b, h, kd = k.shape
    vd = v.shape[-1]
    if state.shape[1:] != (h, kd, vd) or state.stride(0) != h * kd * vd or not state[0].is_contiguous():
        return None
    q, k, v, g, beta = (t.contiguous().float() for t in (q, k, v, g, beta))
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty((b, h, vd), dtype=torch.float32)
    done = _lib().plinth_gated_delta_step_f32(state.data_ptr(), state.stride(0), rows.data_ptr(), b, h, kd, vd,
                                              q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
                                              beta.data_ptr(), out.data_ptr())
    return out if done == 0 else None


def sampling_enabled(logits: torch.Tensor) -> bool:
    """Whether :func:`sample_rows` runs for ``logits`` (CPU, bfloat16 or float32, switch on, library built)."""
    return logits.device.type == "cpu" and not torch.compiler.is_compiling() and q8_0_supported(logits.dtype)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` drawn from ``softmax(logits / temperature)`` (``[B]``, > 0) by
    the inverse CDF with ``uniforms`` (``[B]`` or ``[B, 1]`` in ``[0, 1)``): the first token whose running
    probability sum exceeds ``uniform * total``, in one native pass per row (no ``[B, V]`` temporaries) ->
    ``int64 [B]``. Sums in float32 per 1,024 tokens and float64 across: where ``uniform * total`` lies within
    float rounding of a boundary between two tokens, the pick may be the neighbour of a float64 search's."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temps = temperature.to(torch.float32).contiguous()
    u = uniforms.to(torch.float64).reshape(-1).contiguous()
    if temps.numel() != rows or u.numel() != rows:
        raise ValueError(f"{rows} rows of logits need {rows} temperatures and uniforms, got {temps.numel()} and "
                         f"{u.numel()}")
    out = torch.empty(rows, dtype=torch.int64)
    _op("sample_rows", logits)(logits.data_ptr(), logits.stride(0), rows, vocab, temps.data_ptr(), u.data_ptr(),
                               out.data_ptr())
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` in place with ``cos``/``sin``
    ``[T, R]`` (bfloat16 or float32, as ``q``); features ``R..D`` are left as they are."""
    t, hq, _ = q.shape
    cos, sin = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
    _op("rotary", q)(q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0), k.stride(1),
                              k.shape[1], cos.data_ptr(), sin.data_ptr(), cos.stride(0), t, cos.shape[-1])


def q8_0_matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int,
                out_dtype: torch.dtype = torch.bfloat16, int8_inputs: bool = False,
                rows8: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (bfloat16 or float32, features contiguous) times a weight ``[N, K]`` stored as GGUF
    ``Q8_0`` blocks ``blocks`` (``uint8 [N, K / 32 * 34]``) -> ``[M, N]`` in ``out_dtype`` (bfloat16, or
    float32: the float32 sums unrounded). ``int8_inputs`` (float32 ``x`` and output, AVX2): the rows quantized to
    int8 per 32 features first (two planes, ~15 bits) and multiplied in integer arithmetic with the blocks
    regrouped by :func:`pack_q8_0_rows8` (``rows8``: that copy made once by the caller; else made here)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the Q8_0 GEMV writes bfloat16 or float32, not {out_dtype}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the Q8_0 GEMV takes bfloat16 or float32 inputs, not {x.dtype}")
    if int8_inputs and (x.dtype != torch.float32 or out_dtype != torch.float32):
        raise ValueError(f"the Q8_0 GEMV takes 8-bit inputs from float32 rows into float32, not {x.dtype} into "
                         f"{out_dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert blocks.shape == (out_features, k // Q8_0_BLOCK * Q8_0_BYTES) and blocks.is_contiguous()
    y = torch.empty((m, out_features), dtype=out_dtype)
    if m == 0:
        return y
    if int8_inputs:
        packed = pack_q8_0_rows8(blocks) if rows8 is None else rows8
        assert packed.shape == ((out_features + 7) // 8, k // Q8_0_BLOCK, 272) and packed.is_contiguous()
        if _lib().plinth_q8_0r8_gemv_f32q8(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), m,
                                           out_features, k):
            raise RuntimeError("the Q8_0 GEMV with 8-bit inputs declined: the library was built without AVX2")
        return y
    gemv = _lib().plinth_q8_0_gemv if x.dtype == torch.bfloat16 else _lib().plinth_q8_0_gemv_f32
    gemv(x.data_ptr(), x.stride(0), blocks.data_ptr(), y.data_ptr(), int(out_dtype == torch.float32), m,
         out_features, k)
    return y


def q8_0_rows8_matmul(x: torch.Tensor, rows8: torch.Tensor, out_features: int) -> torch.Tensor:
    """float32 ``x`` ``[M, K]`` times a ``Q8_0`` weight ``[N, K]`` regrouped by :func:`pack_q8_0_rows8`, in float32
    (each weight ``d q`` exact, float32 sums; the inputs as they are) -> ``[M, N]`` float32 (AVX2)."""
    if x.dtype != torch.float32:
        raise ValueError(f"the regrouped Q8_0 GEMM takes float32 rows, not {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if (k % Q8_0_BLOCK or rows8.dtype != torch.uint8 or not rows8.is_contiguous()
            or tuple(rows8.shape) != ((out_features + 7) // 8, k // Q8_0_BLOCK, 272)):
        raise ValueError(f"rows8 {rows8.dtype} {list(rows8.shape)} is not the regrouped Q8_0 layout of a "
                         f"[{out_features}, {k}] weight (pack_q8_0_rows8; K a multiple of {Q8_0_BLOCK})")
    y = torch.empty((m, out_features), dtype=torch.float32)
    if m and _lib().plinth_q8_0r8_gemm_f32(x.data_ptr(), x.stride(0), rows8.data_ptr(), y.data_ptr(), m, out_features,
                                           k):
        raise RuntimeError("the regrouped Q8_0 GEMM declined: the library was built without AVX2")
    return y


def kv_write_supported(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """:func:`write_kv` takes these tensors: CPU, one dtype (or bfloat16 rows into an FP8 E4M3 cache, float32 rows into
    a bfloat16 cache), contiguous heads, a contiguous cache."""
    same = key.dtype == value.dtype == kv_cache.dtype
    e4m3 = key.dtype == value.dtype == torch.bfloat16 and kv_cache.dtype == torch.float8_e4m3fn
    bf16 = key.dtype == value.dtype == torch.float32 and kv_cache.dtype == torch.bfloat16
    return (kv_cache.device.type == "cpu" and (same or e4m3 or bf16) and kv_cache.is_contiguous()
            and key.dim() == 3 and key.stride(2) == 1 and key.stride(1) == key.shape[2]
            and value.stride(2) == 1 and value.stride(1) == value.shape[2] and _env_enabled()
            and not torch.compiler.is_compiling() and load_library().library is not None)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the ``[2, num_blocks, block_size, Hkv, D]`` cache at
    ``slot_mapping`` (``[>= T]`` int64; a slot outside the cache is skipped), like
    :func:`plinth.attention_backends.interface.write_kv_cache`."""
    n = key.shape[0]
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
        else slot_mapping.to(torch.int64).contiguous()
    elem = key.element_size()
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    if kv_cache.dtype == torch.float8_e4m3fn:   # rounded as to_cache_dtype rounds: clamped to +-448, nearest even
        _lib().plinth_kv_write_e4m3(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                    kv_cache.data_ptr(), num_slots, slots.data_ptr(), min(n, slots.shape[0]),
                                    key.shape[1] * key.shape[2])
        return
    if kv_cache.dtype == torch.bfloat16 and key.dtype == torch.float32:   # rounded to nearest even, as torch rounds
        _lib().plinth_kv_write_f32_bf16(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                        kv_cache.data_ptr(), num_slots, slots.data_ptr(), min(n, slots.shape[0]),
                                        key.shape[1] * key.shape[2])
        return
    _lib().plinth_kv_write(key.data_ptr(), key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem,
                           kv_cache.data_ptr(), num_slots, slots.data_ptr(), min(n, slots.shape[0]),
                           key.shape[1] * key.shape[2] * elem)


@dataclasses.dataclass
class Q4Panels:
    """4-bit weights ``[N, K]`` in the layout of the native panel GEMM: tiles of 16 output rows; per tile
    and k-pair 16 bytes of codes (byte ``j``: low nibble = row ``j // 2`` at k parity ``j % 2``, high
    nibble = row ``8 + j // 2``), and per tile and 32-k group float16 scales and offsets: ``w = d * q + c``."""

    codes: torch.Tensor     # [T, K / 2, 16] uint8
    scales: torch.Tensor    # [T, K / 32, 16] float16
    offsets: torch.Tensor   # [T, K / 32, 16] float16
    out_features: int

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * 32


def pack_q4_panels(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q4Panels:
    """``q`` ``[N, K]`` codes in 0..15, ``scale``/``offset`` ``[N, K / 32]`` (``w = scale * q + offset``,
    exact in float16 for GGUF Q4_0/Q4_1 blocks) -> :class:`Q4Panels` (rows padded to a multiple of 16)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"the input size {k} is not a multiple of 32")
    tiles = -(-n // 16)
    qp = np.zeros((tiles * 16, k), dtype=np.uint8)
    qp[:n] = q.numpy().astype(np.uint8)
    pairs = qp.reshape(tiles, 16, k // 2, 2)                                  # [T, row, k-pair, parity]
    low = pairs[:, :8].transpose(0, 2, 1, 3).reshape(tiles, k // 2, 16)
    high = pairs[:, 8:].transpose(0, 2, 1, 3).reshape(tiles, k // 2, 16)

    def per_tile(v: torch.Tensor) -> torch.Tensor:
        padded = np.zeros((tiles * 16, k // 32), dtype=np.float16)
        padded[:n] = v.numpy().astype(np.float16)
        return torch.from_numpy(np.ascontiguousarray(padded.reshape(tiles, 16, k // 32).transpose(0, 2, 1)))

    return Q4Panels(torch.from_numpy(np.ascontiguousarray(low | (high << 4))), per_tile(scale), per_tile(offset), n)


def _panel_gemm(kernel: str, x: torch.Tensor, panels: Q4Panels | VnniPanels,
                out_cols: int | None = None) -> tuple[int, torch.Tensor]:
    """Call a native GEMM over packed panels (codes, per-block scales and offsets): its return code, ``y``
    ``[M, out_cols]`` (default: the weight's output features)."""
    k_packed = panels.scales.shape[1] * 32
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != k_packed:
        raise ValueError(f"the panel GEMM takes CPU bfloat16 inputs [M, {k_packed}]; got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty((m, out_cols if out_cols is not None else panels.out_features), dtype=torch.bfloat16)
    rc = getattr(_lib(), kernel)(x.data_ptr(), x.stride(0), panels.codes.data_ptr(), panels.scales.data_ptr(),
                                 panels.offsets.data_ptr(), y.data_ptr(), m, panels.out_features, k)
    return rc, y


def _runs(kernel: str, tiny: Q4Panels | VnniPanels) -> bool:
    """Whether a panel GEMM runs here (the library built with the instructions it needs): one 1 x 32 call."""
    return load_library().library is not None and _panel_gemm(kernel, torch.zeros(1, 32, dtype=torch.bfloat16),
                                                               tiny)[0] == 0


def _checked_gemm(kernel: str, x: torch.Tensor, panels: Q4Panels | VnniPanels, needs: str,
                  out_cols: int | None = None) -> torch.Tensor:
    rc, y = _panel_gemm(kernel, x, panels, out_cols)
    if rc != 0:
        raise RuntimeError(f"the native {kernel} needs {needs}")
    return y


_Q4P_GEMM = "plinth_q4p_gemm_bf16"
_Q8V_GEMM = "plinth_q8v_gemm_bf16"


@functools.cache
def q4_panels_supported() -> bool:
    """Whether this CPU runs the panel GEMM (the library was built with AVX512-BF16)."""
    return _runs(_Q4P_GEMM, pack_q4_panels(torch.zeros(16, 32, dtype=torch.int32), torch.zeros(16, 1),
                                           torch.zeros(16, 1)))


_Q4P_AMX = "plinth_q4p_gemm_amx"
AMX_ENV = "PLINTH_CPU_AMX"


@functools.cache
def _amx_ready() -> bool:
    """The library built with AMX-BF16, Linux granting the tile state (asked for here: without it the tile
    instructions fault), and a small product equal to the AVX512-BF16 kernel's."""
    if not q4_panels_supported():
        return False
    if _lib().plinth_amx_init() != 0:
        logger.info("AMX tiles unavailable (not built for them, or the kernel refused the tile state)")
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 64), generator=gen, dtype=torch.int32)
    panels = pack_q4_panels(q, torch.full((48, 2), 0.5), torch.full((48, 2), -4.0))
    x = torch.randint(-8, 8, (33, 64), generator=gen).to(torch.bfloat16)
    rc, y = _panel_gemm(_Q4P_AMX, x, panels)
    return rc == 0 and torch.equal(y, _panel_gemm(_Q4P_GEMM, x, panels)[1])


def amx_switch_on() -> bool:
    """``PLINTH_CPU_AMX`` is not ``0``/``false``/``no``/``off`` (the AMX kernels' switch; default on)."""
    return os.environ.get(AMX_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def q4_amx_supported() -> bool:
    """Whether the panel GEMM runs on AMX tiles here (see :func:`_amx_ready`; ``PLINTH_CPU_AMX=0``, read once,
    turns it off)."""
    return amx_switch_on() and _amx_ready()


def q4_panel_matmul(x: torch.Tensor, panels: Q4Panels, amx: bool | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 times the packed weight -> ``[M, N]`` bfloat16 (float32 accumulation of the
    bfloat16-rounded weights): on AMX tiles where :func:`q4_amx_supported` (``amx=None``) or when ``amx`` is
    True, else AVX512-BF16 dot products. Check :func:`q4_panels_supported` first."""
    if amx if amx is not None else q4_amx_supported():
        if not _amx_ready():
            raise RuntimeError("the AMX panel GEMM needs AMX-BF16 and the tile state (q4_amx_supported() is False)")
        return _checked_gemm(_Q4P_AMX, x, panels, "AMX-BF16")
    return _checked_gemm(_Q4P_GEMM, x, panels, "AVX512-BF16 (q4_panels_supported() is False)")


def q4_panel_silu_mul(x: torch.Tensor, panels: Q4Panels) -> torch.Tensor:
    """``silu(x W_gate^T) * (x W_up^T)`` for a gate/up weight packed as one (``N = 2 I`` output columns, gate then up;
    ``I`` a multiple of 16), ``x`` ``[M, K]`` bfloat16 -> ``[M, I]`` bfloat16, on AMX tiles: the same bits as
    :func:`q4_panel_matmul` then :func:`silu_and_mul` (the sums rounded to bfloat16 before the activation), without
    the ``[M, N]`` intermediate. Check :func:`q4_amx_supported` first."""
    n = panels.out_features
    if n % 32:
        raise ValueError(f"the fused gate/up GEMM needs halves of whole 16-column tiles; {n} outputs are not a "
                         f"multiple of 32")
    if not _amx_ready():
        raise RuntimeError("the fused gate/up GEMM needs AMX-BF16 and the tile state (q4_amx_supported() is False)")
    return _checked_gemm("plinth_q4p_gemm_amx_silu", x, panels, "AMX-BF16", out_cols=n // 2)


@dataclasses.dataclass
class Q8Panels:
    """A GGUF ``Q8_0`` weight ``[N, K]`` regrouped for the AMX GEMM of :func:`q8_panel_matmul`: tiles of 16 output
    rows (the last padded with zero rows); per tile and 32-k block 512 code bytes, k-pair by k-pair the 16 rows'
    two codes side by side, and the 16 rows' float16 scales: ``w = d * q``. The file's bytes in another order."""

    codes: torch.Tensor     # [T, K / 32, 512] int8
    scales: torch.Tensor    # [T, K / 32, 16] float16
    out_features: int

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * Q8_0_BLOCK


def pack_q8_panels(blocks: torch.Tensor) -> Q8Panels:
    """GGUF ``Q8_0`` rows ``blocks`` (``uint8 [N, K / 32 * 34]``) -> :class:`Q8Panels`."""
    n = blocks.shape[0]
    nb = blocks.shape[1] // Q8_0_BYTES
    tiles = -(-n // 16)
    rows = blocks.reshape(n, nb, Q8_0_BYTES)
    if tiles * 16 != n:
        rows = torch.cat([rows, rows.new_zeros(tiles * 16 - n, nb, Q8_0_BYTES)])
    rows = rows.reshape(tiles, 16, nb, Q8_0_BYTES)
    scales = rows[..., :2].contiguous().view(torch.float16).reshape(tiles, 16, nb).transpose(1, 2)   # [T, nb, 16]
    codes = rows[..., 2:].contiguous().view(torch.int8).reshape(tiles, 16, nb, 16, 2)   # [T, row, nb, k-pair, parity]
    return Q8Panels(codes.permute(0, 2, 3, 1, 4).reshape(tiles, nb, 512).contiguous(), scales.contiguous(), n)


def q8_panel_matmul(x: torch.Tensor, panels: Q8Panels) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 times a :class:`Q8Panels` weight -> ``[M, N]`` float32 on AMX tiles: each weight
    ``d q`` rounded to bfloat16 (the bfloat16 weight a GGUF loader converts the file to), float32 sums left
    unrounded. Check :func:`q8_amx_supported` first."""
    k = panels.in_features
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != k:
        raise ValueError(f"the Q8_0 AMX GEMM takes CPU bfloat16 inputs [M, {k}]; got {x.dtype} {list(x.shape)} "
                         f"on {x.device}")
    if not _amx_ready():
        raise RuntimeError("the Q8_0 AMX GEMM needs AMX-BF16 and the tile state (q8_amx_supported() is False)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((x.shape[0], panels.out_features), dtype=torch.float32)
    if x.shape[0] and _lib().plinth_q8p_gemm_amx(x.data_ptr(), x.stride(0), panels.codes.data_ptr(),
                                                 panels.scales.data_ptr(), y.data_ptr(), x.shape[0],
                                                 panels.out_features, k):
        raise RuntimeError("the Q8_0 AMX GEMM declined: the library was built without AMX-BF16")
    return y


def q8_amx_supported() -> bool:
    """Whether :func:`q8_panel_matmul` runs here (AMX tiles, as for :func:`q4_amx_supported`)."""
    return q4_amx_supported()


_Q4P_GEMV = "plinth_q4p_gemv_bf16"
#: the most input rows the panel GEMV takes (more take :func:`q4_panel_matmul`): it reads the codes once and
#: unpacks them again for every four rows, which beats the panel GEMM's bfloat16 expansion up to about a dozen
#: rows (a layer's four GEMMs at 8 rows 240 vs 342 us, at 12 rows 370 vs 425, at 16 rows 472 vs 440)
Q4_GEMV_MAX_ROWS = 12
#: the same where the panel GEMM runs on AMX tiles, whose cost is mostly the bfloat16 expansion, the same for any
#: row count: a step's 30 layers of the default model at 4 / 8 / 12 rows, GEMV 7.8 / 13.8 / 19.4 ms, AMX 14.9 /
#: 12.7 / 11.8 ms (Xeon with AMX, 2 cores, weights cold)
Q4_GEMV_AMX_MAX_ROWS = 8


def q4_gemv_max_rows() -> int:
    """The most rows the panel GEMV should take here (more go to :func:`q4_panel_matmul`)."""
    return Q4_GEMV_AMX_MAX_ROWS if q4_amx_supported() else Q4_GEMV_MAX_ROWS


@functools.cache
def q4_gemv_supported() -> bool:
    """Whether this CPU runs the panel GEMV (the library was built with AVX512-BF16)."""
    return _runs(_Q4P_GEMV, pack_q4_panels(torch.zeros(16, 32, dtype=torch.int32), torch.zeros(16, 1),
                                           torch.zeros(16, 1)))


class Q4Gemv:
    """The panel GEMV of one packed weight, its entry point and pointers resolved once: a call costs the C
    call and the output's allocation (a decode step makes four a layer, so wrapper time counts). Build it
    only where :func:`q4_gemv_supported` is true."""

    ENTRY: ClassVar[str] = "plinth_q4p_gemv_bf16"
    DTYPE: ClassVar[torch.dtype] = torch.bfloat16
    MAX_ROWS: ClassVar[int] = Q4_GEMV_MAX_ROWS
    WHAT: ClassVar[str] = "the panel GEMV"

    def __init__(self, panels: Q4Panels):
        self.panels = panels                       # keeps the tensors behind the pointers alive
        self.out_features = panels.out_features
        self.in_features = panels.in_features
        self._fn = getattr(_lib(), self.ENTRY)
        self._weights = (panels.codes.data_ptr(), panels.scales.data_ptr(), panels.offsets.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` of :attr:`DTYPE` on the CPU, ``1 <= M <=`` :attr:`MAX_ROWS`, features contiguous ->
        ``[M, N]`` of :attr:`DTYPE`: float32 weights ``d * q + c``, float32 accumulation (bfloat16: the inputs
        as they are and the output rounded once)."""
        m, k = x.shape
        if (k != self.in_features or not 1 <= m <= self.MAX_ROWS or x.dtype != self.DTYPE
                or not x.is_cpu or x.stride(1) != 1):
            rows = f"1..{self.MAX_ROWS}" if self.MAX_ROWS < sys.maxsize else "M"
            raise ValueError(f"{self.WHAT} takes CPU {str(self.DTYPE).removeprefix('torch.')} inputs "
                             f"[{rows}, {self.in_features}] with contiguous features; got {x.dtype} "
                             f"{list(x.shape)} (strides {x.stride()}) on {x.device}")
        y = torch.empty((m, self.out_features), dtype=self.DTYPE)
        rc = self._fn(x.data_ptr(), x.stride(0), *self._weights, y.data_ptr(), m, self.out_features, k)
        if rc != 0:
            raise RuntimeError(f"{self.WHAT} declined ({rc}): the library lacks the instructions it needs")
        return y


#: the most input rows the float32 panel GEMV takes
Q4_GEMV_F32_MAX_ROWS = 16


@functools.cache
def q4_gemv_f32_supported() -> bool:
    """Whether this CPU runs the float32 panel GEMV (the library was built with AVX2, FMA and F16C; native ops
    switched on)."""
    if not _env_enabled() or load_library().library is None:
        return False
    tiny = pack_q4_panels(torch.zeros(16, 32, dtype=torch.int32), torch.zeros(16, 1), torch.zeros(16, 1))
    x, y = torch.zeros(1, 32), torch.empty(1, 16)
    return _lib().plinth_q4p_gemv_f32(x.data_ptr(), 32, tiny.codes.data_ptr(), tiny.scales.data_ptr(),
                                      tiny.offsets.data_ptr(), y.data_ptr(), 1, 16, 32) == 0


class Q4GemvF32(Q4Gemv):
    """The float32 panel GEMV (AVX2/FMA): decode rows of float32 models on CPUs without native bfloat16, the
    inputs as they are. Build it only where :func:`q4_gemv_f32_supported` is true."""

    ENTRY: ClassVar[str] = "plinth_q4p_gemv_f32"
    DTYPE: ClassVar[torch.dtype] = torch.float32
    MAX_ROWS: ClassVar[int] = Q4_GEMV_F32_MAX_ROWS
    WHAT: ClassVar[str] = "the float32 panel GEMV"


#: byte ``i`` of every 32 bytes of :func:`q4_quad_codes` is byte ``QUAD_ORDER[i]`` of the panels' 32 (two k-pairs
#: of a tile's 16 columns): in each 16-byte half, column ``c``'s bytes of the two k-pairs side by side (columns
#: 0-3 in the first half, 4-7 in the second; low nibbles columns 0-7, high nibbles 8-15)
QUAD_ORDER = tuple(half + pair * 16 + 2 * c + b for half in (0, 8) for c in range(4) for pair in (0, 1)
                   for b in (0, 1))


def q4_quad_codes(panels: Q4Panels) -> torch.Tensor:
    """The panels' codes in the order of the 8-bit-input GEMM (``plinth_q4p_gemm_f32q8``): each 32-bit word one
    column's codes at four consecutive input features, so its inner loop multiplies them as loaded."""
    # QUAD_ORDER as a permutation of 2-byte units: every 32 bytes are [k-pair 2][half 2][column 4][2 bytes], and
    # become [half][column][k-pair][2 bytes] (a strided copy, ~3.5x faster than gathering by QUAD_ORDER)
    units = panels.codes.contiguous().view(torch.int16).view(-1, 2, 2, 4)
    return units.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(panels.codes.shape)


class Q4GemmF32Q8(Q4GemvF32):
    """The float32 panel GEMM with 8-bit inputs (AVX2 ``vpmaddubsw``), for any number of rows: each input row
    quantized per 32-feature block to int8 (scale ``max |x| / 127``, as GGUF's Q8 activations), the 4-bit codes
    times the codes in exact integer sums, folded per block in float32; the result is the weights times the
    dequantized inputs. It keeps its own copy of the codes, reordered (:func:`q4_quad_codes`); the scales and
    offsets are the panels'. Same support as :class:`Q4GemvF32`."""

    ENTRY: ClassVar[str] = "plinth_q4p_gemm_f32q8"
    MAX_ROWS: ClassVar[int] = sys.maxsize
    WHAT: ClassVar[str] = "the float32 panel GEMM with 8-bit inputs"

    def __init__(self, panels: Q4Panels):
        super().__init__(panels)
        self.quad_codes = q4_quad_codes(panels)
        self._weights = (self.quad_codes.data_ptr(), panels.scales.data_ptr(), panels.offsets.data_ptr())


class PanelWeight(ctypes.Structure):
    """``PlinthPanelWeight`` of ``csrc/cpu_ops.cpp``: one GEMM's 4-bit panels."""

    _fields_ = [("codes", _P), ("scales", _P), ("offsets", _P), ("n", _I), ("k", _I)]

    @classmethod
    def of(cls, panels: Q4Panels, codes: torch.Tensor | None = None) -> PanelWeight:
        """The panels' pointers; ``codes`` in place of theirs (the 8-bit-input GEMM's reordered copy)."""
        codes = panels.codes if codes is None else codes
        return cls(codes.data_ptr(), panels.scales.data_ptr(), panels.offsets.data_ptr(), panels.out_features,
                   panels.in_features)


class DecodeLayer(ctypes.Structure):
    """``PlinthDecodeLayer``: one decoder layer's weights, norms and KV cache for :func:`decode_layers`."""

    _fields_ = [("qkv", PanelWeight), ("o", PanelWeight), ("gate_up", PanelWeight), ("down", PanelWeight),
                ("in_norm", _P), ("post_norm", _P), ("eps", _D), ("post_eps", _D), ("kv_cache", _P),
                ("num_blocks", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_size", _I), ("scale", _D),
                ("sliding_window", _I), ("kv_narrow", _I)]


class DecodeStep(ctypes.Structure):
    """``PlinthDecodeStep``: one step's inputs, buffers and the attention entry point."""

    _fields_ = [("rows", _I), ("width", _I), ("block_size", _I), ("table_width", _I), ("rot_dim", _I),
                ("threads", _I), ("residual", _P), ("cos", _P), ("sin", _P), ("slots", _P), ("lens", _P),
                ("starts", _P), ("tables", _P), ("normed", _P), ("qkv", _P), ("attn", _P), ("o", _P),
                ("gate_up", _P), ("act", _P), ("down", _P), ("out", _P), ("final_norm", _P), ("final_eps", _D),
                ("attention", _P)]


def decode_layers(layers: ctypes.Array, step: DecodeStep, dtype: torch.dtype = torch.bfloat16,
                  int8_inputs: bool = False, amx: bool = False) -> None:
    """Run every layer of a decode step natively (``plinth_decode_layers_bf16``, or ``_f32`` for a float32
    model; ``_f32q8`` with ``int8_inputs``: the GEMVs of :class:`Q4GemmF32Q8`; ``_amx`` with ``amx``: bfloat16, the
    GEMMs of more than :data:`Q4_GEMV_AMX_MAX_ROWS` rows on AMX tiles): the caller owns every pointer's memory and
    keeps it alive. Raises RuntimeError where the kernel declines (bfloat16 without AVX512-BF16, float32 without
    AVX2/FMA/F16C, ``amx`` without :func:`q4_amx_supported`, rows outside ``1..16``; with ``int8_inputs`` or ``amx``
    any row count ``>= 1``)."""
    f32 = dtype == torch.float32
    if int8_inputs and not f32:
        raise ValueError("the native decode step takes 8-bit inputs for float32 models only")
    if amx and (f32 or not _amx_ready()):
        raise RuntimeError("the AMX decode step needs a bfloat16 model and AMX-BF16 (q4_amx_supported() is False)")
    if amx:
        entry = _lib().plinth_decode_layers_amx
    elif f32:
        entry = _lib().plinth_decode_layers_f32q8 if int8_inputs else _lib().plinth_decode_layers_f32
    else:
        entry = _lib().plinth_decode_layers_bf16
    rc = entry(ctypes.addressof(layers), len(layers), ctypes.byref(step))
    if rc != 0:
        need = "AVX2/FMA/F16C" if f32 else "AMX-BF16" if amx else "AVX512-BF16"
        raise RuntimeError(f"the native decode step declined ({rc}: "
                           f"{f'no {need}' if rc == -1 else f'{step.rows} rows'})")


@dataclasses.dataclass
class VnniPanels:
    """Weights ``[N, K]`` as 8-bit codes in the layout of the native VNNI GEMM: tiles of 16 output rows
    (padded to pairs of tiles); per tile and k-quad 64 bytes (byte ``4 j + i``: row ``j`` at ``k = 4 kq + i``),
    and per tile and 32-k block float32 scales and offsets: ``w = d * u + c`` with ``u`` in 0..255."""

    codes: torch.Tensor     # [T, K / 4, 64] uint8
    scales: torch.Tensor    # [T, K / 32, 16] float32
    offsets: torch.Tensor   # [T, K / 32, 16] float32
    out_features: int


def pack_vnni_panels(u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> VnniPanels:
    """``u`` ``[N, K]`` codes in 0..255, ``scale``/``offset`` ``[N, K / 32]`` (``w = scale * u + offset``;
    GGUF Q4_0: ``u = q``, ``offset = -8 scale``; Q4_1: ``offset = min``; Q8_0: ``u = q + 128``,
    ``offset = -128 scale``) -> :class:`VnniPanels`."""
    n, k = u.shape
    if k % 32:
        raise ValueError(f"the input size {k} is not a multiple of 32")
    tiles = 2 * -(-n // 32)
    up = np.zeros((tiles * 16, k), dtype=np.uint8)
    up[:n] = u.numpy().astype(np.uint8)
    codes = up.reshape(tiles, 16, k // 4, 4).transpose(0, 2, 1, 3).reshape(tiles, k // 4, 64)

    def per_tile(v: torch.Tensor) -> torch.Tensor:
        padded = np.zeros((tiles * 16, k // 32), dtype=np.float32)
        padded[:n] = v.numpy().astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(padded.reshape(tiles, 16, k // 32).transpose(0, 2, 1)))

    return VnniPanels(torch.from_numpy(np.ascontiguousarray(codes)), per_tile(scale), per_tile(offset), n)


@functools.cache
def vnni_supported() -> bool:
    """Whether this CPU runs the 8-bit VNNI GEMM (the library was built with AVX512-VNNI and -BF16)."""
    return _runs(_Q8V_GEMM, pack_vnni_panels(torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 1),
                                             torch.zeros(16, 1)))


def vnni_matmul(x: torch.Tensor, panels: VnniPanels) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 times the packed weight -> ``[M, N]`` bfloat16, with ``x`` quantized to int8 per
    row and 32-k block (scale ``max |x| / 127``) and exact integer block dot products. Check
    :func:`vnni_supported` first."""
    return _checked_gemm(_Q8V_GEMM, x, panels, "AVX512-VNNI and AVX512-BF16 (vnni_supported() is False)")


def vnni_from_q4_panels(panels: Q4Panels) -> VnniPanels:
    """The same 4-bit weights in the VNNI layout (codes unpacked to bytes; scales and offsets as float32)."""
    codes = panels.codes.numpy()                                   # [T, K/2, 16]
    tiles, kpairs, _ = codes.shape
    low, high = codes & 0x0F, codes >> 4                           # rows 0..7 / 8..15, [T, K/2, (row, parity)]
    u = np.empty((tiles, 16, kpairs, 2), dtype=np.uint8)
    u[:, :8] = low.reshape(tiles, kpairs, 8, 2).transpose(0, 2, 1, 3)
    u[:, 8:] = high.reshape(tiles, kpairs, 8, 2).transpose(0, 2, 1, 3)
    n, k = panels.out_features, kpairs * 2
    rows = lambda v: torch.from_numpy(v.numpy().transpose(0, 2, 1).reshape(tiles * 16, -1)[:n])  # noqa: E731
    return pack_vnni_panels(torch.from_numpy(u.reshape(tiles * 16, k)[:n]), rows(panels.scales), rows(panels.offsets))


def vnni_from_q8_0(blocks: torch.Tensor, out_features: int) -> VnniPanels:
    """GGUF ``Q8_0`` blocks (``uint8 [N, K / 32 * 34]``: a float16 scale, then 32 int8 codes) in the VNNI layout:
    ``u = q + 128``, ``offset = -128 scale`` (exact)."""
    raw = blocks.numpy().reshape(out_features, -1, Q8_0_BYTES)
    scale = raw[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)     # [N, K/32]
    u = (raw[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)     # [N, K/32, 32]
    return pack_vnni_panels(torch.from_numpy(u.reshape(out_features, -1)), torch.from_numpy(scale),
                            torch.from_numpy(-128.0 * scale))
