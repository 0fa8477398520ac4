"""Choosing a quantization method's GEMM kernel at startup, with the shared selection algorithm.

:class:`GemmCandidates` is the :class:`~plinth.core.selection.CandidateKind` of GEMM kernels: the
candidates are the method's :meth:`~plinth.quantization.interface.QuantizationMethod.kernel_candidates`;
each is checked against the method's reference kernel (dequantize-then-matmul) on random weights in
the method's format, then timed on every distinct layer shape of the model at one row, a decode batch
and a prefill chunk (each step counting alike: a geometric mean of the times relative to the fastest
candidate at each step; on GPUs the decode steps by their device time, as the engine's decode graphs
see them); the record is cached under a key holding the method, the problem, the workload and its
steps. ``--gemm-kernel NAME`` (or ``PLINTH_GEMM_KERNEL``) forces one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import Support
from plinth.core.selection import select
from plinth.core.selection_records import SelectionResult
from plinth.plugins import Registration, get_plugin_manager
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem

if TYPE_CHECKING:
    from plinth.quantization.interface import QuantizationMethod

GEMM_KERNEL_ENV = "PLINTH_GEMM_KERNEL"
#: the correctness check's cut of a layer shape (output and input features), before the shape's tails
_CHECK_N, _CHECK_K = 256, 512
#: the tail of a layer's output and input features kept in its cut shape (tiles of up to this size see their edge)
_CHECK_TAIL = 128
_CHECK_ROWS = 7
#: GPU clock cycles of the sleep that decode launches queue behind while timed (~2 ms at 1-2 GHz)
_QUEUE_CYCLES = 3_000_000


def holder(state: dict[str, Any]) -> nn.Module:
    """A module holding a kernel's prepared tensors, as a layer would."""
    module = nn.Module()
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            module.register_parameter(name, nn.Parameter(value, requires_grad=False))
        else:
            setattr(module, name, value)
    return module


class _NullPlatform:
    """Stands in for a platform when selection never times anything (mode ``off`` or forced)."""

    name = "none"

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def device_name(self, index: int = 0) -> str:
        return "unknown"


