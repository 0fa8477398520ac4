"""CPU GEMMs for the linear layers and the LM head: oneDNN-prepacked weights, and int4 for small batches.

Two kernels, chosen per call by the number of rows ``M`` of the input:

- ``packed``: the weight reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``)
  and multiplied with ``mkldnn._linear_pointwise``. bfloat16: the same arithmetic as ``F.linear``
  (bit-identical outputs), without the per-call reorder. float32 (x86-64 CPUs without native bfloat16, where
  float32 is the default dtype): oneDNN's float32 GEMM, faster there than MKL's at decode sizes, for inputs of
  up to :data:`F32_PACKED_MAX_ROWS` rows (the same sums in another order: within float32 rounding).
- ``int4``: for ``M <= int4_max_rows`` (decode of one or a few sequences, where the step reads every
  weight once and memory traffic is the cost), a 4-bit copy of the weight in groups of 32 along the
  input features with a scale and offset per group, multiplied with ``_weight_int4pack_mm_for_cpu``.
  Built from a GGUF file's own ``Q4_0``/``Q4_1`` blocks (:mod:`plinth.worker.cpu_int4`), so it holds
  the file's values (scales and offsets rounded to bfloat16); a quarter of the bytes of bfloat16. A float32
  model on a CPU without native bfloat16 keeps these copies too: its decode rows go through the native
  float32 GEMV over the copy's panels (AVX2/FMA), else are rounded to bfloat16 for torch's kernel and the
  output comes back in float32.

A layer gets a :class:`CpuLinearMethod` in place of its unquantized linear method; layers of a
quantization method are left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import platform
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from plinth.kernels import cpu_native, ops
from plinth.model_registry.layers.linear import LinearBase, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

INT4_GROUP = 32


@dataclasses.dataclass
class Int4Weight:
    """A weight ``[N, K]`` as 4-bit values in groups of 32: ``w = (q - 8) * scale + zero``."""

    packed: torch.Tensor            # torch's CPU int4 layout of q [N, K] (values 0..15)
    scale_zeros: torch.Tensor       # [K / 32, N, 2] in the dtype of the inputs it takes: (scale, zero)
    out_features: int
    panels: cpu_native.Q4Panels | None = None   # the native panel GEMM's layout (w = scale * q + zero - 8 scale)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> Int4Weight:
        """``q`` ``[N, K]`` int32 in 0..15, ``scale``/``zero`` ``[N, K / 32]`` float32."""
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()   # [K/32, N, 2]
        panels = cpu_native.pack_q4_panels(q, scale, zero - 8.0 * scale)
        return cls(packed, sz, q.shape[0], panels)

    def __post_init__(self) -> None:
        # the native panel GEMV for bfloat16 inputs of at most Q4_GEMV_MAX_ROWS rows, where this CPU runs it
        self.gemv = (cpu_native.Q4Gemv(self.panels) if self.panels is not None and cpu_native.available(torch.bfloat16)
                     and cpu_native.q4_gemv_supported() else None)
        # and for float32 inputs (AVX2/FMA): float32 models on CPUs without native bfloat16
        self.gemv_f32 = (cpu_native.Q4GemvF32(self.panels) if self.panels is not None
                         and cpu_native.q4_gemv_f32_supported() else None)
        # float32 rows of decode steps, quantized to 8 bits per 32 features (take_int8_inputs)
        self.gemm_q8: cpu_native.Q4GemmF32Q8 | None = None

    @property
    def int8_inputs(self) -> bool:
        return self.gemm_q8 is not None

    def take_int8_inputs(self) -> bool:
        """Give the copy the 8-bit-input GEMM (:class:`cpu_native.Q4GemmF32Q8`, AVX2 ``vpmaddubsw``) for the float32
        rows of decode steps (see :func:`decode_step`); False where this copy has no float32 GEMV."""
        if self.gemv_f32 is None:
            return False
        self.gemm_q8 = cpu_native.Q4GemmF32Q8(self.panels)
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:   # [M, K] -> [M, N]
        """``x`` ``[M, K]`` (features contiguous) times the weight: bfloat16 inputs of at most
        :data:`cpu_native.Q4_GEMV_MAX_ROWS` rows through the native panel GEMV where there is one (it streams
        the codes faster than torch's kernel, which takes the rest)."""
        gemv = self.gemv
        if (gemv is not None and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= cpu_native.Q4_GEMV_MAX_ROWS
                and x.stride(1) == 1 and cpu_native.enabled(x)):
            return gemv(x)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zeros)


