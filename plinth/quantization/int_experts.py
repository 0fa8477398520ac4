"""Integer experts: the stacked weights of a mixture-of-experts layer (:class:`~plinth.model_registry.layers.moe.FusedMoE`)
kept as 4- or 8-bit codes with group-wise scales and zero points.

Sources:

- checkpoints of an integer method (AWQ, GPTQ, compressed-tensors ``pack-quantized``/``int-quantized``): each expert
  projection's packed tensors (``experts.{e}.{proj}.qweight``, ``qzeros``, ``scales``, ``g_idx``; or
  ``weight_packed``, ``weight_scale``, ...) load into a stand-in linear layer of that method (column-parallel for
  gate and up, row-parallel for down, so tensor-parallel cuts and packing checks are the linear layers' own), and
  the method's own conversion turns each into :class:`~plinth.quantization.formats.IntWeights` once loaded;
- float experts quantized by a method that quantizes float weights (``--quantization int4``), per expert, as it
  quantizes a linear layer.

After loading (``E`` experts, ``N`` rows, ``K`` input features of one stacked projection):
``w13_weight``/``w2_weight`` ``[E, N, K / 2]`` uint8 for 4 bits (two codes per byte, the even feature in the low
nibble) or ``[E, N, K]`` for 8 bits, ``w13_scales``/``w13_zeros`` ``[E, N, K / g]`` float32, and, for act-order
GPTQ checkpoints, ``w13_perm`` ``[E, 2, K]`` (gate, up) / ``w2_perm`` ``[E, 1, K]``. Each chosen expert is widened
to the model's dtype when it runs (half of bfloat16's bytes at 8 bits, a quarter at 4).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from plinth.errors import ModelLoadError
from plinth.quantization.formats import IntWeights

_ROLES = {"w13": ("gate", "up"), "w2": ("down",)}


class IntExpertMethod:
    """The integer storage of a :class:`FusedMoE` layer's experts (see the module docstring).

    Args:
        method: the model's integer quantization method (an
            :class:`~plinth.quantization.int_method.IntWeightMethod`).
        from_checkpoint: the checkpoint holds the method's packed experts (else float experts are quantized with
            ``method.float_weights`` once loaded).
    """

    def __init__(self, method: Any, *, from_checkpoint: bool):
        self.method = method
        self.from_checkpoint = from_checkpoint

    # -- before loading --------------------------------------------------------------------------

    def create_weights(self, layer: nn.Module) -> None:
        """Checkpoint sources: one stand-in linear layer per expert projection (kept outside the module tree), and
        on ``layer`` one placeholder parameter per packed tensor kind (``w13_qweight``, ...) that hands each
        checkpoint tensor to its stand-in."""
        if not self.from_checkpoint:
            return
        from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear

        e, i, h = layer.num_experts, layer.intermediate_per_rank, layer.w2_weight.shape[1]
        tp = {"tp_rank": layer.tp_rank, "tp_size": layer.tp_size, "quant_method": self.method}
        device = layer.w2_weight.device
        stand_ins: dict[tuple[int, str], nn.Module] = {}
        with torch.device(device):
            for x in range(e):
                for role in ("gate", "up"):
                    stand_ins[x, role] = ColumnParallelLinear(h, i * layer.tp_size, bias=False, **tp)
                stand_ins[x, "down"] = RowParallelLinear(i * layer.tp_size, h, bias=False, **tp)
        layer.__dict__["int_stand_ins"] = stand_ins      # not submodules: the model's loader must not see them
        params = stand_ins[0, "gate"]._parameters
        self.kinds = [k for k, p in params.items() if p is not None]
        # kinds whose default stands where the checkpoint has none (GPTQ's g_idx without act order)
        self.optional = {k for k in self.kinds if getattr(params[k], "optional_in_checkpoint", False)}
        self.packed: set[tuple[int, str, str]] = set()   # (expert, role, kind) loaded
        self.floats: set[tuple[int, str]] = set()        # (expert, role) loaded as a float weight
        for which in _ROLES:
            old = layer._parameters.pop(f"{which}_weight")
            if "weight" not in self.kinds:   # a checkpoint may keep its experts float: room made when they come
                lazy = nn.Parameter(torch.empty(0, dtype=old.dtype, device=device), requires_grad=False)
                lazy.weight_loader = functools.partial(self._load_float, layer, tuple(old.shape))  # type: ignore[attr-defined]
                lazy.expected_shards = ()  # type: ignore[attr-defined]
                layer.register_parameter(f"{which}_weight", lazy)
            for kind in self.kinds:
                example = stand_ins[0, "gate"]._parameters[kind]
                placeholder = nn.Parameter(torch.empty(0, dtype=example.dtype, device=device), requires_grad=False)
                placeholder.weight_loader = functools.partial(self._hand_over, stand_ins, kind)  # type: ignore[attr-defined]
                placeholder.expected_shards = ()  # type: ignore[attr-defined] # checked once loaded
                layer.register_parameter(f"{which}_{kind}", placeholder)

    def _hand_over(self, stand_ins: dict[tuple[int, str], nn.Module], kind: str, param: nn.Parameter,
                   loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        stand_in = stand_ins.get(shard_id)
        if stand_in is None:
            raise ModelLoadError(f"expert {shard_id[0]} out of range")
        target = stand_in._parameters[kind]
        target.weight_loader(target, loaded)  # type: ignore[attr-defined]
        self.packed.add((*shard_id, kind))

    def _load_float(self, layer: nn.Module, shape: tuple[int, ...], param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: tuple[int, str]) -> None:
        if param.numel() == 0:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        layer.weight_loader(param, loaded, shard_id)
        self.floats.add(shard_id)

    def _loaded_as(self, layer: nn.Module, which: str) -> str:
        """``"packed"`` or ``"float"``: how the checkpoint held ``which``'s experts (all alike, all complete)."""
        names = layer.__dict__.get("expert_checkpoint_names", {})
        shards = [(x, r) for x in range(layer.num_experts) for r in _ROLES[which]]
        floats = [s for s in shards if s in self.floats]
        packed = [s for s in shards if any((*s, k) in self.packed for k in self.kinds)]
        if floats and packed:
            raise ModelLoadError(f"{names.get(floats[0], floats[0])} is float and {names.get(packed[0], packed[0])} "
                                 f"quantized: plinth stores a layer's experts alike")
        if floats:
            missing = [s for s in shards if s not in self.floats]
            if missing:
                raise ModelLoadError(f"checkpoint is missing tensor {names.get(missing[0], missing[0])}.weight")
            return "float"
        for s in shards:
            for kind in self.kinds:
                if (*s, kind) not in self.packed and kind not in self.optional:
                    raise ModelLoadError(f"checkpoint is missing tensor '{names.get(s, s)}.{kind}'")
        return "packed"

    # -- once loaded -----------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert every expert projection to :class:`IntWeights` and stack their codes, scales and zero points."""
        stand_ins = layer.__dict__.pop("int_stand_ins", None)
        for which, roles in _ROLES.items():
            if stand_ins is not None:
                kind = self._loaded_as(layer, which)
                for name in [n for n in layer._parameters if n.startswith(f"{which}_")]:
                    if not (kind == "float" and name == f"{which}_weight"):
                        del layer._parameters[name]
                if kind == "float":
                    floats = getattr(self, "float_layers", 0) + 1
                    self.float_layers = floats
                    if floats == len(_ROLES):   # the checkpoint's experts are all float: the float paths run them
                        layer.weight_method = None
                    continue
                per_expert = [[self.method.convert_weights(stand_ins.pop((x, r))) for r in roles]
                              for x in range(layer.num_experts)]
            else:
                weight = layer._parameters.pop(f"{which}_weight")
                per_expert = []
                for x in range(layer.num_experts):
                    rows = weight[x].split(weight.shape[1] // len(roles))
                    per_expert.append([self.method.float_weights(r) for r in rows])
                del weight
            self._stack(layer, which, per_expert)

    def _stack(self, layer: nn.Module, which: str, per_expert: list[list[IntWeights]]) -> None:
        first = per_expert[0][0]
        bits, group = first.bits, first.group_size
        for parts in per_expert:
            for w in parts:
                if (w.bits, w.group_size) != (bits, group):
                    raise ModelLoadError(f"the experts' projections are quantized differently ({w.bits} bits, groups of "
                                         f"{w.group_size} against {bits}, {group}); plinth stacks them alike")
        codes = torch.stack([torch.cat([_pack(w.q, bits) for w in parts]) for parts in per_expert])
        scales = torch.stack([torch.cat([w.scales for w in parts]) for parts in per_expert])
        zeros = torch.stack([torch.cat([w.zeros for w in parts]) for parts in per_expert])
        layer.register_parameter(f"{which}_weight", nn.Parameter(codes, requires_grad=False))
        layer.register_parameter(f"{which}_scales", nn.Parameter(scales, requires_grad=False))
        layer.register_parameter(f"{which}_zeros", nn.Parameter(zeros, requires_grad=False))
        if any(w.perm is not None for parts in per_expert for w in parts):
            k = first.q.shape[1]
            perm = torch.stack([torch.stack([w.perm if w.perm is not None else torch.arange(k, device=w.q.device)
                                             for w in parts]) for parts in per_expert])
            layer.register_parameter(f"{which}_perm", nn.Parameter(perm, requires_grad=False))
        layer.__dict__.setdefault("int_formats", {})[which] = (bits, group, first.symmetric)

    def widen(self, layer: nn.Module, which: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s ``[N, K]`` weight in ``dtype``."""
        if which not in getattr(layer, "int_formats", {}):   # the checkpoint's experts in floating point
            return getattr(layer, f"{which}_weight")[expert]
        bits, group, symmetric = layer.int_formats[which]
        q = _unpack(getattr(layer, f"{which}_weight")[expert], bits)
        scales, zeros = getattr(layer, f"{which}_scales")[expert], getattr(layer, f"{which}_zeros")[expert]
        perm = getattr(layer, f"{which}_perm", None)
        if perm is None:
            return IntWeights(q, scales, zeros, bits, group, symmetric=symmetric).dequantize(dtype)
        parts = perm.shape[1]
        rows = q.shape[0] // parts
        return torch.cat([IntWeights(q[j * rows:(j + 1) * rows], scales[j * rows:(j + 1) * rows],
                                     zeros[j * rows:(j + 1) * rows], bits, group, perm=perm[expert, j],
                                     symmetric=symmetric).dequantize(dtype) for j in range(parts)])

    def gemv_args(self, layer: nn.Module, which: str) -> dict[str, Any] | None:
        """What the experts' GEMV kernel reads ``which`` with (:func:`plinth.kernels.ops.moe_gemv`): the codes' bits,
        group, scales and zero points; ``{}`` for float experts; ``None`` with act order (a permutation per expert,
        which the kernel does not apply)."""
        if which not in getattr(layer, "int_formats", {}):
            return {}
        if getattr(layer, f"{which}_perm", None) is not None:
            return None
        bits, group, _ = layer.int_formats[which]
        return {"int_codes": (bits, group, getattr(layer, f"{which}_scales"), getattr(layer, f"{which}_zeros"))}

    def widen_range(self, layer: nn.Module, which: str, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``first..last-1``'s ``[n, N, K]`` weights in ``dtype``, in one conversion (their rows stacked;
        with act order, whose permutation differs per expert, one expert at a time)."""
        if which not in getattr(layer, "int_formats", {}):
            return getattr(layer, f"{which}_weight")[first:last]
        if getattr(layer, f"{which}_perm", None) is not None:
            return torch.stack([self.widen(layer, which, e, dtype) for e in range(first, last)])
        bits, group, symmetric = layer.int_formats[which]
        packed = getattr(layer, f"{which}_weight")[first:last]
        n, rows = packed.shape[:2]
        scales, zeros = (getattr(layer, f"{which}_{part}")[first:last].reshape(n * rows, -1)
                         for part in ("scales", "zeros"))
        codes = _unpack(packed.reshape(n * rows, -1), bits)
        return IntWeights(codes, scales, zeros, bits, group, symmetric=symmetric).dequantize(dtype).view(n, rows, -1)


class WidenedIntWeight:
    """The packed checkpoint tensors of a weight a model reads itself (``layer.weight`` ``[rows, K]``, this rank's rows;
    DeepSeek's ``kv_b_proj``) under an integer method: they load into a stand-in column-parallel layer of the method,
    whose conversion is widened into ``layer.weight`` once loaded. A float tensor (a layer the checkpoint leaves in
    floating point) loads as it is; one of the two must be there."""

    def __init__(self, layer: nn.Module, method: Any):
        from plinth.model_registry.layers.linear import ColumnParallelLinear

        self.method = method
        rows, k = layer.weight.shape
        tp_size = int(getattr(layer, "tp_size", 1))
        # built where the layer's weight is once the first packed tensor arrives (models are built on the meta device
        # and given memory afterwards; this stand-in is not part of the module tree)
        self.make_stand_in = functools.partial(ColumnParallelLinear, k, rows * tp_size, bias=False,
                                               tp_rank=int(getattr(layer, "tp_rank", 0)), tp_size=tp_size,
                                               quant_method=method)
        with torch.device("meta"):
            example = self.make_stand_in()
        self.kinds = {kind for kind, p in example._parameters.items() if p is not None and kind != "weight"}
        self.optional = {k for k in self.kinds if getattr(example._parameters[k], "optional_in_checkpoint", False)}
        self.stand_in: nn.Module | None = None
        self.loaded: set[str] = set()
        self.saw_float = False
        layer.weight.expected_shards = ()  # type: ignore[attr-defined] # either the float weight or the packed ones
        for kind in sorted(self.kinds):
            placeholder = nn.Parameter(torch.empty(0, dtype=example._parameters[kind].dtype), requires_grad=False)
            placeholder.weight_loader = functools.partial(self._load, layer, kind)  # type: ignore[attr-defined]
            placeholder.expected_shards = ()  # type: ignore[attr-defined]
            layer.register_parameter(kind, placeholder)

    def takes(self, rows: torch.Tensor) -> bool:
        """A float checkpoint tensor: the layer loads it itself (False)."""
        self.saw_float = True
        return False

    def _load(self, layer: nn.Module, kind: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.stand_in is None:
            with torch.device(layer.weight.device):
                self.stand_in = self.make_stand_in()
        target = self.stand_in._parameters[kind]
        target.weight_loader(target, loaded)  # type: ignore[attr-defined]
        self.loaded.add(kind)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        stand_in, self.stand_in = self.stand_in, None
        for kind in self.kinds:
            del layer._parameters[kind]
        if self.loaded:
            missing = sorted(self.kinds - self.loaded - self.optional)
            if missing:
                raise ModelLoadError(f"{type(layer).__name__}: the checkpoint has {', '.join(sorted(self.loaded))} "
                                     f"but not {', '.join(missing)}")
            widened = self.method.convert_weights(stand_in).dequantize(layer.weight.dtype)
            layer.weight.data.copy_(widened.to(layer.weight.device))
        elif not self.saw_float:
            raise ModelLoadError(f"{type(layer).__name__}: the checkpoint has neither its weight nor its "
                                 f"{', '.join(sorted(self.kinds))}")


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` (uint8) as stored: two per byte at 4 bits (even feature in the low nibble)."""
    if bits != 4:
        return q
    if q.shape[1] % 2:
        raise ModelLoadError(f"4-bit experts need an even number of input features, got {q.shape[1]}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits != 4:
        return packed
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
