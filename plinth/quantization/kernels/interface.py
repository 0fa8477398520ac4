"""The GEMM-kernel contract: what a quantized linear layer runs, chosen at startup.

A quantization method lists its kernels (``{name: "pkg.mod:KernelClass"}``); selection asks each
``supports(problem)``, checks the survivors against the method's reference kernel and times them on
the model's GEMM shapes (:mod:`plinth.quantization.selection`). The winner is instantiated once
per engine with the problem; for every layer it repacks the canonical weights
(:mod:`plinth.quantization.formats`) into its own layout once (:meth:`GemmKernel.prepare`) and then
runs ``y = x @ w.T (+ bias)`` (:meth:`GemmKernel.apply`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from plinth.attention_backends.interface import Support
from plinth.quantization.formats import QuantizedWeights

__all__ = ["GemmKernel", "GemmProblem", "Support"]


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """What the kernels of one model must compute.

    Attributes:
        weight_format: ``"int"`` (:class:`~plinth.quantization.formats.IntWeights`), ``"fp8"`` or ``"gguf"``.
        dtype: the activation and output dtype.
        device_type: ``"cpu"``, ``"cuda"``, ...
        capability: the CUDA compute capability, ``None`` elsewhere.
        bits: code width of integer weights.
        group_size: input features per scale (integer weights); ``None`` for per-channel scales
            (one group spanning each layer's whole input).
        symmetric: every zero point is the code midpoint.
        act_order: input features are permuted (GPTQ ``desc_act``).
        activation: how activations are quantized: ``None`` (kept in ``dtype``), ``"int8_token"`` or
            ``"fp8_token"`` (dynamic, one scale per token).
        block: FP8 block-scale shape ``(bn, bk)``, ``None`` for per-channel scales.
        ggml_types: GGUF block types present (names).
        shapes: ``(N, K)`` of each distinct linear layer on this rank.
    """

    weight_format: str
    dtype: torch.dtype
    device_type: str
    capability: tuple[int, int] | None = None
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool = False
    act_order: bool = False
    activation: str | None = None
    block: tuple[int, int] | None = None
    ggml_types: tuple[str, ...] = ()
    shapes: tuple[tuple[int, int], ...] = ()

    def key(self) -> dict[str, Any]:
        """JSON-serialisable form (part of the selection cache key)."""
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out


class GemmKernel(abc.ABC):
    """One way to compute a quantized linear layer.

    Args:
        problem: what the engine's layers look like; a kernel may read its dtype and group size.
    """

    #: the name under which methods list the kernel (for logs and ``--gemm-kernel``)
    name: ClassVar[str] = ""
    #: preference when selection is off (higher first)
    priority: ClassVar[int] = 0

    def __init__(self, problem: GemmProblem):
        self.problem = problem

    @classmethod
    @abc.abstractmethod
    def supports(cls, problem: GemmProblem) -> Support:
        """Whether the kernel can run ``problem`` here.

        Returns:
            ``Support.yes()`` or ``Support.no(reason)``; the reason is shown to the user (missing
            package, device capability, dtype, shape constraint). Must not raise.
        """

    @abc.abstractmethod
    def prepare(self, weights: QuantizedWeights) -> dict[str, torch.Tensor]:
        """Repack one layer's canonical weights into the kernel's layout.

        Args:
            weights: the layer's weights on the layer's device.

        Returns:
            Named tensors; they become attributes (non-trainable parameters) of the layer and are
            what :meth:`apply` reads.
        """

    #: :meth:`prepare` takes ``silu_pairs=True`` for a gate/up layer (its output's halves are the gate and
    #: up projections of ``silu(gate) * up``) and :meth:`apply_silu_mul` may then compute that in one go
    #: (a subclass that sets it, or inherits it, must accept that keyword; selection checks the fused output
    #: against the reference kernel's)
    silu_pairs: ClassVar[bool] = False

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` ``[M, N / 2]`` of the layer's output ``[M, N]`` (gate half first) for a layer
        prepared with ``silu_pairs=True``, or ``None`` where this input takes :meth:`apply` and a separate
        activation kernel."""
        return None

    #: the kernel quantizes its input rows itself as this :class:`~plinth.kernels.ops.RowQuant` (W8A8 kernels):
    #: the layer before the GEMM (RMSNorm, SiLU-and-mul) may then hand :meth:`apply` the rows already
    #: quantized (:class:`~plinth.kernels.ops.QuantizedRows`), saving a pass over them
    input_quant: ClassVar[Any] = None

    def installed(self, tensors: dict[str, Any]) -> None:
        """Called with a layer's prepared tensors once the layer runs on this kernel (the selected one,
        not a selection trial). Nothing by default."""
        return None

    def decode_tensors(self) -> frozenset[str] | None:
        """The prepared tensors a decode step (a few rows) reads, where the kernel keeps another layout for
        longer inputs; ``None``: all of them. Only the decode floor of benchmarks uses it."""
        return None

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Compute the layer.

        Args:
            layer: a module holding the tensors returned by :meth:`prepare` as attributes.
            x: ``[M, K]`` activations of ``problem.dtype``, contiguous; or, for a kernel with
                :attr:`input_quant`, :class:`~plinth.kernels.ops.QuantizedRows`.
            bias: ``[N]`` or ``None``.

        Returns:
            ``[M, N]`` of ``problem.dtype``.
        """