_STEP = threading.local()


@contextlib.contextmanager
def decode_step(active: bool = True) -> Iterator[None]:
    """Within it (on this thread) the forward pass is a decode step (every sequence computes one token): layers
    whose 4-bit copy has the 8-bit-input GEMM multiply every row count with it, and a Q8_0 head with 8-bit inputs
    takes them for 1-3 rows; other steps keep the float32 path. A prompt computed in one step of several tokens
    thus carries no 8-bit rounding; a prompt with one token left to compute (a prefix-cache hit that leaves the
    last token, or a one-token chunk) is computed like a decode step."""
    with _step_state("decode", active, False):
        yield


def in_decode_step() -> bool:
    return getattr(_STEP, "decode", False)


@contextlib.contextmanager
def mixed_step_rows(decode_rows: tuple[int, int] | None) -> Iterator[None]:
    """Within it (on this thread) a forward pass of a mixed step (prompt chunks beside decodes) of ``tokens`` rows
    has its decode rows, one token per sequence, first (``decode_rows`` is ``(decodes, tokens)``): layers whose
    4-bit copy has the 8-bit GEMM multiply those rows with it, as in a decode-only step, and the prompt rows on the
    float32 path. So a sequence's decode token is computed the same way whether or not
    a prompt shared its step."""
    with _step_state("decode_rows", decode_rows, None):
        yield


@contextlib.contextmanager
def _step_state(name: str, value: Any, unset: Any) -> Iterator[None]:
    """``_STEP.<name>`` set to ``value`` within it, then back to what it was (``unset`` if nothing)."""
    previous = getattr(_STEP, name, unset)
    setattr(_STEP, name, value)
    try:
        yield
    finally:
        setattr(_STEP, name, previous)


def _decode_rows(metadata: Any) -> tuple[int, int] | None:
    """``(decodes, tokens)``: the rows of a mixed step's leading one-token sequences (decodes, and prompts with one
    token left: those the attention backends take as decodes too) and the step's token count; else None."""
    decodes = getattr(metadata, "num_leading_decodes", 0)
    return (decodes, metadata.query_start_loc_cpu[-1]) if decodes else None


