"""The Triton W4A16 kernel as a selectable GEMM candidate (CUDA, ROCm, XPU; the interpreter on CPU)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from plinth.kernels.ops import num_sms
from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.dequant import perm_state, permute_input
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.packing import pack_int32

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_DEVICE_TYPES = ("cuda", "xpu")
_INTERPRETER_SMS = 4


def interpret_requested() -> bool:
    """Run Triton kernels in its CPU interpreter (tests): ``PLINTH_TRITON_INTERPRET=1`` or ``TRITON_INTERPRET=1``."""
    return os.environ.get("PLINTH_TRITON_INTERPRET") == "1" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=4)
def load_jit_module(name: str = "plinth.quantization.kernels.w4a16_triton_jit") -> ModuleType:
    """Import a ``@triton.jit`` module; Triton decides between compiling and interpreting at
    decoration time, so ``TRITON_INTERPRET`` is set first when the interpreter is asked for."""
    if os.environ.get("PLINTH_TRITON_INTERPRET") == "1":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module(name)


def triton_refusal(problem: GemmProblem) -> Support | None:
    """Why a Triton GEMM kernel cannot run ``problem``'s device and dtype (``None``: it can): GPUs (cuda, xpu), or
    the CPU under Triton's interpreter in float32/float16."""
    if importlib.util.find_spec("triton") is None:
        return Support.no("triton not installed")
    if problem.device_type == "cpu":
        if not interpret_requested():
            return Support.no("triton kernels need a GPU; set PLINTH_TRITON_INTERPRET=1 to run them in the "
                              "interpreter")
        if problem.dtype == torch.bfloat16:
            return Support.no("bfloat16 is not computed correctly by Triton's interpreter")
    elif problem.device_type not in _GPU_DEVICE_TYPES:
        return Support.no(f"triton kernels run on cuda and xpu devices, not {problem.device_type!r}")
    if problem.dtype not in _DTYPES:
        return Support.no(f"dtype {problem.dtype} unsupported (float16, bfloat16, float32)")
    return None