@dataclasses.dataclass
class GemmCandidates:
    """The GEMM-kernel :class:`~plinth.core.selection.CandidateKind` of one method and problem."""

    method: QuantizationMethod
    problem: GemmProblem
    platform: Any
    kind: str = "gemm_kernel"
    reference: str | None = None
    #: rank by the geometric mean relative time per step (one-row decode, batched decode, prefill)
    relative_steps: bool = True
    #: the reference kernel and its outputs on the check cases: [(weights, x, output)]
    _ref: tuple[Any, list[tuple[Any, torch.Tensor, torch.Tensor]]] | None = dataclasses.field(default=None,
                                                                                             repr=False)

    def __post_init__(self) -> None:
        self.reference = self.method.reference_kernel

    @property
    def device(self) -> torch.device:
        return self.method.ctx.device

    def validate(self, obj: Any) -> str:
        if isinstance(obj, type) and issubclass(obj, GemmKernel):
            return ""
        return f"unsupported: {obj!r} is not a subclass of plinth.quantization.kernels.interface.GemmKernel"

    def supports(self, cls: Any) -> Support:
        return cls.supports(self.problem)

    def check_shapes(self) -> list[tuple[int, int]]:
        """Every distinct layer shape cut to about 256 x 512, keeping its tails: ``n`` and ``k`` modulo 128 (``k``
        in whole groups), so a kernel that mishandles a layer's edge tile or input size is caught."""
        step = self.problem.group_size or (256 if self.problem.weight_format == "gguf" else 32)
        shapes = []
        for n, k in self.problem.shapes:
            n_cut = n if n <= _CHECK_N else _CHECK_N + n % _CHECK_TAIL
            if k > _CHECK_K:
                tail = k % max(_CHECK_TAIL, step) // step * step
                k = max(step, _CHECK_K // step * step) + tail
            if (n_cut, k) not in shapes:
                shapes.append((n_cut, k))
        return shapes

    def _check_cases(self) -> list[tuple[Any, torch.Tensor]]:
        """Random weights and inputs of each of :meth:`check_shapes`."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        cases = []
        for n, k in self.check_shapes():
            weights = self.method.random_weights(n, k, self.device, gen)
            cases.append((weights, torch.randn(_CHECK_ROWS, k, generator=gen, device=self.device).to(self.problem.dtype)))
        return cases

    def _run(self, cls: Any, weights: Any, x: torch.Tensor) -> torch.Tensor:
        kernel = cls(self.problem)
        return kernel.apply(holder(kernel.prepare(weights)), x, None).to(torch.float32)

    def max_error(self, cls: Any, reference_cls: Any) -> float:
        """The kernel's largest error against the reference, relative to the output's magnitude, over every
        layer shape (:meth:`check_shapes`); for a kernel that takes rows quantized before it (``input_quant``, on
        Triton devices) also on such rows, and for one that fuses SiLU-and-mul (``silu_pairs``) also that of its
        fused output against the reference's."""
        if self._ref is None or self._ref[0] is not reference_cls:
            self._ref = (reference_cls, [(weights, x, self._run(reference_cls, weights, x))
                                         for weights, x in self._check_cases()])
        return max(self._case_error(cls, *case) for case in self._ref[1])

    def _case_error(self, cls: Any, weights: Any, x: torch.Tensor, ref: torch.Tensor) -> float:
        out = self._run(cls, weights, x)
        error = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
        quant = getattr(cls, "input_quant", None)
        if quant is not None and self.device.type in ("cuda", "xpu"):   # the rows a norm hands over
            from plinth.kernels import ops

            handed = self._run(cls, weights, ops.QuantizedRows(*ops.quantize_rows(x, quant.dtype, quant.qmax)))
            error = max(error, float((handed - ref).abs().max() / ref.abs().max().clamp(min=1e-6)))
        if getattr(cls, "silu_pairs", False) and ref.shape[1] % 2 == 0:
            kernel = cls(self.problem)
            fused = kernel.apply_silu_mul(holder(kernel.prepare(weights, silu_pairs=True)), x, None)
            if fused is not None:
                half = ref.shape[1] // 2
                expect = F.silu(ref[:, :half]) * ref[:, half:]
                error = max(error, float((fused.float() - expect).abs().max() / expect.abs().max().clamp(min=1e-6)))
        return error

    def tolerance(self) -> float:
        return self.method.kernel_tolerance()

    def step_runners(self, cls: Any) -> dict[str, Callable[[], float | None]]:
        gen = torch.Generator(device=self.device).manual_seed(1)
        kernel = cls(self.problem)
        layers = [(holder(kernel.prepare(self.method.random_weights(n, k, self.device, gen))), k)
                  for n, k in self.problem.shapes]
        workload = self.method.ctx.workload
        steps = {}
        for label, rows in workload.steps().items():
            inputs = [torch.randn(rows, k, generator=gen, device=self.device).to(self.problem.dtype)
                      for _layer, k in layers]

            def run(inputs: list[torch.Tensor] = inputs) -> None:
                for (layer, _k), x in zip(layers, inputs, strict=True):
                    kernel.apply(layer, x, None)

            steps[label] = self._device_timed(run) if label.startswith("decode") else run
        return steps

    def _device_timed(self, run: Callable[[], None]) -> Callable[[], float | None]:
        """On CUDA (and ROCm) devices, ``run`` returning its device time in milliseconds: the launches
        queue up behind a ~2 ms sleep kernel and two events time the kernels alone, as the engine's
        decode graphs see them (timed by the host clock, one-row GEMMs would measure each kernel's
        launch path in Python instead, which the graphs never pay)."""
        if self.device.type != "cuda":
            return run
        device = self.device

        def timed() -> float:
            with torch.cuda.device(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(_QUEUE_CYCLES)
                start.record()
                run()
                end.record()
                end.synchronize()
                return start.elapsed_time(end)

        return timed

    def synchronize(self) -> None:
        self.platform.synchronize()

    def key(self) -> dict[str, Any]:
        workload = self.method.ctx.workload
        return {"method": self.method.name, "problem": self.problem.key(),
                "workload": dataclasses.asdict(workload), "steps": workload.steps(), "scoring": "relative-steps"}


def kernel_registrations(method: QuantizationMethod) -> dict[str, Registration]:
    """The method's kernel candidates as registrations of the plugin that provides the method."""
    plugin = "unregistered"
    method_reg = get_plugin_manager().registrations("quantization_methods").get(method.name)
    if method_reg is not None:
        plugin = method_reg.plugin
    return {name: Registration(kind="gemm_kernels", name=name, ref=ref, plugin=plugin)
            for name, ref in method.kernel_candidates().items()}


def select_gemm_kernel(method: QuantizationMethod, problem: GemmProblem) -> SelectionResult:
    """Choose the kernel of ``method`` for ``problem`` (mode, forced name and platform from ``method.ctx``).

    Raises:
        SelectionError: the forced kernel is unknown or cannot run here (with its reason), or no
            kernel can run.
    """
    ctx = method.ctx
    forced, source = ctx.gemm_kernel, "--gemm-kernel"
    if not forced:
        forced, source = os.environ.get(GEMM_KERNEL_ENV, "").strip() or None, f"set by {GEMM_KERNEL_ENV}"
    platform = ctx.platform if ctx.platform is not None else _NullPlatform()
    mode = ctx.selection if ctx.platform is not None else "off"
    kind = GemmCandidates(method, problem, platform)
    return select(kind, kernel_registrations(method), mode=mode, platform=platform, pm=get_plugin_manager(),
                  forced=forced, forced_source=source, cache_dir=ctx.cache_dir)