def mark_decode_steps(model: torch.nn.Module, prompts: bool = False) -> None:
    """Make ``model``'s eager forward pass a :func:`decode_step` when its attention metadata says the batch is
    decode-only (every sequence computes one token), or always with ``prompts`` (``PLINTH_CPU_INT8_ACT=all``:
    prompts take the 8-bit inputs too), and its ``compute_logits`` one when the forward pass before it was (the
    decode plan and the compiled decode runner mark their own steps)."""
    forward, compute_logits = model.forward, model.compute_logits

    def marked(input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(input_ids, positions, metadata, *args, **kwargs)
        _STEP.forward_decode = prompts or bool(getattr(metadata, "is_decode_only", False))
        rows = None if _STEP.forward_decode else _decode_rows(metadata)
        with decode_step(_STEP.forward_decode), mixed_step_rows(rows):
            return forward(input_ids, positions, metadata, *args, **kwargs)

    def marked_logits(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compute_logits(hidden, *args, **kwargs)
        with decode_step(in_decode_step() or getattr(_STEP, "forward_decode", False)):
            return compute_logits(hidden, *args, **kwargs)

    model.forward = marked
    model.compute_logits = marked_logits


#: methods by handle, for the custom op a compiled graph calls (the weights are not graph inputs)
_METHODS: weakref.WeakValueDictionary[int, CpuLinearMethod] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("plinth::cpu_linear", mutates_args=())
def cpu_linear_op(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``x`` ``[M, K]`` times the weight of method ``handle`` -> ``[M, out_features]`` (opaque to the compiler)."""
    return _METHODS[handle].matmul(x)


@cpu_linear_op.register_fake
def _cpu_linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=_METHODS[handle].output_dtype(x.shape[0], x.dtype))


#: the most rows a Q8_0 head multiplies with two-plane 8-bit inputs (AVX2): the integer work grows with the rows,
#: and from 4 rows on the float32 GEMV was as fast (2-core AVX2 machine, 49152 x 576, `benchmarks/cpu_parts.py
#: --parts f32-gemm`: 1 row 1.06 against 2.75 ms, 2 rows 1.91 against 3.02, 3 rows 2.73 against 3.53, 4 rows 3.66
#: against 3.75)
Q8_0_INT8_MAX_ROWS = 3

#: float32 inputs of up to this many rows (past ``q8_0_max_rows``; any step) multiply a Q8_0 head's regrouped blocks
#: in float32 (``cpu_native.q8_0_rows8_matmul``, AVX2): a quarter of the float32 weight's bytes, and from 9 rows on each
#: pair of tiles expanded once into a float32 panel for a 6-row FMA kernel. 2-core AMD EPYC (AVX2), 49152 x 576, weights
#: out of the caches, ms, regrouped / oneDNN's packed float32 GEMM: 8 rows 6.8 / 13.9, 16 rows 10.2 / 16.5, 31 rows
#: 17.5 / 22.7, 64 rows 32.0 / 36.0, 128 rows 60.7 / 58.6, 256 rows 153.9 / 134.8 (``python
#: benchmarks/cpu_parts.py --parts f32-gemm``; see benchmarks/RESULTS.md, session 31)
Q8_0_ROWS8_F32_MAX_ROWS = 64

#: where a bfloat16 model's Q8_0 head runs on AMX tiles (:func:`cpu_native.q8_panel_matmul`), the most rows its GEMV
#: still takes: 49152 x 576 with the weights cold (a 400 MiB write between calls), ms, GEMV / AMX / oneDNN bfloat16
#: + float32 copy: 1 row 1.60-1.68 / 1.90-1.93 / 2.20-2.94, 2 rows 2.04 / 1.72 / 2.54, 4 rows 2.53 / 1.81 / 3.07,
#: 32 rows 21.0 / 2.29 / 4.13 (Xeon with AMX, 2 cores)
Q8_0_AMX_GEMV_MAX_ROWS = 1

#: float32 inputs of more rows than this skip the packed weights for MKL's GEMM. The packed GEMM is faster up to a
#: default step's 2,048 tokens (one layer's four GEMMs of the default model, 2-core AMD EPYC with AVX2, MKL / packed:
#: 256 rows 20.1 / 16.0 ms, 512 rows 39.7 / 33.3, 1,024 rows 93.4 / 84.2, 2,048 rows 168.7 / 161.2; see
#: benchmarks/RESULTS.md, session 30)
F32_PACKED_MAX_ROWS = 2048


def packed_linear_supported(dtype: torch.dtype) -> bool:
    """oneDNN prepacking is available for ``dtype`` in this torch build and on this CPU, and used: bfloat16
    wherever it runs; float32 on x86-64 CPUs without native bfloat16 (where float32 is the default dtype), where
    the packed GEMM beat MKL's at 8-2,048 rows on the default model's shapes (2-core AMD EPYC, AVX2: the 49,152-row
    LM head at 32 rows 17.2 against 33.0 ms, gate/up 0.88 against 1.08 ms; see benchmarks/RESULTS.md; fewer rows
    were not benchmarked: a GGUF model's decode rows take its 4-bit copies). Elsewhere (other architectures: not
    measured) float32 GEMMs go to MKL."""
    if dtype == torch.bfloat16:
        return _onednn_bf16_linear_runs()
    if dtype == torch.float32:
        from plinth.platforms.cpu import platform as cpu_platform

        return (platform.machine().lower() in ("x86_64", "amd64") and not cpu_platform.has_fast_bf16()
                and _onednn_f32_linear_runs())
    return False


def _onednn_linear_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here for ``dtype``: torch must have it, and for bfloat16 it refuses
    CPUs without AVX512 (BW, VL, DQ) or AVX-NE-CONVERT with an error at the first use; tried on a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as exc:
        logger.info("oneDNN's packed %s linear does not run on this CPU (%s); those GEMMs use F.linear",
                    str(dtype).removeprefix("torch."), str(exc).splitlines()[0])
        return False
    return bool((y == 16).all())


@functools.cache
def _onednn_bf16_linear_runs() -> bool:
    return _onednn_linear_runs(torch.bfloat16)


@functools.cache
def _onednn_f32_linear_runs() -> bool:
    return _onednn_linear_runs(torch.float32)


class CpuLinearMethod:
    """The GEMM of one layer on the CPU (see the module docstring).

    Args:
        weight: the layer's ``[N, K]`` weight (kept as it is, the packed copy extra; with ``release_weight`` its
            storage is given back once packed).
        int4: a 4-bit copy for small batches, or ``None``.
        int4_max_rows: inputs with at most this many rows use ``int4``.
        pack_rows: the row count oneDNN packs the weight for (a hint; any ``M`` works).
        q8_0, q8_0_max_rows, q4_panel_max_rows, int8_activations: see :func:`install_cpu_linear`.
        pack: give the weight a oneDNN-packed copy where :func:`packed_linear_supported` (else ``F.linear``).
        int8_prompts: every step of the model is marked a decode step (``PLINTH_CPU_INT8_ACT=all``), so a 4-bit copy
            with the 8-bit GEMM takes every row count: no packed copy then.
        release_weight: once packed, the packed copy takes every row count and ``weight``'s own storage is given
            back (the parameter becomes a ``[0, K]`` tensor of the same dtype and device, its ``released_shape`` the
            weight's ``(N, K)``): the weight's bytes are held once, not twice.
    """

    def __init__(self, weight: torch.Tensor, int4: Int4Weight | None = None, int4_max_rows: int = 0,
                 pack_rows: int = 32, q8_0: torch.Tensor | None = None, q8_0_max_rows: int = 0,
                 q4_panel_max_rows: int = 0, int8_activations: bool = False, pack: bool = True,
                 int8_prompts: bool = False, release_weight: bool = False):
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        self.weight = weight
        self.int4 = int4
        self.int4_max_rows = int4_max_rows if int4 is not None else 0
        # inputs of int4_max_rows + 1 .. q4_panel_max_rows rows take the native panel GEMM of the 4-bit copy
        self.q4_panel_max_rows = (q4_panel_max_rows if int4 is not None and int4.panels is not None
                                  and cpu_native.q4_panels_supported() else 0)
        # inputs of up to gemv_max_rows bfloat16 rows take the 4-bit copy's native GEMV (past int4_max_rows too,
        # where it beats the panel GEMM; not past it when the opt-in 8-bit-input GEMM takes those rows)
        self.gemv_max_rows = 0
        if int4 is not None and int4.gemv is not None and self.int4_max_rows > 0:
            self.gemv_max_rows = (min(self.int4_max_rows, cpu_native.q4_gemv_max_rows()) if int8_activations
                                  else cpu_native.q4_gemv_max_rows())
        self.q8_0 = q8_0                      # GGUF Q8_0 blocks [N, K / 32 * 34] (the LM head of a GGUF file)
        self.q8_0_max_rows = q8_0_max_rows if q8_0 is not None else 0
        # a bfloat16 model on AMX tiles: the Q8_0 blocks regrouped for the AMX GEMM, which takes every row count
        # past the GEMV's (float32 logits, as the GEMV's); then no bfloat16 copy is packed
        self.q8_panels = (cpu_native.pack_q8_panels(q8_0) if self.q8_0_max_rows > 0 and weight.dtype == torch.bfloat16
                          and not int8_activations and cpu_native.q8_amx_supported() else None)
        if self.q8_panels is not None:
            self.q8_0_max_rows = min(self.q8_0_max_rows, Q8_0_AMX_GEMV_MAX_ROWS)
        # float32 models without AVX512-VNNI (AVX2): the Q8_0 GEMV quantizes its rows to 8 bits per 32 features
        self.q8_0_int8 = bool(int8_activations and q8_0 is not None and weight.dtype == torch.float32
                              and cpu_native.q8_0_int8_supported())
        # float32 models on AVX2: the blocks regrouped eight rows at a time (the same bytes in another order), for
        # those 8-bit rows and, in float32, for the rows past q8_0_max_rows up to Q8_0_ROWS8_F32_MAX_ROWS
        self.q8_0_rows8 = (cpu_native.pack_q8_0_rows8(q8_0) if q8_0 is not None and self.q8_0_max_rows > 0
                           and weight.dtype == torch.float32 and cpu_native.q8_0_int8_supported() else None)
        # int8_activations: inputs of more rows than the int4 / Q8_0 row limits multiply the file's codes with
        # 8-bit inputs (the native VNNI GEMM) instead of the panel GEMM or the bfloat16 weights
        self.vnni: cpu_native.VnniPanels | None = None
        self.vnni_min_rows = 0
        if int8_activations and cpu_native.available(self.dtype) and cpu_native.vnni_supported():
            if int4 is not None and int4.panels is not None:
                self.vnni, self.vnni_min_rows = cpu_native.vnni_from_q4_panels(int4.panels), self.int4_max_rows
            elif q8_0 is not None:
                self.vnni, self.vnni_min_rows = cpu_native.vnni_from_q8_0(q8_0, self.out_features), self.q8_0_max_rows
        # every row count is served by the 4-bit / Q8_0 kernels and the 8-bit-input GEMM once that exists: no
        # prepacked bfloat16 copy then (F.linear on the weight stays the fallback)
        # the same where the 4-bit panels on AMX tiles take every row count past the GEMV's
        panels_all = ((self.q4_panel_max_rows == sys.maxsize and cpu_native.q4_amx_supported())
                      or self.q8_panels is not None or (int8_prompts and int4 is not None and int4.int8_inputs))
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), pack_rows) \
            if pack and packed_linear_supported(weight.dtype) and self.vnni is None and not panels_all else None
        # float32: the packed GEMM for decode-sized inputs only; longer ones (prefill) run MKL's as fast or faster
        self.packed_max_rows = F32_PACKED_MAX_ROWS if weight.dtype == torch.float32 else sys.maxsize
        self.weight_released = release_weight and self.packed is not None
        if self.weight_released:
            self.packed_max_rows = sys.maxsize
            weight.released_shape = tuple(weight.shape)   # what the weight still is (benchmarks_floor.weight_stats)
            weight.data = weight.data.new_empty((0, weight.shape[1]))
        self.handle = next(_HANDLES)
        _METHODS[self.handle] = self

    def create_weights(self, layer: LinearBase, input_size: int, output_sizes: list[int]) -> None:
        """The layer's weights already exist when this method is installed."""
        raise RuntimeError("CpuLinearMethod is installed on built layers; it creates no weights")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Nothing more to do: the weights were packed at construction."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])                                # [M, K]
        if torch.compiler.is_compiling():   # the packed weights stay out of the traced graph
            y = cpu_linear_op(x2, self.handle, self.out_features)
            y = y if bias is None else y + bias
            return y.view(*lead, self.out_features)
        m = x2.shape[0]
        int4 = self.int4
        # a decode step's float32 rows, however many, take the 4-bit copy's 8-bit GEMM where it has one
        has_q8 = int4 is not None and int4.gemm_q8 is not None and cpu_native.native_ops_on()
        decode_q8 = has_q8 and in_decode_step()
        if has_q8 and not decode_q8 and (rows := getattr(_STEP, "decode_rows", None)) is not None:
            # a mixed step: its decode rows as in a decode-only step, the prompt rows on the float32 path
            decodes, tokens = rows
            if m == tokens:   # a layer of the token rows (not, say, the LM head's rows of the sampled positions)
                with mixed_step_rows(None):
                    y = x2.new_empty(m, self.out_features)
                    with decode_step():
                        y[:decodes] = self.matmul(x2[:decodes], bias)
                    y[decodes:] = self.matmul(x2[decodes:], bias)
                return y.view(*lead, self.out_features)
        if self.vnni is not None and m > self.vnni_min_rows and cpu_native.enabled(x2):
            y = cpu_native.vnni_matmul(x2, self.vnni)
            if bias is not None:
                y = y + bias
        elif (self.int4_max_rows < m <= self.gemv_max_rows and x2.dtype == torch.bfloat16
              and cpu_native.enabled(x2)):
            y = int4.gemv(x2 if x2.stride(1) == 1 else x2.contiguous())
            if bias is not None:
                y = y + bias
        elif self.int4_max_rows < m <= self.q4_panel_max_rows and cpu_native.enabled(x2):
            y = cpu_native.q4_panel_matmul(x2, int4.panels)
            if bias is not None:
                y = y + bias
        elif (self.q8_panels is not None and m > self.q8_0_max_rows and bias is None and x2.dtype == torch.bfloat16
              and cpu_native.enabled(x2)):
            y = cpu_native.q8_panel_matmul(x2, self.q8_panels)   # float32 logits, as the GEMV's below
        elif 0 < m <= self.q8_0_max_rows and bias is None and cpu_native.q8_0_enabled(x2):
            # the LM head's logits as the kernel's float32 sums: bfloat16 would round them to steps of 1/8 at
            # magnitude 16-32, where greedy near-ties then break by token id
            y = cpu_native.q8_0_matmul(x2, self.q8_0, self.out_features, torch.float32,
                                       int8_inputs=self.q8_0_int8 and x2.dtype == torch.float32
                                       and m <= Q8_0_INT8_MAX_ROWS and in_decode_step(), rows8=self.q8_0_rows8)
        elif (self.q8_0_rows8 is not None and 0 < m <= Q8_0_ROWS8_F32_MAX_ROWS and bias is None   # past q8_0_max_rows
              and x2.dtype == torch.float32 and cpu_native.q8_0_enabled(x2)):
            y = cpu_native.q8_0_rows8_matmul(x2, self.q8_0_rows8, self.out_features)
        elif int4 is not None and 0 < m <= self.int4_max_rows and x2.dtype == int4.scale_zeros.dtype:
            y = int4.matmul(x2.contiguous())
            if bias is not None:
                y = y + bias
        elif (int4 is not None and x2.dtype == torch.float32 and int4.scale_zeros.dtype == torch.bfloat16 and 0 < m
              and (decode_q8 or (m <= self.int4_max_rows and not (has_q8 and self.packed is not None)))):
            # a float32 model on a CPU without native bfloat16: decode rows multiply the 4-bit copy, through the
            # native float32 GEMV (AVX2/FMA, the rows as they are) or torch's int4 kernel on bfloat16-rounded
            # rows; either streams the weights several times faster than the float32 GEMV there. With 8-bit
            # inputs a decode step's rows, however many, take the copy's 8-bit GEMM (faster than oneDNN's float32
            # GEMM at 1-512 rows), and prompt rows, however few, the packed float32 weights: a prompt's last tokens
            # computed apart (after a prefix-cache hit) get the sums of the whole prompt's step, which the 8-bit
            # rounding of the decode steps after them would otherwise amplify into other tokens
            if decode_q8:
                y = int4.gemm_q8(x2 if x2.stride(1) == 1 else x2.contiguous())
            elif int4.gemv_f32 is not None and m <= cpu_native.Q4_GEMV_F32_MAX_ROWS and cpu_native.native_ops_on():
                y = int4.gemv_f32(x2 if x2.stride(1) == 1 else x2.contiguous())
            else:
                y = int4.matmul(x2.to(torch.bfloat16, memory_format=torch.contiguous_format)).float()
            if bias is not None:
                y = y + bias
        elif self.packed is not None and x2.dtype == self.dtype and 0 < m <= self.packed_max_rows:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")
        elif self.weight_released and m > 0:
            raise TypeError(f"{str(x2.dtype).removeprefix('torch.')} inputs for a layer whose "
                            f"{str(self.dtype).removeprefix('torch.')} weight is packed for oneDNN only")
        else:
            y = F.linear(x2, self.weight, bias) if m > 0 else x2.new_empty(0, self.out_features)
        return y.view(*lead, self.out_features)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, bias)

    def apply_silu_mul(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate/up layer in one native call where :meth:`matmul` would send the rows to the
        AMX panel GEMM (the activation applied to its tiles' sums: the same bits as :meth:`matmul` then the native
        ``silu_and_mul``); ``None`` elsewhere (the caller runs :meth:`apply`, then the activation)."""
        if bias is not None or x.dim() != 2 or self.out_features % 32 or self.vnni is not None:
            return None
        m = x.shape[0]
        if not max(self.int4_max_rows, self.gemv_max_rows) < m <= self.q4_panel_max_rows:
            return None
        if (torch.compiler.is_compiling() or not cpu_native.enabled(x) or not ops.fused_ops_enabled(x)
                or not cpu_native.q4_amx_supported()):
            return None   # (with the fused ops off the activation is torch's, as the unfused path's)
        return cpu_native.q4_panel_silu_mul(x, self.int4.panels)

    def output_dtype(self, rows: int, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`matmul` returns for ``rows`` bias-free rows of ``dtype``: float32 where the Q8_0 LM
        head's GEMV takes them (its logits), else ``dtype``."""
        if 0 < rows <= self.q8_0_max_rows and cpu_native.q8_0_supported(dtype):
            return torch.float32
        if self.q8_panels is not None and rows > self.q8_0_max_rows and dtype == torch.bfloat16:
            return torch.float32
        return dtype

    def gemv_f32_max_rows(self) -> int:
        """The most float32 rows of a decode step :meth:`matmul` sends to the 4-bit copy's native float32 GEMV or
        8-bit GEMM (0: none): the float32 branch of its routing, where no earlier branch takes float32 rows (a Q8_0
        head's rows do); every row count (``sys.maxsize``) for a copy with 8-bit inputs."""
        int4 = self.int4
        if (int4 is None or int4.gemv_f32 is None or int4.scale_zeros.dtype != torch.bfloat16
                or self.q8_0_max_rows > 0 or not cpu_native.native_ops_on()):
            return 0
        return sys.maxsize if int4.int8_inputs else min(self.int4_max_rows, cpu_native.Q4_GEMV_F32_MAX_ROWS)

    def int4_kernel_for(self, rows: int, dtype: torch.dtype) -> Int4Weight | None:
        """The 4-bit copy :meth:`matmul` multiplies contiguous ``[rows, K]`` inputs of ``dtype`` with, or None
        when it takes another kernel for them (callers that run many such inputs skip the routing)."""
        if (self.int4 is None or not 0 < rows <= self.int4_max_rows or dtype != self.int4.scale_zeros.dtype
                or (self.vnni is not None and rows > self.vnni_min_rows) or rows <= self.q8_0_max_rows):
            return None
        return self.int4


def install_cpu_linear(model: torch.nn.Module, int4_weights: dict[str, Int4Weight] | None = None,
                       int4_max_rows: int = 0, head_q8_0: torch.Tensor | None = None,
                       q8_0_max_rows: int = 0, q4_panel_max_rows: int = 0,
                       int8_activations: bool = False, pack: bool = True, int8_prompts: bool = False,
                       release_weights: bool = True) -> dict[str, int]:
    """Give every unquantized linear layer (and the LM head) a :class:`CpuLinearMethod`.

    Args:
        model: the loaded model.
        int4_weights: 4-bit copies by module name (``model.layers.0.mlp.gate_up_proj``, ``lm_head``).
        int4_max_rows: the row count up to which the 4-bit copies are used.
        head_q8_0: the LM head's GGUF ``Q8_0`` blocks, or None.
        q8_0_max_rows: the row count up to which the LM head multiplies the ``Q8_0`` blocks.
        q4_panel_max_rows: above ``int4_max_rows`` and up to this many rows, layers with a 4-bit copy multiply
            it with the native panel GEMM (AVX512-BF16).
        int8_activations: bfloat16 models: layers with a 4-bit copy (above ``int4_max_rows``) and a ``Q8_0`` LM
            head (above ``q8_0_max_rows``) multiply the file's codes with inputs quantized to 8 bits per row and 32
            features (the native VNNI GEMM, AVX512-VNNI), in place of the panel GEMM and the bfloat16 weights.
            float32 models: a ``Q8_0`` head takes 1-3 rows of decode steps in two 8-bit planes (AVX2); their 4-bit
            copies get the 8-bit GEMM from :meth:`Int4Weight.take_int8_inputs`. (Whatever this flag, a float32
            ``Q8_0`` head on AVX2 multiplies float32 rows past ``q8_0_max_rows`` up to
            ``Q8_0_ROWS8_F32_MAX_ROWS`` with its regrouped blocks in float32.)
        pack: give the weights a oneDNN-packed copy where :func:`packed_linear_supported` (else ``F.linear``).
        int8_prompts: float32 models whose every step is marked a decode step (:func:`mark_decode_steps` with
            ``prompts``): the 4-bit copies' 8-bit GEMM takes every row count, so those layers keep no packed copy.
        release_weights: linear layers (not the LM head, whose weight may be the token embedding's) give their
            weight's storage back once packed (see :class:`CpuLinearMethod`'s ``release_weight``).

    Returns:
        counts: ``{"packed": layers packed, "int4": layers with a 4-bit copy, "q8_0": 1 when the LM head
        got the file's Q8_0 blocks, "int8": layers that multiply with 8-bit inputs, "released": layers whose weight
        is now held packed only}``.
    """
    int4_weights = int4_weights or {}
    counts = {"packed": 0, "int4": 0, "q8_0": 0, "int8": 0, "released": 0}
    for name, module in model.named_modules():
        is_linear = isinstance(module, LinearBase) and isinstance(module.linear_method, UnquantizedLinearMethod)
        is_head = (name == "lm_head" and hasattr(module, "weight") and not isinstance(module, LinearBase)
                   and getattr(module, "gemm", None) is None)   # not an LM head quantized by a method
        if not (is_linear or is_head) or module.weight.device.type != "cpu":
            continue
        if is_head and getattr(module, "tp_size", 1) > 1:
            continue
        int4 = int4_weights.get(name)
        n, k = module.weight.shape
        if int4 is not None and (int4.out_features != n or int4.scale_zeros.shape[0] * INT4_GROUP != k):
            logger.warning("int4 copy of %s has the wrong shape; using bfloat16 only", name)
            int4 = None
        q8 = head_q8_0 if is_head and head_q8_0 is not None and head_q8_0.shape[0] == n else None
        if int4 is None and q8 is None and not (pack and packed_linear_supported(module.weight.dtype)):
            continue   # nothing but F.linear to offer: the layer keeps its own method
        method = CpuLinearMethod(module.weight, int4, int4_max_rows, q8_0=q8, q8_0_max_rows=q8_0_max_rows,
                                 q4_panel_max_rows=q4_panel_max_rows, int8_activations=int8_activations, pack=pack,
                                 int8_prompts=int8_prompts, release_weight=release_weights and is_linear)
        if is_linear:
            module.linear_method = method
        else:
            module.gemm = method.matmul
        counts["packed"] += method.packed is not None
        counts["released"] += method.weight_released
        counts["int4"] += method.int4 is not None
        counts["q8_0"] += method.q8_0 is not None
        counts["int8"] += (method.vnni is not None or method.q8_0_int8
                           or (method.int4 is not None and method.int4.int8_inputs))
    return counts