@dataclasses.dataclass(frozen=True)
class W4A16Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def choose_tiles(m: int, n: int, k: int, group_size: int, num_sms: int) -> W4A16Tiles:
    """Tiles for one call: small-M (decode) calls split K to give every SM work; large M uses big tiles.

    The figures are starting points for an H200-class GPU (132 SMs); they are not tuned yet.
    """
    block_k = next(b for b in (128, 64, 32, 16) if group_size % b == 0 and k % b == 0)
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 3
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 3
        block_k = min(block_k, 64)
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
        block_k = min(block_k, 64)
    tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = k // block_k
    split = 1
    if m <= 64 and tiles < num_sms:  # memory-bound GEMMs: split K until every SM streams weights
        split = max(1, min(k_tiles // 2 or 1, (2 * num_sms) // max(tiles, 1), 16))
    return W4A16Tiles(block_m, block_n, block_k, split, warps, stages)


def interleave_tile(k: int, group_size: int) -> int:
    """The span of input features the packed words interleave (see the kernel module): the widest of
    512..16 that divides both ``k`` and the group, so that every span lies in one group."""
    return next((t for t in (512, 256, 128, 64, 32, 16) if k % t == 0 and group_size % t == 0), 16)


def interleave_codes(q: torch.Tensor, tile: int) -> torch.Tensor:
    """``[N, K]`` codes reordered so that packing runs of eight gives the interleaved words."""
    n, k = q.shape
    return q.reshape(n, k // tile, 8, tile // 8).transpose(2, 3).reshape(n, k)


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    block_n: int
    spans: int
    split_k: int
    num_warps: int


def _override(name: str, fields: int, powers_of_two: int) -> tuple[int, ...] | None:
    """A launch forced through ``$name``: ``fields`` positive integers, the first ``powers_of_two`` of them
    powers of two (tile sizes)."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        parts = tuple(int(v) for v in value.split(","))
    except ValueError:
        parts = ()
    if (len(parts) != fields or any(v <= 0 for v in parts)
            or any(v & (v - 1) for v in parts[:powers_of_two])):
        raise ValueError(f"{name}={value!r}: expected {fields} comma-separated positive integers, the first "
                         f"{powers_of_two} powers of two")
    return parts


def _ignored(name: str, why: str) -> None:
    warnings.warn(f"{name} ignored for this product: {why}", RuntimeWarning, stacklevel=3)


def gemv_tiles(n: int, k: int, tile: int, num_sms: int) -> GemvTiles:
    """The one-row kernel's launch (swept on an H200 with ``benchmarks/skinny_gemm_gpu.py --parts w4mma``):
    sixteen spans per step where they divide ``k``, narrow output blocks, and a K split only where the
    output blocks alone would leave SMs idle. ``PLINTH_W4A16_GEMV="BN,SPANS,SPLIT,WARPS"`` overrides
    (tuning sweeps)."""
    forced = _override("PLINTH_W4A16_GEMV", 4, 2)
    if forced and k % (tile * forced[1] * forced[2]) == 0:
        return GemvTiles(*forced)
    if forced:
        _ignored("PLINTH_W4A16_GEMV", f"SPANS x SPLIT x {tile} does not divide the input size {k}")
    spans = next(s for s in (16, 8, 4, 2, 1) if k % (tile * s) == 0)
    block_n = 16 if n >= 6144 else 8
    split = 1
    while -(-n // block_n) * split < 2 * num_sms and k % (tile * spans * split * 2) == 0:
        split *= 2
    return GemvTiles(block_n, spans, split, 4)


@dataclasses.dataclass(frozen=True)
class MmaTiles:
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


def mma_tiles(n: int, k: int, group: int) -> MmaTiles:
    """The few-row tensor-core kernel's launch (the same sweep); ``PLINTH_W4A16_MMA="BN,SPLIT,WARPS,STAGES"``
    overrides."""
    forced = _override("PLINTH_W4A16_MMA", 4, 1)
    if forced and (k // group) % forced[1] == 0:
        return MmaTiles(*forced)
    if forced:
        _ignored("PLINTH_W4A16_MMA", f"SPLIT does not divide the {k // group} groups")
    block_n, split = (128, 2) if n >= 16384 else (64, 4)
    while split > 1 and (k // group) % split:
        split //= 2
    return MmaTiles(block_n, split, 2, 3)


#: the most rows the tensor-core decode kernel takes (one 16-row block per program)
MMA_MAX_ROWS = 16
#: the narrowest span it takes: each nibble plane is one ``tl.dot`` over TILE / 8 features, and the GPUs'
#: 16-bit dots need at least 16 (groups of 32 or 64 send their few-row inputs to the GEMM instead)
MMA_MIN_TILE = 128


def _output(m: int, n: int, split: int, x: torch.Tensor) -> torch.Tensor:
    if split == 1:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    return torch.zeros(m, n, dtype=torch.float32, device=x.device)


def _gemv(jit: ModuleType, layer: nn.Module, x: torch.Tensor, group: int, tile: int, sms: int) -> torch.Tensor:
    k = x.shape[1]
    n = layer.w4_qweight.shape[0]
    t = gemv_tiles(n, k, tile, sms)
    out = _output(1, n, t.split_k, x)
    jit.w4a16_gemv_fold_kernel[(-(-n // t.block_n), t.split_k)](
        x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, out, n, k,
        layer.w4_qweight.stride(0), layer.w4_scales.stride(0),
        GROUP_SIZE=group, TILE=tile, SPANS=t.spans, BLOCK_N=t.block_n, SPLIT_K=t.split_k,
        num_warps=t.num_warps, num_stages=1,
    )
    return out


def _mma(jit: ModuleType, layer: nn.Module, x: torch.Tensor, group: int, tile: int,
         asm: bool | None = None) -> torch.Tensor:
    m, k = x.shape
    n = layer.w4_qweight.shape[0]
    t = mma_tiles(n, k, group)
    out = _output(m, n, t.split_k, x)
    magic_bits, magic = (0x6400, 1024.0) if x.dtype == torch.float16 else (0x4300, 128.0)
    if asm is None:   # the one-instruction unpacking is PTX; elsewhere the same bits come from integer ops
        asm = x.device.type == "cuda" and torch.version.hip is None and not interpret_requested()
    jit.w4a16_mma_kernel[(-(-m // 16), -(-n // t.block_n), t.split_k)](
        x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, out, m, n, k,
        x.stride(0), layer.w4_qweight.stride(0), layer.w4_scales.stride(0), out.stride(0),
        GROUP_SIZE=group, TILE=tile, BLOCK_N=t.block_n, SPLIT_K=t.split_k,
        MAGIC_BITS=magic_bits, MAGIC=magic, ASM=asm, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


class TritonW4A16Kernel(GemmKernel):
    """4-bit codes with float32 group scales and zero points, unpacked in registers: one row through the
    CUDA-core GEMV, up to :data:`MMA_MAX_ROWS` float16/bfloat16 rows through the tensor-core decode
    kernel, longer inputs through the tiled GEMM."""

    name: ClassVar[str] = "triton_w4a16"
    priority: ClassVar[int] = 20

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int" or problem.bits != 4:
            return Support.no("runs 4-bit integer weights only")
        refused = triton_refusal(problem)
        if refused is not None:
            return refused
        if problem.group_size is not None and problem.group_size % 16:
            return Support.no(f"group size {problem.group_size} is not a multiple of 16")
        if problem.group_size is None and any(k % 16 for _n, k in problem.shapes):
            return Support.no("per-channel scales need input sizes that are multiples of 16")
        return Support.yes()

    def prepare(self, weights: IntWeights) -> dict[str, torch.Tensor]:  # type: ignore[override]
        n, k = weights.q.shape
        tile = interleave_tile(k, weights.group_size or k)
        return {
            "w4_qweight": pack_int32(interleave_codes(weights.q, tile), 4, dim=1),   # [N, K/8] interleaved
            "w4_scales": weights.scales.to(torch.float32).contiguous(),     # [N, G]
            "w4_zeros": weights.zeros.to(torch.float32).contiguous(),
            **perm_state(weights),
        }

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        jit = load_jit_module()
        x = permute_input(layer, x)
        m, k = x.shape
        group = k // layer.w4_scales.shape[1]
        sms = _INTERPRETER_SMS if interpret_requested() else num_sms(x.device)
        tile = interleave_tile(k, group)
        if m == 1 and x.is_contiguous():
            out = _gemv(jit, layer, x, group, tile, sms)
        elif (m <= MMA_MAX_ROWS and tile >= MMA_MIN_TILE and x.dtype in (torch.float16, torch.bfloat16)
              and x.stride(1) == 1):
            out = _mma(jit, layer, x, group, tile)
        else:
            out = self._gemm(jit, layer, x, group, tile, sms)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    @staticmethod
    def _gemm(jit: ModuleType, layer: nn.Module, x: torch.Tensor, group: int, tile: int, sms: int) -> torch.Tensor:
        m, k = x.shape
        n = layer.w4_qweight.shape[0]
        t = choose_tiles(m, n, k, group, sms)
        out = _output(m, n, t.split_k, x)
        grid = (-(-m // t.block_m), -(-n // t.block_n), t.split_k)
        jit.w4a16_gemm_kernel[grid](
            x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, out,
            m, n, k,
            x.stride(0), x.stride(1),
            layer.w4_qweight.stride(1), layer.w4_qweight.stride(0),   # read as [K/8, N]
            layer.w4_scales.stride(1), layer.w4_scales.stride(0),     # read as [G, N]
            out.stride(0), out.stride(1),
            GROUP_SIZE=group, TILE=tile, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
        return out
