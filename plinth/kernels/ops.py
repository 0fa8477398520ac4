"""Launchers for the Triton kernels of :mod:`plinth.kernels.triton_jit`, and when the layers use them.

The model layers call :func:`fused_ops_enabled` with their input: on devices Triton compiles for
(``cuda`` — NVIDIA and ROCm builds — and ``xpu``) the small per-layer ops run as one fused kernel
each, and bfloat16 and float32 tensors on CPUs take the native kernels of :mod:`plinth.kernels.cpu_native`;
elsewhere, or with ``PLINTH_FUSED_OPS=0``, the layers keep their plain torch code (the reference). The skinny GEMM is installed per layer by the GPU fast path (:mod:`plinth.worker.gpu_linear`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any, NamedTuple

import torch

from plinth.kernels import cpu_native

FUSED_OPS_ENV = "PLINTH_FUSED_OPS"
_TRITON_DEVICE_TYPES = ("cuda", "xpu")
#: the most rows the skinny GEMM takes (decode batches); larger inputs go to the vendor GEMM
SKINNY_MAX_M = 16


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_fp8_refusal(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why Triton cannot widen float8_e4m3fn bytes on this device (``None``: it can): ROCm builds use the
    float8_e4m3fnuz format, NVIDIA GPUs before compute capability 8.9 have no E4M3 conversion."""
    if getattr(torch.version, "hip", None):
        return "ROCm uses the float8_e4m3fnuz format, not float8_e4m3fn"
    if device_type == "cuda" and (capability is None or capability < (8, 9)):
        return f"Triton widens float8_e4m3fn on compute capability 8.9 and newer, this GPU has {capability}"
    return None


@functools.lru_cache(maxsize=1)
def jit_module() -> ModuleType:
    """The ``@triton.jit`` kernels (Triton's interpreter when ``PLINTH_TRITON_INTERPRET=1``)."""
    if os.environ.get("PLINTH_TRITON_INTERPRET") == "1":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module("plinth.kernels.triton_jit")


@functools.lru_cache(maxsize=1)
def _env_enabled() -> bool:
    return os.environ.get(FUSED_OPS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def fused_ops_enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``x``: Triton on GPUs, the native kernels for bfloat16 and float32
    on CPUs (:mod:`plinth.kernels.cpu_native`)."""
    if x.device.type in _TRITON_DEVICE_TYPES:   # CPUs only where a test lists them (Triton's interpreter)
        return triton_available() and _env_enabled()
    return x.device.type == "cpu" and _native_cpu(x) and cpu_native.layer_ops_enabled(x) and _env_enabled()


def _native_cpu(x: torch.Tensor) -> bool:
    """A CPU tensor takes the native kernel (the Triton launchers run on the CPU only in the
    interpreter, under ``PLINTH_TRITON_INTERPRET=1``, for tests)."""
    return x.device.type == "cpu" and os.environ.get("PLINTH_TRITON_INTERPRET") != "1"


def dependent_options(x: torch.Tensor) -> dict[str, bool]:
    """Launch options of a Triton kernel on ``x``'s device that starts with
    :func:`~plinth.kernels.triton_jit.dependent_start`: where the decode steps run W4A16 GEMVs that stream
    their weights before waiting (:func:`plinth.kernels.nvrtc.prefetching_kernels`) it is launched as a
    dependent of the kernel before it (``DEPENDENT`` and ``launch_pdl``), so its launch overlaps that
    kernel's end, and lets the next kernel start once it runs (a GEMV then streams its weights meanwhile).
    It waits for the kernel before it first, so eager and captured launches alike are safe, and take the
    same compiled variant (the warm-up before a capture compiles it). Elsewhere none: next to cuBLAS GEMMs
    (bfloat16 models) dependent launches made a decode step slower (benchmarks/RESULTS.md)."""
    if x.device.type != "cuda" or os.environ.get("PLINTH_TRITON_INTERPRET") == "1" or not jit_module().HAS_GDC:
        return {}   # (Triton's interpreter runs no programmatic launches)
    from plinth.kernels import nvrtc

    return {"DEPENDENT": True, "launch_pdl": True} if nvrtc.prefetching_kernels(x.device) else {}


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class QuantizedRows(NamedTuple):
    """Activations quantized per row for a W8A8 GEMM: ``data`` ``[M, K]`` (``float8_e4m3fn`` ...) with
    ``scale`` ``[M, 1]`` float32, ``data * scale`` the values. Made by the kernel before the GEMM (an RMSNorm,
    SiLU-and-mul) where the GEMM's kernel asks for it (:attr:`RowQuant`)."""

    data: torch.Tensor
    scale: torch.Tensor


class RowQuant(NamedTuple):
    """How a GEMM kernel wants its input rows quantized: ``scale = max|row| / qmax``, values clamped to
    ``[-qmax, qmax]`` and cast to ``dtype``, a floating-point type (``float8_e4m3fn``: the cast rounds to
    nearest; a cast to an integer type would truncate, so integer codes are refused)."""

    dtype: torch.dtype
    qmax: float


def _check_quant(quant: RowQuant) -> None:
    if not quant.dtype.is_floating_point:
        raise ValueError(f"rows quantized by the norm or activation kernels must be floating point (float8), "
                         f"not {quant.dtype}: the kernels' cast would truncate integer codes")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quant: RowQuant | None = None) -> Any:
    """RMSNorm of the rows of ``x`` ``[T, H]``; with ``residual`` returns ``(norm(x + residual), x + residual)``.

    With ``quant`` (Triton devices; ignored on CPUs) the normalized rows come back as :class:`QuantizedRows`,
    equal to :func:`quantize_rows` of the unquantized output.
    """
    if _native_cpu(x):
        return cpu_native.rms_norm(x, weight, eps, residual)
    t, n = x.shape
    if quant is not None:
        _check_quant(quant)
    if quant is None:
        y = torch.empty_like(x)
        scale = y
    else:
        y = torch.empty((t, n), dtype=quant.dtype, device=x.device)
        scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    block = _block(n)
    jit_module().rmsnorm_kernel[(t,)](
        x, r, weight, y, h, scale, n, x.stride(0), r.stride(0), y.stride(0), h.stride(0), eps,
        quant.qmax if quant is not None else 1.0,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        QUANT=quant is not None, **dependent_options(x),
    )
    out = y if quant is None else QuantizedRows(y, scale)
    return out if residual is None else (out, h)


