"""LoRA on the device: each adapted linear layer's slot buffers, and the batched product.

Every step may mix requests of up to ``S = max_loras`` adapters and of the base model. A layer with ``K`` fused
projections (QKV: 3, gate/up: 2, the others: 1) holds, for ``R = max_lora_rank``:

* ``A``: ``[K, S, R, in]``: the down-projections of every slot and projection, stacked;
* ``B``: ``[out, K, S, R]``: the up-projections, block-structured: the output rows of projection ``k`` read only
  the columns of ``k`` (zeros elsewhere), so one GEMM adds every projection's delta in place.

For ``T`` tokens with slot weights ``w`` (``[T, S]``: one-hot rows, all zero for base-model tokens)::

    xa = x @ A.view(K*S*R, in).T             # [T, K*S*R]   every slot's shrink
    xa.view(T, K, S, R) *= w[:, None, :, None] # each token keeps its own slot's columns
    y += xa @ B.view(out, K*S*R).T           # the expand, added to the base layer's output

Two GEMMs per layer whatever the mix of adapters, no gather, static shapes (the decode steps stay CUDA graphs).
Steps of at most :data:`~plinth.kernels.ops.LORA_KERNEL_MAX_TOKENS` tokens on a GPU (decode) instead run two Triton
kernels that read each token's own slot only (:func:`~plinth.kernels.ops.lora_shrink_expand_`, Punica's BGMV):
fewer launches and bytes where a step's time is launches and bytes.
An adapter of rank ``r < R`` fills its slot's first ``r`` rows of ``A`` and columns of ``B`` (zeros after them),
its scale folded into ``B``.

Tensor parallelism follows the base layer's split: a column-parallel layer keeps ``A`` whole and its rank's rows
of ``B`` (a fused projection's rows per projection, as the base weight's); a row-parallel layer keeps its rank's
input columns of ``A`` and all of ``B``, so its delta is a partial sum like the base output, reduced with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from plinth.kernels import ops
from plinth.model_registry.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


class LoRAState:
    """The step's per-token slot weights, shared by every adapted layer of one model (one per rank).

    Args:
        max_loras: slots.
        max_rank: the slots' rank.
        max_tokens: the most tokens of a step (rows of :attr:`weights`).
        device, dtype: the model's.
    """

    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, device: torch.device, dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.weights = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)   # [T, S]
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)   # [T] (the kernels')
        self._pinned = device.type == "cuda"
        self._host = torch.zeros(max_tokens, max_loras, dtype=torch.float32, pin_memory=self._pinned)
        self._host_slots = torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=self._pinned)
        self._copied: Any = None      # a CUDA event after the latest copy from the host buffer
        self._dirty = 0               # rows of ``weights`` that may be nonzero
        #: whether the layers apply their adapters: set per step (any adapter's token in it); the decode graphs
        #: are captured with it off and on (see plinth.worker.cuda_graphs), and a replay picks by it
        self.active = False
        #: run the products in every step (memory profiling: the peak must include their temporaries)
        self.forced = False
        self.layers: list[LinearLoRA] = []

    @property
    def max_tokens(self) -> int:
        return self.weights.shape[0]

    def set_tokens(self, slots: np.ndarray | None, rows: int | None = None) -> None:
        """The slot of each of the step's tokens (``[T]`` int, -1 for the base model; ``None``: all base).
        ``rows >= T`` (a padded decode graph): the rows after ``T`` get zero weights."""
        n = 0 if slots is None else len(slots)
        rows = n if rows is None else rows
        if rows > self.max_tokens:
            raise ValueError(f"a step of {rows} tokens exceeds the LoRA buffers' {self.max_tokens}")
        use = slots >= 0 if n else None
        self.active = bool(n and use.any())
        if not self.active:
            self.active = self.forced
            if self._dirty:
                self.weights[: self._dirty].zero_()
                self.slots[: self._dirty].fill_(-1)
                self._dirty = 0
            return
        if self._copied is not None:     # the previous copy may still read the host buffers
            self._copied.synchronize()
        clear = max(rows, self._dirty)
        host, host_slots = self._host[:clear], self._host_slots[:clear]
        host.zero_()
        host_slots.fill_(-1)
        idx = np.flatnonzero(use)
        host.numpy()[idx, slots[idx]] = 1.0
        host_slots.numpy()[:n] = np.where(use, slots, -1)
        self.weights[:clear].copy_(host, non_blocking=self._pinned)
        self.slots[:clear].copy_(host_slots, non_blocking=self._pinned)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._dirty = rows

    def load(self, slot: int, modules: dict[str, tuple[np.ndarray, np.ndarray]], model: torch.nn.Module) -> None:
        """Write an adapter into ``slot`` of every adapted layer (a layer it does not adapt gets zeros there).

        ``modules``: the adapter's base-model module names -> ``(A [r, in], B [out, r])``, as checked by
        :func:`~plinth.lora.adapter.load_adapter`; modules of another pipeline stage are skipped."""
        pieces: dict[int, dict[Any, tuple[np.ndarray, np.ndarray]]] = {}
        for name, ab in modules.items():
            mapped = model.map_weight_name(name + ".weight")
            if mapped is None:
                continue
            param_name, shard_id = mapped
            layer = _find(model, param_name.removesuffix(".weight"))
            if layer is not None and layer.lora is not None:
                pieces.setdefault(id(layer.lora), {})[shard_id] = ab
        for lora in self.layers:
            lora.load(slot, pieces.get(id(lora), {}))


def _find(model: torch.nn.Module, name: str) -> LinearBase | None:
    try:
        module = model.get_submodule(name)
    except AttributeError:   # a layer of another pipeline stage
        return None
    return module if isinstance(module, LinearBase) else None


class LinearLoRA:
    """One linear layer's slots (see the module docstring for the layout)."""

    def __init__(self, layer: LinearBase, state: LoRAState):
        self.layer = layer
        self.state = state
        s, r = state.max_loras, state.max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        in_features = layer.input_size_per_partition
        out_features = sum(layer.output_sizes_per_partition)
        if isinstance(layer, QKVParallelLinear):
            self.shard_ids: list[Any] = ["q", "k", "v"]
        elif isinstance(layer, MergedColumnParallelLinear):
            self.shard_ids = list(range(len(layer.output_sizes)))
        else:
            self.shard_ids = [None]
        k = len(self.shard_ids)
        self.A = torch.zeros(k, s, r, in_features, dtype=state.dtype, device=state.device)
        self.B = torch.zeros(out_features, k, s, r, dtype=state.dtype, device=state.device)
        self._a_flat = self.A.view(k * s * r, in_features)
        self._b_flat = self.B.view(out_features, k * s * r)

    def load(self, slot: int, pieces: dict[Any, tuple[np.ndarray, np.ndarray]]) -> None:
        """Fill ``slot`` from ``{shard id: (A [r, in], B [out, r])}`` of the whole (unsplit) projections."""
        layer = self.layer
        self.A[:, slot].zero_()
        self.B[:, :, slot].zero_()
        for k, shard_id in enumerate(self.shard_ids):
            if shard_id not in pieces:
                continue
            a_full, b_full = (torch.from_numpy(t) for t in pieces[shard_id])
            r = a_full.shape[0]
            if self.row_parallel:   # this rank's input columns of A, all of B
                width = layer.input_size_per_partition
                a = a_full.narrow(1, layer.tp_rank * width, width)
                self.A[k, slot, :r].copy_(a)
                self.B[:, k, slot, :r].copy_(b_full)
                continue
            self.A[k, slot, :r].copy_(a_full)
            if shard_id is None:      # a plain column-parallel (or replicated) layer
                rows = self.B.shape[0]
                start = layer.tp_rank * rows if isinstance(layer, ColumnParallelLinear) else 0
                self.B[:, k, slot, :r].copy_(b_full.narrow(0, start, rows))
            else:
                offset, size, start = layer._shard_offset_size(shard_id)
                self.B[offset:offset + size, k, slot, :r].copy_(b_full.narrow(0, start, size))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output, ``[T, out]``) plus each token's adapter delta, in place where it can: a few
        tokens on a GPU through the Triton kernels that read only their own slots, else two masked GEMMs over
        every slot."""
        t = x.shape[0]
        if y.dtype == x.dtype and y.is_contiguous() and x.stride(-1) == 1 and ops.lora_kernels_enabled(x):
            return ops.lora_shrink_expand_(x, self.A, self.B, self.state.slots[:t], y)
        k = len(self.shard_ids)
        s, r = self.state.max_loras, self.state.max_rank
        xa = F.linear(x, self._a_flat)                                      # [T, K*S*R]
        xa.view(t, k, s, r).mul_(self.state.weights[:t].view(t, 1, s, 1))
        if y.dtype == xa.dtype and y.is_contiguous():
            return y.addmm_(xa, self._b_flat.t())
        return y + (xa @ self._b_flat.t()).to(y.dtype)


def enable_lora(model: torch.nn.Module, max_loras: int, max_rank: int, max_tokens: int) -> LoRAState:
    """Give every adaptable linear layer of ``model`` (the names in its ``lora_modules``) its slot buffers;
    returns the shared state, also kept as ``model.lora_state``.

    Raises:
        ValueError: the model's class declares no adaptable layers.
    """
    suffixes = tuple(getattr(model, "lora_modules", ()))
    if not suffixes:
        raise ValueError(f"{type(model).__name__} declares no layers that take LoRA adapters (the Llama-style "
                         "native decoders do; DeepSeek's latent attention and the transformers fallback do not)")
    state = LoRAState(max_loras, max_rank, max_tokens, torch.device(model.ctx.device), model.ctx.dtype)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in suffixes:
            module.lora = LinearLoRA(module, state)
            state.layers.append(module.lora)
    model.lora_state = state
    return state


@contextlib.contextmanager
def products_forced(model: torch.nn.Module) -> Iterator[None]:
    """Inside: a model with adapters runs their products in every step (a memory-profiling step must count
    their temporaries, whatever its tokens' slots)."""
    state = getattr(model, "lora_state", None)
    if state is None:
        yield
        return
    state.forced = True
    try:
        yield
    finally:
        state.forced = False


def enable_lora_for(model: torch.nn.Module, config: Any) -> LoRAState | None:
    """:func:`enable_lora` with the engine configuration's sizes (``None`` when adapters are off)."""
    from plinth.config import ConfigError

    lora = config.lora
    if not lora.enable_lora:
        return None
    max_num_seqs, max_tokens = config.scheduler.limits
    try:
        return enable_lora(model, lora.max_loras, lora.max_lora_rank, max(max_num_seqs, max_tokens))
    except ValueError as exc:
        raise ConfigError(f"enable_lora: {exc}") from None
