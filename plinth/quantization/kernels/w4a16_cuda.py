"""A CUDA W4A16 decode kernel on tensor cores, compiled at run time with NVRTC.

Decode inputs (1-16 rows) run ``plinth/kernels/csrc/w4a16_mma.cu``: each ``mma.m16n8k16`` takes 16
output channels of unpacked 4-bit weights as its A operand and up to eight activation rows as its B
operand, so the weights are read once for the whole batch and a pair of codes costs a shift, a ``lop3``
and a packed add. Longer inputs take the Triton tiled GEMM
(:class:`~plinth.quantization.kernels.w4a16_triton.TritonW4A16Kernel`), so each layer keeps both
layouts (twice the packed bytes: still half of bfloat16).

The kernel source needs no CUDA toolkit: NVRTC ships with PyTorch's CUDA wheels, and the source
includes no headers. The layout functions below are plain torch and run anywhere (the tests check
them on the CPU against an independent reading of PTX's fragment layout).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.kernels import nvrtc, ops
from plinth.quantization.formats import IntWeights
from plinth.quantization.kernels.dequant import permute_input
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem, Support
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel, _override

SOURCE = nvrtc.CSRC / "w4a16_mma.cu"
#: the most rows the decode kernel takes (two 8-row B operands per unpacked A fragment)
MAX_ROWS = 16
#: input features per packed chunk (four mma steps of 16)
CHUNK = 64
_ENV = "PLINTH_W4A16_CUDA"
#: ``0``: gate/up layers leave SiLU-and-mul to its own kernel (for comparisons)
_SILU_ENV = "PLINTH_W4A16_SILU"


def pack_mma_codes(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` 4-bit codes as the kernel's int32 words ``[N/16, K/64, 32, 4]`` (see the .cu file).

    Row ``16 r + 8 rs + g`` and feature ``64 c + 16 t + 4 s + 2 eh + el`` go to lane ``4 g + t``, step
    ``s``, nibble ``rs + 2 eh + 4 el``.
    """
    n, k = q.shape
    if n % 16 or k % CHUNK:
        raise ValueError(f"the mma layout needs N % 16 == 0 and K % {CHUNK} == 0, got {n} x {k}")
    v = q.to(torch.int64).reshape(n // 16, 2, 8, k // CHUNK, 4, 4, 2, 2)   # r rs g c t s eh el
    v = v.permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(n // 16, k // CHUNK, 32, 4, 8)   # r c (g t) s (el eh rs)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pair_rows(n: int) -> torch.Tensor:
    """The row order of a gate/up weight ``[2 D, K]`` (gate rows first) that puts gate rows ``8 r .. 8 r + 7``
    and up rows ``D + 8 r .. D + 8 r + 7`` in tile ``r`` (the kernel's ``pair_half``): index ``[N]`` into the
    rows, applied to codes, scales and zero points before packing."""
    if n % 16:
        raise ValueError(f"paired gate/up rows need N % 16 == 0, got {n}")
    half = torch.arange(n // 2).reshape(n // 16, 1, 8)
    return torch.cat([half, half + n // 2], dim=1).reshape(n)


def unpack_mma_codes(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_mma_codes`, written from PTX's description of the m16n8k16 A fragment
    (register ``i`` of lane ``4 g + t`` holds ``a[2i], a[2i+1]``; element ``j`` sits at row ``g + 8 ((j // 2) % 2)``,
    k ``2 t + j % 2 + 8 (j // 4)``) and the kernel's k order (mma k ``kk`` of step ``s`` is feature
    ``16 ((kk % 8) // 2) + 4 s + 2 (kk // 8) + kk % 2``)."""
    out = torch.empty(n, k, dtype=torch.uint8)
    w = words.reshape(n // 16, k // CHUNK, 32, 4).to(torch.int64).cpu()
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nibble in range(8):
            j = 2 * (nibble % 4) + nibble // 4          # register nibble % 4, low half (< 4) or high half
            row = g + 8 * ((j // 2) % 2)
            kk = 2 * t + j % 2 + 8 * (j // 4)
            for s in range(4):
                feature = 16 * ((kk % 8) // 2) + 4 * s + 2 * (kk // 8) + kk % 2
                codes = (w[:, :, lane, s] >> (4 * nibble)) & 0xF                      # [N/16, K/64]
                rows = torch.arange(n // 16) * 16 + row
                cols = torch.arange(k // CHUNK) * CHUNK + feature
                out[rows[:, None], cols[None, :]] = codes.to(torch.uint8)
    return out


def pack_mma_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` scales and zero points (code units) as int32 words ``[N/16, G, 8, 2]``: for tile ``r``,
    group ``i``, ``g`` and ``h``, row ``16 r + g + 8 h``'s scale in the low half and its zero point in
    the high half, both bfloat16."""
    n, groups = scales.shape
    if n % 16:
        raise ValueError(f"the mma layout needs N % 16 == 0, got {n}")
    pair = torch.stack([scales.to(torch.bfloat16), zeros.to(torch.bfloat16)], dim=-1)      # [N, G, 2]
    pair = pair.reshape(n // 16, 2, 8, groups, 2).permute(0, 3, 2, 1, 4).contiguous()      # r i g h .
    return pair.view(torch.int32).reshape(n // 16, groups, 8, 2)


def unpack_mma_scales(words: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` ``[N, G]`` float32 from :func:`pack_mma_scales`'s words."""
    groups = words.shape[1]
    pair = words.cpu().contiguous().view(torch.bfloat16).reshape(n // 16, groups, 8, 2, 2).float()
    pair = pair.permute(0, 3, 2, 1, 4).reshape(n, groups, 2)
    return pair[..., 0], pair[..., 1]


def reference_decode(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """What the kernel computes, in float64 torch from its packed tensors: ``x @ ((q - z) * s).T`` with the
    bfloat16 scales and zero points (the kernel sums in float32 and never rounds the weights)."""
    k = x.shape[1]
    q = unpack_mma_codes(codes, n, k).to(torch.float64)
    s, z = unpack_mma_scales(scales, n)
    group = k // s.shape[1]
    w = ((q.view(n, -1, group) - z.double()[..., None]) * s.double()[..., None]).reshape(n, k)
    return x.double().cpu() @ w.T


def integral_zeros(zeros: torch.Tensor) -> bool:
    """Whether the kernel can take these zero points: integers (every format plinth reads has them) that
    bfloat16 holds exactly next to the codes; layers with others run the Triton kernels."""
    return bool(torch.equal(zeros, zeros.round()) and zeros.abs().max().item() <= 64) if zeros.numel() else True


def group_shift(k: int, groups: int) -> int | None:
    """``log2`` of the chunks per scale group (the kernel's ``cc >> shift``), 31 for one group per row,
    ``None`` where a group is not a power-of-two number of chunks."""
    if groups == 1:
        return 31
    per = k // groups // CHUNK
    return per.bit_length() - 1 if per >= 1 and per & (per - 1) == 0 and per * CHUNK * groups == k else None


def slot_bytes(rows: int) -> int:
    """Bytes of one ring slot: a chunk's codes (32 lanes x 16) and 128 bytes of activations per batch row."""
    return 512 + 128 * rows


#: shared-memory bytes per scale group a block stages (converted 128 and raw 64)
SCALE_BYTES = 192
_STAGES = (2, 3, 4, 6, 8, 12, 16)
_WARPS = (1, 2, 4, 8, 16)
@functools.cache
def max_shared(device_index: int) -> int:
    """Bytes of shared memory one block may opt into on the device."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))


@functools.cache
def compiled(bf16: bool, nb: int, stages: int, device_index: int) -> int:
    """The CUfunction of one dtype, B-operand count and ring depth, loaded on one device and allowed all of
    the device's opt-in shared memory (set once: the attribute is a limit, not a request)."""
    name = f"w4a16_mma_decode<{'true' if bf16 else 'false'}, {nb}, {stages}>"
    func = nvrtc.compile_function(SOURCE.read_text(), name, device_index)
    nvrtc.set_attribute(func, nvrtc.MAX_DYNAMIC_SHARED, max_shared(device_index), name)
    return func


def registers(bf16: bool, nb: int, stages: int) -> int:
    """Registers per thread of one kernel instance (``CU_FUNC_ATTRIBUTE_NUM_REGS``; for benchmarks)."""
    return nvrtc.get_attribute(compiled(bf16, nb, stages, torch.cuda.current_device()), nvrtc.NUM_REGS)


def launch_config(k: int, n: int = 0, m: int = 1, sms: int = 0) -> tuple[int, int]:
    """``(warps per block, ring slots per warp)`` for ``[m, k] @ [n, k].T`` on a GPU with ``sms``
    multiprocessors: four slots per warp; eight warps (a tile's chunks shared by more warps) for long rows
    (K > 8192), for fewer 16-row tiles than two per multiprocessor, and for 3-8 rows; four otherwise.
    Swept on an H200 at Llama-3-8B's shapes (``benchmarks/skinny_gemm_gpu.py --parts w4cuda --rows
    1,2,4,8,16 --w4cuda-sweep 4x4,8x4,...``: o at one row 6.22 us with eight warps against 6.62 with four;
    gate/up at four rows 28.7 against 30.8, qkv 8.60 against 9.95; at two and sixteen rows four warps won
    for qkv and gate/up). ``PLINTH_W4A16_CUDA="WARPS,STAGES"`` overrides."""
    forced = _override(_ENV, 2, 1)
    if forced is None:
        few_tiles = sms > 0 and n // 16 < 2 * sms
        return (8, 4) if k > 8192 or few_tiles or 3 <= m <= 8 else (4, 4)
    warps, stages = forced
    if warps not in _WARPS or stages not in _STAGES:
        raise ValueError(f"{_ENV}={os.environ[_ENV]!r}: expected WARPS ({', '.join(map(str, _WARPS))}),"
                         f"STAGES ({', '.join(map(str, _STAGES))})")
    return warps, stages


def fit_shared(warps: int, stages: int, rows: int, groups: int, limit: int) -> tuple[int, int]:
    """The launch with fewer ring slots (then fewer warps) where the tile's scales and ``warps x stages``
    slots of ``rows`` batch rows would not fit in ``limit`` bytes of shared memory."""
    limit -= SCALE_BYTES * groups
    while warps * stages * slot_bytes(rows) > limit and stages > _STAGES[0]:
        stages = max(s for s in _STAGES if s < stages)
    while warps * stages * slot_bytes(rows) > limit and warps > 1:
        warps //= 2
    return warps, stages


@dataclasses.dataclass(frozen=True)
class Launch:
    """What one call shape needs: the kernel, its grid, block and shared memory, and the group shift."""

    func: int
    blocks: int
    threads: int
    shared: int
    shift: int


@functools.lru_cache(maxsize=256)
def plan(m: int, n: int, k: int, groups: int, bf16: bool, device_index: int, forced: str | None) -> Launch:
    """The launch of one call shape (``forced``: the ``PLINTH_W4A16_CUDA`` value, part of the cache key)."""
    shift = group_shift(k, groups)
    if shift is None:
        raise ValueError(f"scale groups of {k // groups} features are not a power-of-two number of "
                         f"{CHUNK}-feature chunks")
    sms = ops.num_sms(torch.device("cuda", device_index))
    warps, stages = fit_shared(*launch_config(k, n, m, sms), m, groups, max_shared(device_index))
    shared = SCALE_BYTES * groups + warps * stages * slot_bytes(m)
    if shared > max_shared(device_index):
        raise ValueError(f"{groups} scale groups need more shared memory than the GPU has for one block")
    nb = 1 if m <= 8 else 2
    return Launch(compiled(bf16, nb, stages, device_index), n // 16, 32 * warps, shared, shift)


def mma_decode(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, *, paired: bool = False,
               silu: bool = False) -> torch.Tensor:
    """``[M, N]`` for ``x`` ``[M, K]`` (``1 <= M <= 16``, float16/bfloat16) on the packed weight
    (:func:`pack_mma_codes`, :func:`pack_mma_scales`), on ``x``'s device.

    ``paired``: the weight's rows were packed in :func:`pair_rows` order (a gate/up layer); the output is
    still in the layer's own channel order. ``silu`` (paired only): ``silu(gate) * up``, ``[M, N / 2]``.
    """
    if silu and not paired:
        raise ValueError("silu(gate) * up needs a weight packed with paired gate/up rows")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the W4A16 decode kernel takes 1-{MAX_ROWS} rows, got {m}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the W4A16 decode kernel takes float16/bfloat16 activations, not {x.dtype}")
    if codes.dim() != 4 or tuple(codes.shape[1:]) != (k // CHUNK, 32, 4) or codes.shape[0] * 16 != n:
        raise ValueError(f"packed codes of shape {tuple(codes.shape)} do not hold a {n} x {k} weight")
    if codes.data_ptr() % 16 or scales.data_ptr() % 16 or not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("packed codes and scales must be contiguous and 16-byte aligned")
    if x.stride(1) != 1 or x.stride(0) % 8:
        x = x.contiguous()
    if x.data_ptr() % 16:   # the kernel copies activations 16 bytes at a time
        x = x.clone()
    groups = scales.shape[1]
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    launch = plan(m, n, k, groups, x.dtype == torch.bfloat16, index, os.environ.get(_ENV))
    y = torch.empty(m, n // 2 if silu else n, dtype=x.dtype, device=x.device)
    args = [ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(y.data_ptr()), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(x.stride(0)),
            ctypes.c_int(y.shape[1]), ctypes.c_int(launch.shift), ctypes.c_int(groups),
            ctypes.c_int(n // 2 if paired else 0), ctypes.c_int(int(silu))]
    nvrtc.launch(launch.func, launch.blocks, launch.threads, launch.shared, x.device, args, "the W4A16 decode kernel",
                 dependent=nvrtc.dependent_launch(x.device))
    return y


class CudaW4A16Kernel(GemmKernel):
    """4-bit weights: up to :data:`MAX_ROWS` float16/bfloat16 rows through the NVRTC tensor-core decode
    kernel, longer inputs (and layers with fractional zero points) through the Triton kernels."""

    name: ClassVar[str] = "cuda_w4a16"
    priority: ClassVar[int] = 30
    #: part of the selection's cache key: a changed kernel is timed afresh (2: weights staged before the
    #: previous kernel ends, programmatic dependent launch in CUDA graphs; 3: paired gate/up rows; 4: the
    #: float16 unpack with one shift, the Triton kernels around it launched as dependents)
    selection_revision: ClassVar[int] = 4
    silu_pairs: ClassVar[bool] = True

    def __init__(self, problem: GemmProblem):
        super().__init__(problem)
        self.large = TritonW4A16Kernel(problem)

    @classmethod
    def supports(cls, problem: GemmProblem) -> Support:
        if problem.weight_format != "int" or problem.bits != 4:
            return Support.no("runs 4-bit integer weights only")
        if problem.device_type != "cuda" or torch.version.hip is not None:
            return Support.no("an NVRTC kernel for NVIDIA GPUs")
        if problem.capability is None or problem.capability < (8, 0):
            return Support.no(f"needs compute capability 8.0 or newer (bf16 mma), this GPU has {problem.capability}")
        if problem.dtype != torch.bfloat16:
            # its scales are bfloat16: float16 checkpoints' scales would lose three bits (~6x float16's own
            # rounding); float16 models take the other W4A16 kernels
            return Support.no(f"runs bfloat16 activations (its scales are bfloat16), not {problem.dtype}")
        if not hasattr(torch.cuda, "_compile_kernel"):
            return Support.no("this torch has no torch.cuda._compile_kernel (NVRTC)")
        if importlib.util.find_spec("triton") is None:
            return Support.no("triton not installed (prefill-sized inputs run its GEMM)")
        try:
            launch_config(0)
        except ValueError as exc:
            return Support.no(str(exc))
        device = torch.cuda.current_device()
        for n, k in problem.shapes:
            if n % 16 or k % CHUNK:
                return Support.no(f"shape N={n}, K={k}: needs N % 16 == 0 and K % {CHUNK} == 0")
            group = problem.group_size or k
            if k % group or group_shift(k, k // group) is None:
                return Support.no(f"group size {group}: needs a power-of-two multiple of {CHUNK} features (K={k})")
            if SCALE_BYTES * (k // group) + 2 * slot_bytes(MAX_ROWS) > max_shared(device):
                return Support.no(f"K={k} in groups of {group}: the scales of a tile do not fit in shared memory")
        try:
            compiled(True, 1, launch_config(0)[1], device)
        except Exception as exc:  # noqa: BLE001 - any NVRTC or driver failure means "not here"
            return Support.no(f"NVRTC could not build the kernel: {type(exc).__name__}: {str(exc)[:200]}")
        return Support.yes()

    def prepare(self, weights: IntWeights, *, silu_pairs: bool = False) -> dict[str, Any]:  # type: ignore[override]
        state: dict[str, Any] = {**self.large.prepare(weights), "w4m_exact": integral_zeros(weights.zeros),
                                 "w4m_paired": False}
        if state["w4m_exact"]:
            q, sc, z = weights.q, weights.scales, weights.zeros
            if silu_pairs and q.shape[0] % 16 == 0:
                order = pair_rows(q.shape[0]).to(q.device)
                q, sc, z = q[order], sc[order], z[order]
                state["w4m_paired"] = True
            state["w4m_codes"] = pack_mma_codes(q)
            state["w4m_scales"] = pack_mma_scales(sc, z)
        return state

    def installed(self, tensors: dict[str, Any]) -> None:
        codes = tensors.get("w4m_codes")
        if codes is not None and codes.device.type == "cuda":
            nvrtc.note_prefetching_kernels(codes.device)

    def decode_tensors(self) -> frozenset[str]:
        return frozenset({"w4m_codes", "w4m_scales"})

    @staticmethod
    def _decodes(layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the decode kernel (1-16 rows, a layer with integral zero points)."""
        return 0 < x.shape[0] <= MAX_ROWS and layer.w4m_exact

    @staticmethod
    def _decode(layer: nn.Module, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        return mma_decode(permute_input(layer, x), layer.w4m_codes, layer.w4m_scales, layer.w4m_codes.shape[0] * 16,
                          paired=layer.w4m_paired, silu=silu)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self._decodes(layer, x):
            return self.large.apply(layer, x, bias)
        out = self._decode(layer, x)
        return out if bias is None else out + bias

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a layer prepared with ``silu_pairs`` in one launch for decode inputs;
        ``None`` where :meth:`apply` then a separate kernel must do it (long inputs, a bias)."""
        if not self._decodes(layer, x) or not layer.w4m_paired or bias is not None:
            return None
        if os.environ.get(_SILU_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            return None
        if not ops.fused_ops_enabled(x):   # PLINTH_FUSED_OPS=0: the plain path everywhere
            return None
        return self._decode(layer, x, silu=True)
