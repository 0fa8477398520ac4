"""Skinny (decode-batch) GEMMs for unquantized layers on GPUs, chosen per weight shape at start-up.

A decode step multiplies a handful of rows by every weight matrix: the product is bound by reading
the weights, and vendor GEMMs stream small matrices well below the copy bandwidth. At start-up each
distinct ``[N, K]`` weight shape of the model is timed with the vendor GEMM and with
:func:`plinth.kernels.ops.skinny_linear`, for one row and for eight rows (standing for 2..16); the
layers get a :class:`SkinnyLinearMethod` that takes the Triton kernel only where it was faster.
``PLINTH_SKINNY_GEMM=0`` turns this off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from plinth.kernels import ops

logger = logging.getLogger(__name__)

SKINNY_ENV = "PLINTH_SKINNY_GEMM"
_TIMED_ROWS = (1, 8)
_ITERS = 20
#: weights rotated through while timing one shape, so that they do not sit in the L2 cache
_ROTATE = 4


@dataclasses.dataclass(frozen=True)
class SkinnyChoice:
    """Row counts that take the Triton kernel for one weight shape."""

    one_row: bool
    few_rows: bool

    def uses_triton(self, m: int) -> bool:
        if m == 1:
            return self.one_row
        # (no rows: the vendor path, which launches nothing; a prefill chunk that samples nothing computes the LM
        # head of zero rows)
        return self.few_rows and 1 < m <= ops.SKINNY_MAX_M


class SkinnyLinearMethod:
    """Wraps a layer's unquantized linear method: decode-sized inputs may take the skinny kernel."""

    reads_weight = True   # multiplies the layer's weight as it is at each call (new values apply at once)

    def __init__(self, inner: Any, choice: SkinnyChoice):
        self.inner = inner
        self.choice = choice

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int]) -> None:
        self.inner.create_weights(layer, input_size, output_sizes)

    def process_weights_after_loading(self, layer: Any) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and self.choice.uses_triton(x.shape[0]):
            return ops.skinny_linear(x, layer.weight, bias)
        return self.inner.apply(layer, x, bias)


def _time(fn: Any, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    for w in weights:                      # warm-up (and Triton compilation)
        fn(xs[0], w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(_ITERS):
        fn(xs[i % len(xs)], weights[i % len(weights)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / _ITERS


def _skinny_eligible(weight: torch.Tensor) -> bool:
    if weight.dim() != 2:
        return False
    n, k = weight.shape
    return (weight.dtype in (torch.float16, torch.bfloat16) and weight.is_contiguous()
            and ops.default_tiles(1, n, k, ops.num_sms(weight.device)) is not None)


def choose(weights: list[torch.Tensor]) -> tuple[SkinnyChoice, dict[int, tuple[float, float]]]:
    """Time the vendor GEMM against the skinny kernel on up to four weights of one shape."""
    sample = weights[:_ROTATE]
    k = sample[0].shape[1]
    timings: dict[int, tuple[float, float]] = {}
    for m in _TIMED_ROWS:
        xs = [torch.randn(m, k, dtype=sample[0].dtype, device=sample[0].device) for _ in range(2)]
        vendor = _time(lambda x, w: F.linear(x, w), xs, sample)
        triton = _time(lambda x, w: ops.skinny_linear(x, w), xs, sample)
        timings[m] = (vendor, triton)
    return SkinnyChoice(one_row=timings[1][1] < timings[1][0], few_rows=timings[8][1] < timings[8][0]), timings


def install_skinny_gemms(model: torch.nn.Module) -> dict[str, Any]:
    """Give every eligible unquantized linear layer (and the LM head) its per-shape choice."""
    from plinth.model_registry.layers.embedding import LMHead
    from plinth.model_registry.layers.linear import LinearBase, UnquantizedLinearMethod

    report: dict[str, Any] = {"layers": 0, "shapes": {}}
    if os.environ.get(SKINNY_ENV, "1").strip().lower() in ("0", "false", "no", "off") or not ops.triton_available():
        return report
    t0 = time.perf_counter()
    by_shape: dict[tuple[int, int, torch.dtype], list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cuda" or not _skinny_eligible(weight):
            continue
        if (isinstance(module, LinearBase) and type(module.linear_method) is UnquantizedLinearMethod) or \
                (isinstance(module, LMHead) and module.gemm is None):
            by_shape[(*weight.shape, weight.dtype)].append(module)
    for (n, k, _dtype), modules in by_shape.items():
        choice, timings = choose([m.weight for m in modules])
        report["shapes"][f"{n}x{k}"] = {m: {"vendor_ms": v, "triton_ms": t} for m, (v, t) in timings.items()}
        if not (choice.one_row or choice.few_rows):
            continue
        for module in modules:
            if isinstance(module, LMHead):
                module.gemm = _lm_head_gemm(module, choice)
            else:
                module.linear_method = SkinnyLinearMethod(module.linear_method, choice)
            report["layers"] += 1
    report["seconds"] = time.perf_counter() - t0
    logger.info("skinny GEMMs: %d layers in %d shapes use the Triton kernel for decode rows (%s); chosen in %.1f s",
                report["layers"], len(by_shape), ", ".join(
                    f"{s}: m1 {t[1]['triton_ms'] * 1e3:.0f}/{t[1]['vendor_ms'] * 1e3:.0f} us, "
                    f"m8 {t[8]['triton_ms'] * 1e3:.0f}/{t[8]['vendor_ms'] * 1e3:.0f} us"
                    for s, t in report["shapes"].items()), report["seconds"])
    return report


def _lm_head_gemm(head: Any, choice: SkinnyChoice) -> Any:
    def gemm(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 2 and choice.uses_triton(hidden.shape[0]):
            return ops.skinny_linear(hidden, head.weight)
        return F.linear(hidden, head.weight)

    gemm.reads_weight = True   # type: ignore[attr-defined]  # the head's weight as it is at each call
    return gemm
