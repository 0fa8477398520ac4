"""Mixture-of-experts: softmax top-k routing and stacked expert weights, in plain torch.

Expert weights are stacked per layer: ``w13_weight`` ``[E, 2 * I, H]`` (gate rows, then up rows)
and ``w2_weight`` ``[E, H, I]``. Under tensor parallelism each rank holds ``I / tp_size`` of the
intermediate features of every expert and the outputs are summed with an all-reduce.
Checkpoint tensors arrive per expert with shard ids ``(expert, "gate" | "up" | "down")``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plinth.distributed.communication import tp_all_reduce
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.kernels import ops
from plinth.model_registry.layers.linear import ReplicatedLinear, divide

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\."
                        r"(?P<kind>[A-Za-z_]*(?:weight|scale|zeros|zero_point|g_idx)[A-Za-z_]*)$")
#: the tensors of one expert projection plinth reads: the weight, and a quantized checkpoint's packed tensors
EXPERT_TENSOR_KINDS = ("weight", "weight_scale", "weight_scale_inv", "input_scale",   # FP8
                       "qweight", "qzeros", "scales", "g_idx",                         # AWQ, GPTQ
                       "weight_packed", "weight_zero_point", "weight_shape", "input_zero_point")  # compressed-tensors


def map_expert_weight(name: str, proj_names: dict[str, str]) -> tuple[str, Any] | None:
    """Map ``...experts.{e}.{proj}.{kind}`` to ``(...experts.w13_{kind}|w2_{kind}, (e, role))`` (``kind``: the
    ``weight``, or one of a quantized checkpoint's :data:`EXPERT_TENSOR_KINDS`).

    ``proj_names`` maps checkpoint projection names to roles, e.g. ``{"w1": "gate", "w3": "up",
    "w2": "down"}``. Returns ``None`` when ``name`` is not an expert tensor.

    Raises:
        ModelLoadError: an expert tensor of a format plinth does not read.
    """
    m = _EXPERT_RE.match(name)
    if m is None or m["proj"] not in proj_names:
        return None
    if m["kind"] not in EXPERT_TENSOR_KINDS:
        raise ModelLoadError(f"checkpoint tensor {name!r}: experts quantized in this format ({m['kind']}) are not "
                             f"supported; plinth reads float experts, FP8 ones and those of AWQ, GPTQ and "
                             f"compressed-tensors checkpoints")
    role = proj_names[m["proj"]]
    param = ("w2_" if role == "down" else "w13_") + m["kind"]
    return f"{m['prefix']}.{param}", (int(m["expert"]), role)


def expert_checkpoint_name(param_name: str, shard_id: Any, proj_names: dict[str, str]) -> str:
    """The inverse of :func:`map_expert_weight`, for error messages."""
    expert, role = shard_id
    proj = next(p for p, r in proj_names.items() if r == role)
    prefix, param = param_name.rsplit(".", 1)
    return f"{prefix}.{expert}.{proj}.{param.split('_', 1)[1]}"


class FusedMoE(nn.Module):
    """The experts of one MoE layer.

    Args:
        num_experts: experts in the layer.
        top_k: experts per token.
        hidden_size: model width.
        intermediate_size: each expert's full intermediate width.
        renormalize: rescale the top-k probabilities to sum to one.
        bias: each expert's projections have biases (``w13_bias`` ``[E, 2 * I]``, ``w2_bias`` ``[E, H]``; under
            tensor parallelism the rank that adds ``w2_bias`` is rank 0).
        activation: ``h = activation(gate, up)`` (default ``silu(gate) * up``).

    A quantization method may store the experts in another format before loading (``weight_method``, e.g.
    :class:`plinth.quantization.fp8_experts.FP8ExpertMethod`); :meth:`expert_weight` then widens one expert's
    weight at a time.
    """

    #: the checkpoint holds one tensor per expert and projection (``experts.{e}.{proj}.weight``), so a quantized
    #: checkpoint's experts and their scales can be read (subclasses that load stacked tensors say False)
    loads_per_expert_tensors: ClassVar[bool] = True
    #: quantized experts on the grouped-GEMM path are widened this many weight elements at a time (a run of
    #: experts per projection: 128 MiB of bfloat16 plus the widening's float32 temporaries)
    widen_chunk_elements: ClassVar[int] = 64 << 20

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, *, tp_rank: int = 0, tp_size: int = 1, bias: bool = False,
                 activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.hidden_size = hidden_size
        self.activation = activation or _silu_and_mul
        self.intermediate_per_rank = divide(intermediate_size, tp_size, "MoE intermediate size")
        i = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * i), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None
        for p, roles in ((self.w13_weight, ("gate", "up")), (self.w2_weight, ("down",))):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            p.expected_shards = tuple((e, r) for e in range(num_experts) for r in roles)  # type: ignore[attr-defined]
        #: set by a quantization method that stores the experts in its own format (``None``: floating point)
        self.weight_method: Any = None
        #: ``{"w13": ExpertScales, "w2": ExpertScales}`` once FP8 experts are loaded (read by the GEMV kernel)
        self.fp8_scales: dict[str, Any] | None = None
        #: ``(block_m, (BLOCK_N, BLOCK_K, warps, stages))`` for the Triton grouped kernel (``None``: by the step's
        #: size, :func:`~plinth.kernels.ops.moe_grouped_tiles`; ``benchmarks/moe_experts.py --sweep-tiles`` times
        #: the candidates)
        self.grouped_kernel_tiles: tuple[int, tuple[int, int, int, int]] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, role = shard_id
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"expert index {expert} out of range (the layer has {self.num_experts} experts)")
        i, hidden = self.intermediate_per_rank, self.hidden_size
        if role == "down":
            want = (hidden, i * self.tp_size)
            if tuple(loaded.shape) != want:
                raise ModelLoadError(f"shape mismatch: expected {want}, checkpoint has {tuple(loaded.shape)}")
            param.data[expert].copy_(loaded.narrow(1, self.tp_rank * i, i))
            return
        want = (i * self.tp_size, hidden)
        if tuple(loaded.shape) != want:
            raise ModelLoadError(f"shape mismatch: expected {want}, checkpoint has {tuple(loaded.shape)}")
        offset = 0 if role == "gate" else i
        param.data[expert, offset:offset + i].copy_(loaded.narrow(0, self.tp_rank * i, i))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert weights ``[T, K]`` (float32) and ids ``[T, K]`` from router logits ``[T, E]`` (one kernel on
        Triton devices: :func:`plinth.kernels.ops.moe_route`)."""
        if ops.moe_route_enabled(router_logits, self.top_k):
            return ops.moe_route(router_logits, self.top_k, self.renormalize)
        probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def expert_weight(self, which: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s ``w13`` ``[2I, H]`` or ``w2`` ``[H, I]`` weight in ``dtype`` (quantized experts
        widened by their ``weight_method``)."""
        if self.weight_method is None:
            return getattr(self, f"{which}_weight")[expert]
        return self.weight_method.widen(self, which, expert, dtype)

    def uses_grouped_gemm(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the grouped-GEMM path: every expert's rows in one ``torch._grouped_mm`` launch per
        projection, with no host read of the routing (so a CUDA graph can capture it). It needs a CUDA device of
        compute capability 9.0 or later and bfloat16 (torch's grouped kernels; for other types torch loops on the
        host), with 16-byte aligned rows."""
        return self._grouped_gemm_runs(x.device, x.dtype)

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether decode steps of every size through these experts can be captured in device graphs: on the
        grouped GEMMs (:meth:`uses_grouped_gemm`), or on the Triton kernels (:meth:`uses_gemv` for a few rows,
        :meth:`uses_grouped_kernel` for more: float experts without grouped GEMMs, FP8 and integer codes); not
        where a step reads the routing on the host (the per-expert loop, the widened runs)."""
        if self._grouped_gemm_runs(device, dtype):
            return True
        return device.type == "cuda" and ops.triton_kernels_on(device) and self._kernels_read(device)

    def _kernels_read(self, device: torch.device) -> bool:
        """Whether the Triton expert kernels read these experts' format on ``device`` (float experts; FP8 where
        Triton widens E4M3; integer codes without act order: ``gemv_args``)."""
        if self.num_experts < self.top_k:
            return False
        if self.fp8_scales is not None and ops.triton_fp8_refusal(
                device.type, _capability(device) if device.type == "cuda" else None) is not None:
            return False
        return all(self._gemv_args(which) is not None for which in ("w13", "w2"))

    def _grouped_gemm_runs(self, device: torch.device, dtype: torch.dtype, quantized: bool = False) -> bool:
        if (device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm")
                or (self.weight_method is not None) != quantized):
            return False
        align = 16 // dtype.itemsize
        return (_capability(device) >= (9, 0) and self.hidden_size % align == 0
                and self.intermediate_per_rank % align == 0)

    def uses_widened_grouped_gemm(self, x: torch.Tensor) -> bool:
        """Whether quantized experts take the grouped GEMMs for ``x`` ``[T, H]``: where the step's token copies
        reach most experts (``T * top_k`` above the expert count: prefill, large decode batches), runs of experts are
        widened together and each run is two grouped GEMMs, instead of one widening and two small GEMMs per expert
        (same device conditions as :meth:`uses_grouped_gemm`; one host read of the routing)."""
        return x.shape[0] * self.top_k > self.num_experts and self._grouped_gemm_runs(x.device, x.dtype, True)

    def uses_gemv(self, x: torch.Tensor) -> bool:
        """Whether ``x`` ``[T, H]`` takes the per-slot GEMV kernel (:func:`plinth.kernels.ops.moe_gemv`): a few
        tokens (``T * top_k`` at most the expert count, so each chosen expert's weights are read about once), on a
        Triton device, for float experts and those whose method gives the kernel its format (``gemv_args``: FP8,
        integer codes without act order). No host read of the routing either."""
        return 0 < x.shape[0] * self.top_k <= self.num_experts and ops.moe_gemv_enabled(x) and self._kernels_read(
            x.device)

    def uses_grouped_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``x`` ``[T, H]`` takes the Triton grouped kernel (:func:`plinth.kernels.ops.moe_grouped_gemm`):
        token copies above the expert count (prefill, larger decode batches) where the grouped GEMMs do not run
        (:meth:`uses_grouped_gemm`), on a Triton device, for the formats of :meth:`uses_gemv`. Each block of one
        expert's rows widens that expert's weight tiles in registers; no host read of the routing."""
        return x.shape[0] * self.top_k > self.num_experts and ops.moe_gemv_enabled(x) and self._kernels_read(
            x.device)

    def _gemv_args(self, which: str) -> dict[str, Any] | None:
        """The keyword arguments :func:`~plinth.kernels.ops.moe_gemv` reads ``which``'s experts with (``{}``: float),
        or ``None`` where the kernel cannot read their format."""
        if self.weight_method is None:
            return {}
        gemv_args = getattr(self.weight_method, "gemv_args", None)
        return None if gemv_args is None else gemv_args(self, which)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, ``router_logits`` ``[T, E]`` -> ``[T, H]``."""
        weights, ids = self.route(router_logits)
        if self.uses_gemv(x):
            return self._forward_gemv(x, weights, ids)
        if self.uses_grouped_gemm(x):
            return self._forward_grouped(x, weights, ids)
        if self.uses_grouped_kernel(x):
            return self._forward_grouped_kernel(x, weights, ids)
        if self.uses_widened_grouped_gemm(x):
            return self._forward_widened(x, weights, ids)
        flat_ids = ids.reshape(-1)                                # [T * K]
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // self.top_k                            # [T * K] source token of each slot
        slot_weights = weights.reshape(-1)[order]                 # [T * K]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w13_bias, w2_bias = self.w13_bias, (self.w2_bias if self.tp_rank == 0 else None)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            gate, up = F.linear(x[rows], self.expert_weight("w13", expert, x.dtype),
                                None if w13_bias is None else w13_bias[expert]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.activation(gate, up), self.expert_weight("w2", expert, x.dtype),
                         None if w2_bias is None else w2_bias[expert])                   # [n, H]
            out.index_add_(0, rows, y.to(torch.float32) * slot_weights[start:start + n, None])
            start += n
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out.to(x.dtype)

    def _forward_gemv(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts as two per-slot GEMV launches (slot ``t * K + j``: token ``t``'s ``j``-th expert), the
        default activation inside the second, then one weighted sum per token."""
        k = ids.shape[1]
        experts = ids.reshape(-1).contiguous()                                       # [T * K]
        x = x if x.stride(-1) == 1 else x.contiguous()
        gate_up = ops.moe_gemv(x, self.w13_weight, self.w13_bias, experts, k, **self._gemv_args("w13"))  # [T*K, 2I]
        return self._down_and_combined(gate_up, weights, x.dtype, lambda h, bias, **kw: ops.moe_gemv(
            h, self.w2_weight, bias, experts, 1, **kw))

    def _forward_grouped_kernel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts as two launches of the Triton grouped kernel over the slots sorted by expert on the device
        (gate/up rows in sorted order, down projection outputs back in slot order), then one weighted sum per
        token."""
        block_m, tiles = self.grouped_kernel_tiles or ops.moe_grouped_tiles(
            ids.numel(), self.num_experts, "int_codes" in (self._gemv_args("w13") or {}),
            self.w13_weight.dtype == torch.float32)
        blocks = ops.moe_sorted_blocks(ids, self.num_experts, block_m)
        x = x if x.stride(-1) == 1 else x.contiguous()
        gate_up = ops.moe_grouped_gemm(x, self.w13_weight, self.w13_bias, blocks, gather_div=ids.shape[1],
                                       scatter_out=False, tiles=tiles, **self._gemv_args("w13"))   # [T * K, 2I]
        return self._down_and_combined(gate_up, weights, x.dtype, lambda h, bias, **kw: ops.moe_grouped_gemm(
            h, self.w2_weight, bias, blocks, gather_div=None, scatter_out=True, tiles=tiles, **kw))

    def _down_and_combined(self, gate_up: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                           down: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The down projection of the kernels' paths (``down(h, bias, **format)`` -> ``[T * K, H]`` in slot order;
        the default activation inside it), then each token's outputs weighted and summed (all-reduced under TP)."""
        w2_bias = self.w2_bias if self.tp_rank == 0 else None
        if self.activation is _silu_and_mul:
            y = down(gate_up, w2_bias, silu_mul_input=True, **self._gemv_args("w2"))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            y = down(self.activation(gate, up).contiguous(), w2_bias, **self._gemv_args("w2"))
        if self.tp_size == 1:
            return ops.moe_combine(y, weights, dtype)
        out = ops.moe_combine(y, weights, torch.float32)
        tp_all_reduce(out)
        return out.to(dtype)

    def _sorted_slots(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The token copies sorted by expert: ``(order, sorted_ids, ends, rows)``, ``ends`` ``[E]`` int32 the end row
        of each expert's run and ``rows`` ``[T * K, H]`` the copies of ``x`` (all on the device)."""
        flat_ids = ids.reshape(-1)                                                   # [T * K]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        return (order, flat_ids.index_select(0, order), counts.cumsum(0, dtype=torch.int32),
                x.index_select(0, order // ids.shape[1]))

    def _experts_run(self, rows: torch.Tensor, offsets: torch.Tensor, sorted_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` outputs of the sorted token copies ``rows`` of a run of experts (``w13`` ``[n, 2I, H]``, ``w2``
        ``[n, H, I]``, ``offsets`` ``[n]`` the end row of each), biases added."""
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)         # [R, 2I]
        if self.w13_bias is not None:
            gate_up = gate_up + self.w13_bias.index_select(0, sorted_ids)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(self.activation(gate, up).contiguous(), w2.transpose(1, 2), offs=offsets)   # [R, H]
        if self.w2_bias is not None and self.tp_rank == 0:
            y = y + self.w2_bias.index_select(0, sorted_ids)
        return y

    def _combined(self, y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The token copies' outputs ``y`` ``[T * K, H]`` (sorted by ``order``) weighted and summed per token,
        float32 (all-reduced under TP)."""
        t, k = weights.shape
        unsorted = torch.empty_like(y, dtype=torch.float32)
        unsorted[order] = y.to(torch.float32)
        out = (unsorted.view(t, k, -1) * weights[..., None]).sum(dim=1)             # [T, H] float32
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out

    def _forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts as two grouped GEMMs over the token copies sorted by expert (all on the device)."""
        order, sorted_ids, ends, rows = self._sorted_slots(x, ids)
        y = self._experts_run(rows, ends, sorted_ids, self.w13_weight, self.w2_weight)
        return self._combined(y, order, weights).to(x.dtype)

    def _forward_widened(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Quantized experts as grouped GEMMs over runs of experts widened together (:attr:`widen_chunk_elements`
        per projection); a run no token chose is skipped."""
        order, sorted_ids, ends, rows = self._sorted_slots(x, ids)
        bounds = [0, *ends.tolist()]                                                 # the one host read
        per_expert = max(self.hidden_size * self.intermediate_per_rank * 2, 1)
        run = max(1, self.widen_chunk_elements // per_expert)
        y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        method = self.weight_method
        for first in range(0, self.num_experts, run):
            last = min(first + run, self.num_experts)
            start, end = bounds[first], bounds[last]
            if start == end:
                continue
            w13 = self._widened(method, "w13", first, last, x.dtype)                 # [n, 2I, H]
            w2 = self._widened(method, "w2", first, last, x.dtype)                   # [n, H, I]
            y[start:end] = self._experts_run(rows[start:end], ends[first:last] - start, sorted_ids[start:end],
                                             w13, w2)
        return self._combined(y, order, weights).to(x.dtype)

    def _widened(self, method: Any, which: str, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``first..last-1`` of ``which`` widened: by the method's ``widen_range`` where it has one (one
        conversion for the run), else one expert at a time."""
        widen_range = getattr(method, "widen_range", None)
        if widen_range is not None:
            return widen_range(self, which, first, last, dtype)
        return torch.stack([method.widen(self, which, e, dtype) for e in range(first, last)])


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]], stacked: re.Pattern[str],
                          inputs_first: bool = False, hidden: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked expert tensors as the per-expert ones the experts load from (``{prefix}.E.{gate,up,down}_proj.weight``,
    ``[out, in]``); every other tensor as it is.

    ``stacked`` matches a stacked tensor's name with groups ``prefix`` (``...experts``) and ``which``
    (``gate_up_proj`` or ``down_proj``). Layouts: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
    ``down_proj`` ``[E, H, I]`` (transformers' Qwen3.5-MoE), or with ``inputs_first`` ``[E, H, 2I]`` and ``[E, I, H]``
    (Llama 4). ``hidden``: the model width, which tells the two layouts apart tensor by tensor (Qwen3-VL-MoE's
    released checkpoints put the inputs first, transformers writes them last); transformers' where both would fit. Only
    floating-point tensors: quantized experts come one tensor per expert.

    Raises:
        ModelLoadError: a stacked tensor of another rank or an odd gate/up width, or one in an 8-bit or integer type.
    """
    gate_up, down = ("[experts, hidden, 2 x intermediate]", "[experts, intermediate, hidden]") if inputs_first \
        else ("[experts, 2 x intermediate, hidden]", "[experts, hidden, intermediate]")
    for name, t in weights:
        m = stacked.match(name)
        if m is None:
            yield name, t
            continue
        if not t.dtype.is_floating_point or t.element_size() == 1:   # (8-bit floats too)
            raise ModelLoadError(f"{name}: stacked experts in {str(t.dtype).removeprefix('torch.')} are not "
                                 "supported; plinth reads stacked experts in floating point and quantized ones one "
                                 "tensor per expert")
        if hidden is not None and t.dim() == 3:   # the inputs' axis is the one of the model's width
            ins, outs = (1, 2) if m["which"] == "gate_up_proj" else (2, 1)   # the width's axis, inputs first
            inputs_first = t.shape[ins] == hidden and t.shape[outs] != hidden
            gate_up, down = ("[experts, hidden, 2 x intermediate]", "[experts, intermediate, hidden]") if inputs_first \
                else ("[experts, 2 x intermediate, hidden]", "[experts, hidden, intermediate]")
        if t.dim() != 3 or (m["which"] == "gate_up_proj" and t.shape[2 if inputs_first else 1] % 2):
            raise ModelLoadError(f"{name}: expected {gate_up} (gate_up_proj) or {down} (down_proj), checkpoint has "
                                 f"{tuple(t.shape)}")
        if inputs_first:
            t = t.transpose(1, 2)   # [E, out, in]
        prefix, half = m["prefix"], t.shape[1] // 2
        for e in range(t.shape[0]):
            if m["which"] == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            else:
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", t[e, half:]


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (asked once per device: the experts ask at every forward)."""
    return torch.cuda.get_device_capability(device)


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def check_expert_activation(name: str) -> None:
    """Refuse a config whose experts are not SiLU-gated (the only kind :class:`SparseMoeBlock` computes)."""
    if name not in ("silu", "swish"):
        raise UnsupportedModelError(f"mixture-of-experts layers run SiLU-gated experts; the config's activation "
                                    f"(hidden_act) is {name!r}")


class SparseMoeBlock(nn.Module):
    """A router (``gate``) and its experts (``experts``), the layout of Mixtral and Qwen3-MoE."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.experts(x, self.gate(x))