#: the most features of a row :func:`silu_and_mul` quantizes in one pass (the row in registers); longer rows
#: take two passes of this many features at a time
_SILU_QUANT_ROW = 16384


def silu_and_mul(x: torch.Tensor, quant: RowQuant | None = None) -> Any:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[T, 2d]``; with ``quant`` (Triton devices; ignored on CPUs)
    as :class:`QuantizedRows`, equal to :func:`quantize_rows` of the unquantized output."""
    if _native_cpu(x):
        return cpu_native.silu_and_mul(x)
    t, two_d = x.shape
    d = two_d // 2
    if quant is not None:
        _check_quant(quant)
        y = torch.empty((t, d), dtype=quant.dtype, device=x.device)
        scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
        if t:   # a row per program, in registers up to 16384 features (16 warps: 32 per lane)
            block = min(_SILU_QUANT_ROW, _block(d))
            jit_module().silu_mul_quant_kernel[(t,)](x, y, scale, d, x.stride(0), y.stride(0), quant.qmax,
                                                     BLOCK=block, ONE_PASS=block >= d,
                                                     num_warps=min(16, max(4, block // 1024)),
                                                     **dependent_options(x))
        return QuantizedRows(y, scale)
    y = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = min(1024, _block(d))
    jit_module().silu_mul_kernel[(t, -(-d // block))](x, y, d, x.stride(0), y.stride(0), BLOCK=block,
                                                      num_warps=4, **dependent_options(x))
    return y


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` in place with ``cos``/``sin`` ``[T, R]``.

    The last dimension of ``q``/``k`` must be contiguous; features ``R..D`` are left as they are.
    """
    if _native_cpu(q):
        cpu_native.rotary_(q, k, cos, sin)
        return
    t, hq, _ = q.shape
    hk = k.shape[1]
    half = cos.shape[-1] // 2
    cos, sin = cos.contiguous(), sin.contiguous()
    jit_module().rotary_kernel[(t,)](
        q, k, cos, sin, hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=min(16, _block(max(hq, hk))), BLOCK_D=_block(half), num_warps=4,
    )


