"""The quantization-method contract.

A :class:`QuantizationMethod` is registered by a plugin (hook ``plinth_quantization_methods``) under
a name; that name is accepted by ``--quantization`` and is matched against a checkpoint's
``config.json`` ``quantization_config.quant_method``. One instance serves a whole model and is the
*linear method* of every linear layer it quantizes (``get_linear_method(layer)`` returns it):

1. :meth:`from_config` parses the checkpoint's ``quantization_config`` (``None`` when a float
   checkpoint is quantized while loading) and refuses what it cannot run (bit widths, formats);
2. :meth:`create_weights` registers a layer's parameters in the checkpoint's packed layout
   (see :mod:`plinth.quantization.params`), so checkpoint tensors load without conversion;
3. :meth:`prepare_model` (before loading) says which layers it applies to (:meth:`applies_to` on
   their checkpoint names; the others go back to plain weights), gives mixture-of-experts layers
   their :meth:`expert_method` (default: none, the experts stay in floating point) and chooses the
   GEMM kernel for the layers' shapes among :meth:`kernel_candidates` (:mod:`plinth.quantization.selection`);
4. :meth:`process_weights_after_loading` converts a loaded layer, once, to a canonical format
   (:meth:`convert_weights`) and lets the kernel repack it;
5. :meth:`apply` runs ``y = x W^T + b`` through the kernel.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from plinth.config import ConfigError
from plinth.quantization.formats import QuantizedWeights
from plinth.quantization.kernels.interface import GemmKernel, GemmProblem

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from plinth.core.selection_records import SelectionResult


@dataclasses.dataclass(frozen=True)
class GemmWorkload:
    """Rows of the GEMMs timed during kernel selection (part of the cache key): a one-row decode step, a
    batched decode step and a prefill chunk. Each step counts alike (relative to the fastest candidate
    there), so the longest step does not decide alone: a kernel 30% faster at one row and 3% slower at
    512 rows wins."""

    decode_tokens: int = 16
    prefill_tokens: int = 256

    def steps(self) -> dict[str, int]:
        """Step label -> rows, in timing order (the one-row step only where it differs from ``decode``)."""
        steps = {"decode-1": 1} if self.decode_tokens > 1 else {}
        return {**steps, "decode": self.decode_tokens, "prefill": self.prefill_tokens}

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int) -> GemmWorkload:
        """Capped so that a cold selection stays short: 32 decode rows, 512 prefill rows at most."""
        return cls(decode_tokens=min(max_num_seqs, 32), prefill_tokens=min(max_num_batched_tokens, 512))


@dataclasses.dataclass(frozen=True)
class QuantContext:
    """What a method knows about the engine it serves.

    Attributes:
        hf_config: the model's transformers configuration.
        dtype: the compute dtype.
        device: where the model runs.
        source_kind: ``"hf_dir"``, ``"gguf"`` or ``"dummy"`` (random weights).
        capability: the CUDA compute capability, ``None`` elsewhere.
        tp_size: the tensor-parallel world size.
        platform: the platform instance (for timing and cache keys); ``None`` with selection off.
        selection: kernel selection mode, as ``DeviceConfig.selection`` (``"off"`` takes the
            highest-priority supported kernel).
        gemm_kernel: a forced kernel name (``--gemm-kernel``), or ``None``.
        workload: rows timed during selection.
        cache_dir: where selection records live (default: the user cache).
        quantize_lm_head: the LM head is quantized too (``--quantize-lm-head``).
    """

    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    source_kind: str = "hf_dir"
    capability: tuple[int, int] | None = None
    tp_size: int = 1
    platform: Any = None
    selection: str = "off"
    gemm_kernel: str | None = None
    workload: GemmWorkload = dataclasses.field(default_factory=GemmWorkload)
    cache_dir: Path | None = None
    quantize_lm_head: bool = False


class QuantizationMethod(abc.ABC):
    """A quantization method; see the module docstring for the life cycle.

    Args:
        ctx: the engine's :class:`QuantContext`.
    """

    #: the registered name (``--quantization NAME``); set by subclasses
    name: ClassVar[str] = ""
    #: it can quantize a float checkpoint while loading (``--quantization NAME`` on bf16 weights)
    quantizes_float_checkpoints: ClassVar[bool] = False
    #: checkpoint ``quant_method`` values it reads besides its own name
    checkpoint_aliases: ClassVar[tuple[str, ...]] = ()
    #: model sources it loads (``"hf_dir"``, ``"dummy"``, ``"gguf"``)
    source_kinds: ClassVar[tuple[str, ...]] = ("hf_dir",)
    #: the kernel every other candidate is checked against
    reference_kernel: ClassVar[str] = "dequant"
    #: it can quantize the LM head's float weight (``--quantize-lm-head``; see :meth:`float_weights`)
    quantizes_lm_head: ClassVar[bool] = False
    #: what the checkpoint calls the modules the model names ``model.*`` (an image-and-text checkpoint's language
    #: model: ``language_model.model.``, ``model.language_model.``; the loader sets it): its settings (ignore lists,
    #: targets) name them so
    checkpoint_prefix: str = "model."

    def __init__(self, ctx: QuantContext):
        self.ctx = ctx
        self.kernel: GemmKernel | None = None
        self.kernel_selection: SelectionResult | None = None
        self.problem: GemmProblem | None = None

    # -- configuration ------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def from_config(cls, quant_config: dict[str, Any] | None, ctx: QuantContext) -> QuantizationMethod:
        """Build the method for a model.

        Args:
            quant_config: the checkpoint's ``quantization_config`` mapping, or ``None`` when a float
                checkpoint is to be quantized while loading.
            ctx: the engine context.

        Raises:
            ConfigError: a setting the method cannot run (bit width, format, scheme); the message
                names it and what is supported.
        """

    def applies_to(self, name: str) -> bool:
        """Whether the checkpoint module ``name`` (e.g. ``model.layers.0.self_attn.q_proj``) is quantized."""
        return True

    # -- the linear-method protocol (plinth.model_registry.layers.linear) ----------------

    def get_linear_method(self, layer: nn.Module) -> Any:
        """The linear method of ``layer``: this method (layers it skips are switched back in
        :meth:`prepare_model`, once their checkpoint names are known)."""
        return self

    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """Register the layer's parameters in the checkpoint's layout.

        Args:
            layer: the linear layer (its ``tp_rank``/``tp_size`` and partition sizes are set).
            input_size: input features on this rank.
            output_sizes: output features on this rank, one entry per fused projection.
        """

    @abc.abstractmethod
    def convert_weights(self, layer: nn.Module) -> QuantizedWeights:
        """The loaded layer's weights in a canonical format (:mod:`plinth.quantization.formats`).

        Raises:
            ModelLoadError: loaded values that are inconsistent (e.g. an act-order index that is not
                a permutation of the groups).
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the checkpoint-layout parameters once and hand them to the kernel's layout."""
        if self.kernel is None:
            raise RuntimeError(f"{self.name}: no GEMM kernel chosen; prepare_model() selects one")
        weights = self.convert_weights(layer)
        for name in [n for n in layer._parameters if n != "bias"]:
            del layer._parameters[name]
        pairs = {"silu_pairs": True} if getattr(layer, "feeds_silu_and_mul", False) and self.kernel.silu_pairs else {}
        prepared = self.kernel.prepare(weights, **pairs)
        self.kernel.installed(prepared)
        for name, value in prepared.items():
            if isinstance(value, torch.Tensor):
                layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                setattr(layer, name, value)
        decode = self.kernel.decode_tensors()
        if decode is not None and decode & set(layer._parameters):   # this layer keeps the decode layout
            layer.decode_tensors = decode | {"perm"}

    def float_weights(self, weight: torch.Tensor) -> QuantizedWeights:
        """A float weight ``[N, K]`` in the method's format, quantized now (methods with
        :attr:`quantizes_lm_head`)."""
        raise NotImplementedError(f"{self.name} does not quantize float weights outside its layers")

    def quantize_lm_head(self, head: nn.Module, *, tied: bool) -> bool:
        """Give ``head`` (an :class:`~plinth.model_registry.layers.embedding.LMHead`, float ``weight``
        ``[vocab rows, hidden]``) a quantized copy run by a kernel selected for its shape alone (its own
        selection record: the head neither votes on the layers' kernel nor disqualifies one for them). The
        copy lives in a child module ``quantized`` and is the head's ``gemm``; the float weight is released
        unless ``tied`` (the embedding reads it). Returns False, keeping the float head, where the reference
        kernel (dequantize-then-matmul, which expands the whole matrix per call: slower than the float head)
        is the only one that runs it or the fastest one, unless it was forced (``--gemm-kernel``).

        Raises:
            ConfigError: ``head`` is not an ``LMHead``.
            SelectionError: a forced kernel (``--gemm-kernel``) cannot run the head's shape.
        """
        from plinth.errors import SelectionError
        from plinth.model_registry.layers.embedding import LMHead
        from plinth.quantization.selection import holder, select_gemm_kernel

        if not isinstance(head, LMHead):
            raise ConfigError(f"--quantize-lm-head: the model's lm_head is a {type(head).__name__}, not plinth's "
                              f"LMHead")
        weight = head.weight
        problem = self.gemm_problem((tuple(weight.shape),))
        try:
            result = select_gemm_kernel(self, problem)
        except SelectionError as exc:
            raise SelectionError(f"the LM head ({weight.shape[0]} x {weight.shape[1]}, --quantize-lm-head): {exc}") \
                from None
        head.kernel_selection = result
        if result.winner == self.reference_kernel and not result.how.startswith("forced"):
            others = [c.name for c in result.candidates if c.supported and not c.reason and not c.chosen]
            why = (f"was faster than {', '.join(others)}" if others else "is the only kernel that runs it here")
            logger.warning("%s: for the LM head's %d x %d, %s %s; the head stays in %s (the reference expands "
                           "the whole matrix per call)", self.name, weight.shape[0], weight.shape[1],
                           result.winner, why, weight.dtype)
            return False
        logger.info("%s: the LM head's %d x %d runs on %s", self.name, weight.shape[0], weight.shape[1],
                    result.winner)
        kernel = result.instantiate(problem)
        with torch.no_grad():
            prepared = kernel.prepare(self.float_weights(weight))
        kernel.installed(prepared)
        module = holder(prepared)
        decode = kernel.decode_tensors()
        if decode is not None and decode & set(module._parameters):
            module.decode_tensors = decode | {"perm"}
        head.quantized = module
        head.gemm = functools.partial(_run_kernel, kernel, module, bias=None)
        if not tied:
            head.weight = nn.Parameter(weight.new_empty((0, weight.shape[1])), requires_grad=False)
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]`` through the selected kernel."""
        assert self.kernel is not None
        return _run_kernel(self.kernel, layer, x, bias)

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate/up layer's output in one kernel where the selected kernel can for
        this input (see :attr:`GemmKernel.silu_pairs`); ``None``: :meth:`apply` and a separate activation."""
        assert self.kernel is not None
        if not getattr(layer, "feeds_silu_and_mul", False) or x.dim() != 2 or not x.is_contiguous():
            return None
        if type(self).apply is not QuantizationMethod.apply:   # a method with its own apply keeps it
            return None
        return self.kernel.apply_silu_mul(layer, x, bias)

    def input_quant(self, layer: nn.Module) -> Any:
        """How ``layer``'s kernel wants its input rows quantized (:attr:`GemmKernel.input_quant`), for the
        kernel before the layer to do it; ``None``: a plain input."""
        if self.kernel is None or type(self).apply is not QuantizationMethod.apply:
            return None
        return self.kernel.input_quant

    # -- kernels --------------------------------------------------------------------------

    @abc.abstractmethod
    def kernel_candidates(self) -> dict[str, str]:
        """``{kernel_name: "pkg.mod:GemmKernelClass"}``; must include :attr:`reference_kernel`."""

    @abc.abstractmethod
    def gemm_problem(self, shapes: tuple[tuple[int, int], ...]) -> GemmProblem:
        """What the kernels must compute for layers of these ``(N, K)`` shapes."""

    @abc.abstractmethod
    def random_weights(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> QuantizedWeights:
        """Random weights of shape ``[n, k]`` in the canonical format, for kernel checks and timing."""

    def kernel_tolerance(self) -> float:
        """The largest error (relative to the output's magnitude) a kernel may have against the reference."""
        return {torch.float32: 2e-3, torch.float16: 1e-2}.get(self.ctx.dtype, 3e-2)

    def select_kernel(self, shapes: Iterable[tuple[int, int]]) -> SelectionResult:
        """Choose the GEMM kernel for layers of these shapes (see :mod:`plinth.quantization.selection`).

        Raises:
            SelectionError: a forced kernel is unknown or cannot run, or none can.
        """
        from plinth.quantization.selection import select_gemm_kernel

        self.problem = self.gemm_problem(tuple(sorted(set(shapes))))
        result = select_gemm_kernel(self, self.problem)
        self.kernel = result.instantiate(self.problem)
        self.kernel_selection = result
        return result

    # -- loading --------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        """Before loading: switch the layers :meth:`applies_to` rejects to plain weights, then
        select the kernel for the shapes of the others.

        Raises:
            ConfigError: the model has no layer this method can quantize, or a fused layer whose
                projections are quantized differently.
            SelectionError: no kernel can run.
        """
        from plinth.quantization.layers import checkpoint_names, use_plain_weights

        shapes = []
        for name, layer in model.named_modules():
            if getattr(layer, "linear_method", None) is not self:
                continue
            names = checkpoint_names(model, name, layer)
            verdicts = [self.applies_to(self._in_checkpoint(n)) for n in names]
            if all(verdicts):
                shapes.append((sum(layer.output_sizes_per_partition), layer.input_size_per_partition))
            elif not any(verdicts):
                use_plain_weights(layer, self.ctx.dtype)
            else:
                raise ConfigError(f"{self.name}: layer {name!r} fuses {', '.join(names)}, but the checkpoint "
                                  f"quantizes only some of them")
        if not shapes:
            raise ConfigError(f"{self.name}: {type(model).__name__} has no linear layer this method quantizes "
                              f"(architectures run through the transformers fallback cannot be quantized)")
        self.prepare_experts(model)
        self.select_kernel(shapes)

    def _in_checkpoint(self, name: str) -> str:
        """The checkpoint's name of the model's module ``name`` (see :attr:`checkpoint_prefix`)."""
        return self.checkpoint_prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def expert_method(self, layer: nn.Module) -> Any:
        """How the experts of a mixture-of-experts layer (:class:`~plinth.model_registry.layers.moe.FusedMoE`) are
        stored: an object with ``create_weights(layer)`` (before loading) and ``process_weights_after_loading(layer)``
        (see :mod:`plinth.quantization.fp8_experts`), or ``None`` (default): they stay in floating point."""
        return None

    def prepare_experts(self, model: nn.Module) -> int:
        """Give the experts of every mixture-of-experts layer :meth:`applies_to` accepts (under each expert
        projection's checkpoint name) their :meth:`expert_method`; returns how many layers took one.

        Raises:
            ConfigError: a layer some of whose experts the checkpoint quantizes and others not.
        """
        from plinth.model_registry.layers.moe import FusedMoE

        count = 0
        for name, layer in model.named_modules():
            method = self.expert_method(layer) if isinstance(layer, FusedMoE) else None
            if method is None:
                continue
            # each expert projection's checkpoint module name (also for the messages of the expert method)
            names = {(e, role): model.checkpoint_name(f"{name}.{which}_weight", (e, role)).split(" (shard")[0]
                     .removesuffix(".weight") if hasattr(model, "checkpoint_name") else name
                     for e in range(layer.num_experts) for which, role in (("w13", "gate"), ("w13", "up"),
                                                                           ("w2", "down"))}
            layer.__dict__["expert_checkpoint_names"] = names
            verdicts = {n: self.applies_to(self._in_checkpoint(n)) for n in dict.fromkeys(names.values())}
            if not any(verdicts.values()):
                continue
            if not all(verdicts.values()):
                kept = [n for n, v in verdicts.items() if not v]
                raise ConfigError(f"{self.name}: the checkpoint keeps {', '.join(kept[:3])}"
                                  f"{' and more' if len(kept) > 3 else ''} in floating point and quantizes the other "
                                  f"experts of {name}; plinth stores a layer's experts alike")
            method.create_weights(layer)
            layer.weight_method = method
            count += 1
        return count

    def weights_iterator(self, source: Any, model: nn.Module) -> Iterable[tuple[str, Any]] | None:
        """Checkpoint tensors to load instead of the loader's own (``None``: the loader's)."""
        return None


def _run_kernel(kernel: GemmKernel, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[..., K]`` (or :class:`~plinth.kernels.ops.QuantizedRows`) -> ``[..., N]`` through ``kernel``
    on ``layer``'s prepared tensors."""
    if not isinstance(x, torch.Tensor):   # QuantizedRows, for a kernel with input_quant
        if kernel.input_quant is None:
            raise TypeError(f"{kernel.name} takes plain activations, not {type(x).__name__}")
        return kernel.apply(layer, x, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = kernel.apply(layer, x2, bias)
    return out.reshape(*lead, out.shape[-1])