@dataclasses.dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape of :func:`skinny_linear`."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(m: int, n: int, k: int, num_sms: int) -> SkinnyTiles | None:
    """A launch shape for ``[m, k] @ [n, k].T``, or ``None`` when ``k`` has no usable tile.

    From a sweep on an H200 (benchmarks/skinny_gemm_gpu.py): one row streams best with narrow column
    tiles (8 weight rows of 512 features per step, many programs); several rows with 32 columns of
    256 features. K is split only when the columns alone cannot fill the machine.
    """
    widest = 512 if m == 1 else 256
    block_k = next((b for b in (512, 256, 128, 64, 32, 16) if b <= widest and k % b == 0), None)
    if block_k is None:
        return None
    block_n = 8 if m == 1 else 32
    split = 1
    while -(-n // block_n) * split < 2 * num_sms and k % (block_k * split * 2) == 0 and k // (split * 2) >= 1024:
        split *= 2
    return SkinnyTiles(block_n, block_k, split, num_warps=4, num_stages=2 if m == 1 else 3)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` with ``M <= 16``, ``weight`` ``[N, K]`` contiguous.

    Raises:
        ValueError: ``M`` above :data:`SKINNY_MAX_M`, or ``K`` not a multiple of the tile.
    """
    m, k = x.shape
    n = weight.shape[0]
    if m > SKINNY_MAX_M:
        raise ValueError(f"skinny_linear takes at most {SKINNY_MAX_M} rows, got {m}")
    if m == 0:   # nothing to compute (the one-row path would read and write row 0 of empty tensors)
        y = x.new_empty((0, n))
        return y if bias is None else y + bias
    tiles = tiles or default_tiles(m, n, k, num_sms(x.device))
    if tiles is None or k % (tiles.block_k * tiles.split_k):
        raise ValueError(f"input size {k} is not a multiple of the tile ({tiles})")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if tiles.split_k == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    jit_module().skinny_gemm_kernel[(-(-n // tiles.block_n), tiles.split_k)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=16, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k, USE_DOT=m > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if tiles.split_k > 1:
        y = y.to(x.dtype)
    return y if bias is None else y + bias


def quantize_rows(x: torch.Tensor, out_dtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantization of ``x`` ``[M, K]``: (``[M, K]`` of ``out_dtype``, ``[M, 1]`` float32 scales)
    with ``scale = max|row| / qmax`` and values clamped to ``[-qmax, qmax]`` (cast by the kernel: rounding to
    nearest for float8 outputs)."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        jit_module().quant_rows_kernel[(m,)](x, y, scale, k, x.stride(0), y.stride(0), qmax,
                                             BLOCK=min(2048, _block(k)), num_warps=4)
    return y, scale


#: the most tokens the LoRA kernels take (decode batches); larger steps run the adapters as two masked GEMMs
LORA_KERNEL_MAX_TOKENS = 16


def moe_gemv_enabled(x: torch.Tensor) -> bool:
    """Whether the experts of ``x``'s rows may run :func:`moe_gemv` (Triton devices, or its interpreter in tests)."""
    return _triton_kernels_run(x)


def moe_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor,
             row_div: int, scales: Any = None, int_codes: tuple[int, int, torch.Tensor, torch.Tensor] | None = None,
             silu_mul_input: bool = False) -> torch.Tensor:
    """``y[s] = x[s // row_div] @ weight[experts[s]].T (+ bias[experts[s]])`` for every slot ``s``: ``x``
    ``[R, K]``, ``weight`` ``[E, N, K]`` (``K`` contiguous), ``bias`` ``[E, N]``, ``experts`` ``[S]`` ->
    ``[S, N]`` in ``x``'s dtype. No host read of ``experts`` (a device graph can capture it). With ``scales``
    (:class:`~plinth.quantization.fp8_experts.ExpertScales`), ``weight`` holds FP8 E4M3 bytes (uint8); with
    ``int_codes`` ``(bits, group, scales, zeros)`` (4 or 8 bits; ``scales``/``zeros`` ``[E, N, K / group]`` float32)
    it holds integer codes (``[E, N, K / 2]`` two per byte, low nibble first, at 4 bits), widened as
    ``(q - zero) * scale``. With ``silu_mul_input`` each row of ``x`` is ``[gate | up]`` (``[R, 2K]``) and the
    kernel multiplies ``silu(gate) * up`` (computed in float32 as it reads them: no activation tensor)."""
    e, n, kw = weight.shape
    k = x.shape[-1] // 2 if silu_mul_input else x.shape[-1]
    assert weight.stride(-1) == 1 and x.stride(-1) == 1
    assert kw == (k // 2 if int_codes is not None and int_codes[0] == 4 else k)
    assert bias is None or bias.stride(-1) == 1
    slots = experts.shape[0]
    y = torch.empty((slots, n), dtype=x.dtype, device=x.device)
    block_n, block_k = 32, 128
    s, z, s_strides, sbn, sbk = _expert_format(weight, k, block_k, scales, int_codes)
    jit_module().moe_gemv_kernel[(slots, -(-n // block_n))](
        x, weight, bias if bias is not None else weight, s, z, y, experts, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, y.stride(0),
        *s_strides, ROW_DIV=row_div, HAS_BIAS=bias is not None, W_FP8=scales is not None, SBN=sbn, SBK=sbk,
        BLOCK_N=block_n, BLOCK_K=block_k, W_INT=int_codes is not None,
        BITS=int_codes[0] if int_codes is not None else 8, ACT_IN=silu_mul_input, num_warps=4,
    )
    return y


def _expert_format(weight: torch.Tensor, k: int, block_k: int, scales: Any,
                   int_codes: tuple[int, int, torch.Tensor, torch.Tensor] | None) -> tuple[Any, ...]:
    """The expert kernels' scale arguments ``(s, z, (strides of s), SBN, SBK)`` for float experts, FP8
    ``scales`` or ``int_codes`` (see :func:`moe_gemv`)."""
    if int_codes is not None:
        bits, group, s, z = int_codes
        assert bits in (4, 8) and s.shape == z.shape and s.stride() == z.stride() and (bits == 8 or group % 2 == 0)
        return s, z, (s.stride(0), s.stride(1), s.stride(2)), 1, group
    if scales is None:
        return weight, weight, (0, 0, 0), 1, block_k
    s = scales.scale   # a per-channel scale covers the whole row: any multiple of BLOCK_K at least K
    sbk = scales.cols if scales.cols < k else -(-k // block_k) * block_k
    return s, weight, (s.stride(0), s.stride(1), s.stride(2)), scales.rows, sbk


#: rows of one expert a program of :func:`moe_grouped_gemm` multiplies (by default)
MOE_GROUPED_BLOCK_M = 32
#: :func:`moe_grouped_gemm`'s default ``(BLOCK_N, BLOCK_K, warps, stages)``
MOE_GROUPED_TILES = (64, 64, 4, 2)


def moe_grouped_tiles(slots: int, num_experts: int, int_weights: bool,
                      float32_weights: bool = False) -> tuple[int, tuple[int, int, int, int]]:
    """``(block_m, (BLOCK_N, BLOCK_K, warps, stages))`` for a :func:`moe_grouped_gemm` step of ``slots`` token
    copies over ``num_experts`` experts, by the rows an expert gets on average: blocks of 16 rows (less padding in
    each expert's last block) below 64, and of 64 rows from there for float and FP8 weights (4-bit ones, widened
    with more work per weight, keep 16); 128 x 64 weight tiles, 4 warps, 3 stages. Timed on an H100 with
    ``benchmarks/moe_experts.py --sweep-tiles`` (Qwen3-30B-A3B's expert shapes; benchmarks/RESULTS.md): against
    the former 32-row, 64 x 64, 2-stage tiles, 1.45-2.0x faster at 32 and 256 tokens and 2.1-2.3x at 2,048 (FP8
    and 4-bit experts); a batch-32 decode step of the whole model with FP8 experts 33.8 -> 21.6 ms. Float32 weights
    (float32 models) keep the former tiles: three stages of 128 x 64 float32 tiles would not fit the shared memory of
    smaller GPUs."""
    if float32_weights:
        return MOE_GROUPED_BLOCK_M, MOE_GROUPED_TILES
    block_m = 64 if slots >= 64 * num_experts and not int_weights else 16
    return block_m, (128, 64, 4, 3)


class SortedSlots(NamedTuple):
    """Slots sorted by expert for :func:`moe_grouped_gemm` (see :func:`moe_sorted_blocks`)."""

    order: torch.Tensor        # [S] the slots in expert order
    block_ends: torch.Tensor   # [E] int32 cumulative count of block_m-row blocks per expert
    row_ends: torch.Tensor     # [E] int32 cumulative count of slots per expert
    block_m: int


def moe_sorted_blocks(ids: torch.Tensor, num_experts: int, block_m: int = MOE_GROUPED_BLOCK_M) -> SortedSlots:
    """The slots ``t * K + j`` of expert ids ``ids`` ``[T, K]`` sorted by expert, for :func:`moe_grouped_gemm`,
    with the cumulative counts of ``block_m``-row blocks and of slots per expert (all on the device: no host
    read)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    blocks = (counts + (block_m - 1)) // block_m
    return SortedSlots(order, blocks.cumsum(0, dtype=torch.int32), counts.cumsum(0, dtype=torch.int32), block_m)


def moe_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     sorted_blocks: SortedSlots, *, gather_div: int | None,
                     scatter_out: bool, scales: Any = None,
                     int_codes: tuple[int, int, torch.Tensor, torch.Tensor] | None = None,
                     silu_mul_input: bool = False, tiles: tuple[int, int, int, int] = MOE_GROUPED_TILES) -> torch.Tensor:
    """Every expert's slots times its weight, in blocks of up to :data:`MOE_GROUPED_BLOCK_M` slots of one expert,
    the weights widened in registers (FP8 ``scales``, ``int_codes`` as for :func:`moe_gemv`) and multiplied on the
    tensor cores (bfloat16/float16; float32 inputs in float32): the prefill-sized steps of mixture-of-experts
    layers, with no host read (``sorted_blocks`` from :func:`moe_sorted_blocks`).

    Input row of sorted position ``m``: ``x[order[m] // gather_div]`` (``gather_div``: top-k, rows of tokens), or
    ``x[m]`` (``None``: rows already in sorted order). Output ``[S, N]`` in ``x``'s dtype, row ``order[m]`` with
    ``scatter_out`` (slot order), else ``m`` (sorted order). ``silu_mul_input``: rows are ``[gate | up]``.
    ``tiles``: ``(BLOCK_N, BLOCK_K, warps, stages)``.
    """
    order, block_ends, row_ends, block_m = sorted_blocks
    e, n, kw = weight.shape
    k = x.shape[-1] // 2 if silu_mul_input else x.shape[-1]
    assert weight.stride(-1) == 1 and x.stride(-1) == 1
    assert kw == (k // 2 if int_codes is not None and int_codes[0] == 4 else k)
    slots = order.shape[0]
    y = torch.empty((slots, n), dtype=x.dtype, device=x.device)
    if slots == 0:
        return y
    block_n, block_k, warps, stages = tiles
    s, z, s_strides, sbn, sbk = _expert_format(weight, k, block_k, scales, int_codes)
    grid = (-(-slots // block_m) + e, -(-n // block_n))
    jit_module().moe_grouped_kernel[grid](
        x, weight, bias if bias is not None else weight, s, z, y, order, block_ends, row_ends, e, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0, y.stride(0),
        *s_strides, GATHER_IN=gather_div is not None, ROW_DIV=gather_div or 1, SCATTER_OUT=scatter_out,
        HAS_BIAS=bias is not None, W_FP8=scales is not None, W_INT=int_codes is not None,
        BITS=int_codes[0] if int_codes is not None else 8, SBN=sbn, SBK=sbk, ACT_IN=silu_mul_input,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=_block(e),
        num_warps=warps, num_stages=stages,
    )
    return y


#: the most experts :func:`moe_route` takes (one token's logits in one block)
MOE_ROUTE_MAX_EXPERTS = 1024


def moe_route_enabled(logits: torch.Tensor, top_k: int) -> bool:
    """Whether router ``logits`` ``[T, E]`` may be routed by :func:`moe_route`."""
    return 0 < top_k <= logits.shape[-1] <= MOE_ROUTE_MAX_EXPERTS and _triton_kernels_run(logits)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in one launch: ``logits`` ``[T, E]`` -> (weights ``[T, K]`` float32, the top-k
    softmax probabilities, divided by their sum with ``renormalize``; expert ids ``[T, K]`` int64), as
    ``torch.topk(softmax(logits.float()), K)`` (largest first)."""
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        jit_module().moe_route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                                            BLOCK_K=_block(top_k), RENORM=renormalize, BLOCK_E=_block(e),
                                            num_warps=4 if e > 256 else 1)
    return weights, ids


def moe_combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The experts' outputs of each token weighted and summed in one launch: ``y`` ``[T * K, H]`` (slot
    ``t * K + j``: token ``t``'s ``j``-th expert), ``weights`` ``[T, K]`` -> ``[T, H]`` of ``out_dtype`` (summed in
    float32)."""
    t, k = weights.shape
    h = y.shape[-1]
    y = y if y.stride(-1) == 1 else y.contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty((t, h), dtype=out_dtype, device=y.device)
    if t:
        block = min(1024, _block(h))
        jit_module().moe_combine_kernel[(t, -(-h // block))](y, weights, out, h, y.stride(0), out.stride(0),
                                                             TOP_K=k, BLOCK_H=block, num_warps=4)
    return out


def gated_delta_step_enabled(state: torch.Tensor) -> bool:
    """Whether :func:`gated_delta_step` runs on ``state`` (float32, a Triton device)."""
    return state.dtype == torch.float32 and _triton_kernels_run(state)


def gated_delta_step(state: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One decode token of a gated DeltaNet layer per sequence, in one launch (``gated_delta_step_kernel``):
    ``state`` ``[rows, H, K, V]`` float32 updated in place at ``rows`` ``[B]`` (on the device: CUDA graphs
    capture it); ``q``, ``k`` ``[B, H, K]``, ``v`` ``[B, H, V]``, ``g``, ``beta`` ``[B, H]``. Returns the outputs
    ``[B, H, V]`` float32, or ``None`` where the state's rows are not contiguous heads (nothing written)."""
    b, h, kd = k.shape
    vd = v.shape[-1]
    if state.shape[1:] != (h, kd, vd) or not state[0].is_contiguous():
        return None
    q, k, v, g, beta = (t.contiguous().float() for t in (q, k, v, g, beta))
    out = torch.empty((b, h, vd), dtype=torch.float32, device=state.device)
    if b:
        block_k = max(16, 1 << (kd - 1).bit_length())
        block_v = max(16, min(1 << (vd - 1).bit_length(), 4096 // block_k))
        jit_module().gated_delta_step_kernel[(b, h, _cdiv(vd, block_v))](
            state, rows, q, k, v, g, beta, out, state.stride(0), h, kd, vd, BLOCK_K=block_k, BLOCK_V=block_v,
            num_warps=4)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_kernels_run(x: torch.Tensor) -> bool:
    """Whether Triton kernels may run on ``x``: a Triton device, or the interpreter in tests."""
    return triton_kernels_on(x.device)


def triton_kernels_on(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device`` (a Triton device, or the interpreter in tests; Triton installed; not
    turned off by ``PLINTH_FUSED_OPS=0``)."""
    return ((device.type in _TRITON_DEVICE_TYPES or os.environ.get("PLINTH_TRITON_INTERPRET") == "1")
            and triton_available() and _env_enabled())


def lora_kernels_enabled(x: torch.Tensor) -> bool:
    """Whether a LoRA product of ``x`` runs the Triton kernels (:func:`lora_shrink_expand_`)."""
    return x.shape[0] <= LORA_KERNEL_MAX_TOKENS and _triton_kernels_run(x)


def lora_shrink_expand_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
    """``y[t] += (x[t] A[:, s]^T) B[:, :, s]^T`` with ``s = slots[t]`` (nothing where ``s < 0``), in place: the
    adapter product of a few tokens reading only each token's slot (Punica's BGMV).

    Shapes: ``x`` ``[T, IN]``, ``a`` ``[K, S, R, IN]``, ``b`` ``[OUT, K, S, R]`` (both contiguous), ``slots``
    ``[T]`` int32, ``y`` ``[T, OUT]`` with contiguous rows.
    """
    t, n_in = x.shape
    k, s, r, _ = a.shape
    out = b.shape[0]
    kr = k * r
    xa = torch.empty((t, kr), dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    rows = 2
    mod = jit_module()
    mod.lora_shrink_kernel[(t, -(-kr // rows))](x, a, slots, xa, n_in, s, x.stride(0), KR=kr, R=r, ROWS=rows,
                                                BLOCK_IN=min(1024, _block(n_in)), num_warps=4)
    kr_p = _block(kr)
    block_out = max(16, min(128, 4096 // kr_p))
    mod.lora_expand_kernel[(t, -(-out // block_out))](xa, b, slots, y, out, s, y.stride(0), KR=kr, R=r, KR_P=kr_p,
                                                      BLOCK_OUT=block_out, num_warps=4)
    return y
