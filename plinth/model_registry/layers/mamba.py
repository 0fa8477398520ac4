"""Mamba-2 mixer layers (state space duality) with per-sequence recurrent state, for the models built on them
(IBM Granite 4.0-H, NVIDIA Nemotron-H, TII Falcon-H1, Mamba-2), Mamba-1 mixer layers (Mamba, Falcon-Mamba, Jamba),
and the state every such layer keeps (:class:`RecurrentState`, :class:`StatefulMixer`; the gated DeltaNet layers of
:mod:`plinth.model_registry.layers.gated_delta` keep theirs here too).

A mixer keeps two states for each running sequence, in a row of the model's :class:`RecurrentState`:

- the causal convolution's last ``d_conv - 1`` inputs (``[conv_dim, d_conv - 1]``, the model's dtype);
- the state space model's state (``[heads, head_dim, d_state]``, float32).

The row is the sequence's row of the engine's persistent block table (:attr:`FlatBatch.state_rows
<plinth.worker.batching.FlatBatch>`, carried to the layers as ``AttentionMetadata.state_rows``): it is the
sequence's for as long as it runs. A sequence whose step starts at position 0 (a new request, or one preempted and
recomputed) starts from zero states; the model clears its rows before the first layer (:meth:`RecurrentState.reset`).

With the prefix cache on, the state also has checkpoint slots: the states after the last token of some cached KV
blocks (the engine's :class:`~plinth.core.block_manager.BlockManager` says which block's state goes to which slot).
A request whose prompt starts with such a block's prefix starts from the slot's state (:meth:`RecurrentState.restore`)
after the cached tokens, as an attention layer starts from the cached blocks' keys and values. A step saves the
state after a block boundary inside a prompt chunk in the layer (its scan split there), and one at the end of a
chunk as a copy of the row after the forward (:meth:`RecurrentState.save`).

Prompts run the chunked form of the scan: within a chunk of ``chunk_size`` positions the outputs are a masked
product like attention's (decays ``exp(cumsum(dt * A))`` between positions), and the state passes from chunk to
chunk; a decode step updates the state once. The scan computes in float32.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.distributed.communication import tp_all_reduce
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


class RecurrentState:
    """Every Mamba layer's states for ``rows`` sequences, one tensor per kind (layer-major), and a scratch row
    after them that no sequence holds (the CUDA decode graphs' padding rows read and write it).

    Attributes:
        conv: ``[layers, rows + 1, conv_dim, d_conv - 1]`` in the model's dtype.
        ssm: ``[layers, rows + 1, heads, head_dim, d_state]`` float32.
    """

    def __init__(self, num_layers: int, rows: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, slots: int = 0):
        self.conv = torch.zeros(num_layers, rows + 1, *conv_shape, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, rows + 1, *ssm_shape, dtype=torch.float32, device=device)
        #: checkpoint slots of the prefix cache, ``[layers, slots, ...]`` as the rows
        self.saved_conv = torch.zeros(num_layers, slots, *conv_shape, dtype=dtype, device=device)
        self.saved_ssm = torch.zeros(num_layers, slots, *ssm_shape, dtype=torch.float32, device=device)
        #: the current step's rows are ``first_row, first_row + 1, ...`` in order (set by the step's preparation,
        #: known on the host); ``None``: they are not, or not known
        self.first_row: int | None = None

    @property
    def rows(self) -> int:
        """The sequences' rows (``0 .. rows - 1``)."""
        return self.conv.shape[1] - 1

    @property
    def scratch_row(self) -> int:
        return self.conv.shape[1] - 1

    @property
    def slots(self) -> int:
        return self.saved_conv.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.saved_conv, self.saved_ssm))

    def grow(self, rows: int) -> None:
        """Room for at least ``rows`` rows (the states of the rows there are kept)."""
        keep = self.rows
        if rows <= keep:
            return
        for name in ("conv", "ssm"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], rows + 1, *old.shape[2:])
            new[:, :keep] = old[:, :keep]
            setattr(self, name, new)

    def reset(self, rows: torch.Tensor) -> None:
        """Zero the states of ``rows`` (``[K]`` int64 on the states' device) in every layer."""
        if rows.numel():
            self.conv.index_fill_(1, rows, 0)
            self.ssm.index_fill_(1, rows, 0)

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy the states of ``rows`` into checkpoint ``slots`` (``[K]`` int64 each), every layer."""
        self.saved_conv.index_copy_(1, slots, self.conv.index_select(1, rows))
        self.saved_ssm.index_copy_(1, slots, self.ssm.index_select(1, rows))

    def restore(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Start ``rows`` from the states of checkpoint ``slots``, every layer."""
        self.conv.index_copy_(1, rows, self.saved_conv.index_select(1, slots))
        self.ssm.index_copy_(1, rows, self.saved_ssm.index_select(1, slots))

    def save_layer(self, layer: int, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """One layer's states (``[C, K-1]``, ``[H, P, N]``) into checkpoint ``slot``."""
        self.saved_conv[layer, slot] = conv
        self.saved_ssm[layer, slot] = ssm


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm and gate over groups of ``group_size`` features, in float32: ``mode`` ``"gate_norm"``
    (Mamba-2's: ``rms_norm(y * silu(z)) * weight``), ``"norm_gate"`` (``rms_norm(y) * weight * silu(z)``) or
    ``"gate"`` (``y * silu(z)``, no norm and no weight). With ``spans_ranks`` the one group is split over the
    tensor-parallel ranks (each holds ``hidden_size`` of its ``group_size`` features): the squares' sums are
    all-reduced."""

    MODES = ("gate_norm", "norm_gate", "gate")

    def __init__(self, hidden_size: int, group_size: int, eps: float, spans_ranks: bool = False,
                 mode: str = "gate_norm"):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"gated norm mode {mode!r}; one of {self.MODES}")
        self.mode = mode
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False) if mode != "gate" else None
        self.group_size = group_size
        self.eps = eps
        self.spans_ranks = spans_ranks

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        if self.spans_ranks:
            squares = h.pow(2).sum(-1, keepdim=True)
            tp_all_reduce(squares)
            return h * torch.rsqrt(squares / self.group_size + self.eps) * self.weight.float()
        g = h.view(h.shape[0], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.view_as(h) * self.weight.float()

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:   # [T, I] float32, [T, I] -> [T, I] float32
        gate = F.silu(z.float())
        if self.mode == "gate":
            return y.float() * gate
        if self.mode == "norm_gate":
            return self._norm(y.float()) * gate
        return self._norm(y.float() * gate)


class StatefulMixer(nn.Module):
    """A token mixer that keeps per-sequence state in a row of the model's :class:`RecurrentState` (Mamba-1, Mamba-2,
    gated DeltaNet): a causal depthwise convolution's window (``conv1d``, ``conv_kernel``) and a float32 scan state.
    ``state_index`` is the layer's index into the state, set when the model allocates it."""

    conv1d: DepthwiseConv
    conv_kernel: int
    state_index: int = -1
    state: RecurrentState | None = None

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, ...]]:
        """The shapes of one sequence's convolution and scan states."""
        raise NotImplementedError

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """A decode step reads and writes the states through device-side row indices (the decode graphs' state-row
        input; padding rows use the state's scratch row): capturable on CUDA."""
        return device.type == "cuda"


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's selective scan, chunk by chunk, in float32.

    Args:
        x: ``[L, H, P]`` inputs.
        dt: ``[L, H]`` time steps (after the bias, softplus and clamp).
        a: ``[H]`` the (negative) state decay rates ``-exp(A_log)``.
        b, c: ``[L, H, N]`` input and output projections of the state (expanded from the groups to the heads).
        state: ``[H, P, N]`` the state before the first position.
        chunk_size: positions per chunk.

    Returns:
        ``(y [L, H, P], state after the last position [H, P, N])``; ``y`` excludes the ``D`` skip term.
    """
    length = x.shape[0]
    outputs = []
    log_decay = dt * a                                                   # [L, H]
    xdt = x * dt[..., None]                                              # [L, H, P]
    for lo in range(0, length, chunk_size):
        hi = min(lo + chunk_size, length)
        cum = log_decay[lo:hi].cumsum(0)                                 # [Q, H]
        # decay from position s to position l (l >= s): exp(cum[l] - cum[s]); masked above the diagonal
        diff = cum[:, None, :] - cum[None, :, :]                         # [Q(l), Q(s), H]
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("lhn,shn->lsh", c[lo:hi], b[lo:hi]) * decay                     # [Q, Q, H]
        y = torch.einsum("lsh,shp->lhp", scores, xdt[lo:hi])
        # the state carried into the chunk, decayed to each position and read through C
        y = y + torch.einsum("lhn,hpn->lhp", c[lo:hi], state) * torch.exp(cum)[..., None]
        outputs.append(y)
        to_end = torch.exp(cum[-1:] - cum)                               # [Q, H]: decay from s to the chunk's end
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", to_end, xdt[lo:hi], b[lo:hi])
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0], state


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's parameters (``conv1d.weight`` ``[C, K]``, read from the checkpoint's
    ``[C, 1, K]``; ``conv1d.bias`` ``[C]``), loaded by ``loader(param, tensor)``; the mixer computes with them."""

    def __init__(self, channels: int, kernel: int, bias: bool, loader: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)
        self.weight.weight_loader = loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False)
            self.bias.weight_loader = loader  # type: ignore[attr-defined]


class _InProjection(ColumnParallelLinear):
    """Mamba-2's ``in_proj`` on one tensor-parallel rank: the rows of its heads' ``z``, ``x`` and ``dt``, and of its
    groups' ``B`` and ``C`` (all of them where the layer has one group), cut from the checkpoint's full tensor."""

    def __init__(self, input_size: int, full_rows: int, rows: list[tuple[int, int]], **kwargs: Any):
        self.rows = rows
        super().__init__(input_size, full_rows, **kwargs)
        if self.tp_size > 1 and any(getattr(p, "weight_loader", None) != self.weight_loader
                                    for p in self.parameters(recurse=False)):
            # a checkpoint quantized ahead of time: its packed tensors and scales load through the method's own
            # loaders, which cut contiguous rows, not this layer's parts
            raise UnsupportedModelError("a checkpoint quantized ahead of time cannot split its Mamba layers over "
                                        "tensor-parallel ranks: run it with --tensor-parallel-size 1, or quantize "
                                        "a floating-point checkpoint as it loads (--quantization)")

    def _partition_sizes(self) -> tuple[int, list[int]]:
        return self.input_size, [sum(length for _, length in self.rows)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_size == 1:
            super().weight_loader(param, loaded)
            return
        if param.dim() == 0 or param.shape[0] != sum(length for _, length in self.rows):
            raise ModelLoadError(f"Mamba in_proj: a tensor of shape {tuple(loaded.shape)} cannot be split over "
                                 "tensor-parallel ranks (a quantized checkpoint's own scales: run it with "
                                 "--tensor-parallel-size 1)")
        if loaded.shape[0] != self.output_size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(f"Mamba in_proj: expected {self.output_size} rows of shape "
                                 f"{tuple(param.shape[1:])}, checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(torch.cat([loaded.narrow(0, start, length) for start, length in self.rows]))


def _span(rows: list[int] | None, n: int) -> tuple[int, int] | None:
    """``(lo, lo + n)`` when the first ``n`` of ``rows`` are consecutive increasing rows, else ``None``."""
    if rows is None or n == 0:
        return None
    lo = rows[0]
    return (lo, lo + n) if rows[n - 1] - lo == n - 1 and all(r == lo + i for i, r in enumerate(rows[:n])) else None


def load_rank_heads(param: nn.Parameter, loaded: torch.Tensor, total: int, tp_rank: int, what: str) -> None:
    """A per-head checkpoint tensor ``[total]`` (``A_log``, ``dt_bias``, ...) into ``param``: this rank's
    ``param.shape[0]`` heads; another shape is refused with ``what``."""
    if tuple(loaded.shape) != (total,):
        raise ModelLoadError(f"{what} ({total},), checkpoint has {tuple(loaded.shape)}")
    n = param.shape[0]
    param.data.copy_(loaded.narrow(0, tp_rank * n, n))


def mamba_width(hf_config: Any) -> int | None:
    """The Mamba-2 layers' inner width (heads x head dim) of a config that has them, else ``None``: Granite 4.0-H's
    and Falcon-H1's ``mamba_*`` keys (``mamba_d_head`` ``"auto"``: ``mamba_d_ssm`` or ``mamba_expand`` x hidden),
    Nemotron-H's, Mamba-2's."""
    for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
        heads, dim = getattr(hf_config, heads_key, None), getattr(hf_config, dim_key, None)
        if isinstance(heads, int) and isinstance(dim, int):
            return heads * dim
        if isinstance(heads, int) and dim == "auto":   # a config transformers did not normalise
            return int(getattr(hf_config, "mamba_d_ssm", None) or hf_config.mamba_expand * hf_config.hidden_size)
    if getattr(hf_config, "model_type", None) == "mamba2":
        return int(hf_config.num_heads * hf_config.head_dim)
    return None


def mixer_from_mamba_config(ctx: Any, **options: Any) -> Mamba2Mixer:
    """A :class:`Mamba2Mixer` of a config with Granite 4.0-H's / Falcon-H1's ``mamba_*`` keys (``options`` add to or
    override the keyword arguments)."""
    cfg = ctx.hf_config
    width = mamba_width(cfg)
    assert width is not None
    kwargs = dict(conv_bias=bool(cfg.mamba_conv_bias), proj_bias=bool(cfg.mamba_proj_bias),
                  activation=getattr(cfg, "hidden_act", "silu") or "silu",
                  time_step_limit=getattr(cfg, "time_step_limit", None), quant_method=ctx.quant_method,
                  tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
    return Mamba2Mixer(cfg.hidden_size, cfg.mamba_n_heads, width // cfg.mamba_n_heads, cfg.mamba_d_state,
                       cfg.mamba_n_groups, cfg.mamba_d_conv, cfg.mamba_chunk_size, cfg.rms_norm_eps,
                       **{**kwargs, **options})


class Mamba2Mixer(StatefulMixer):
    """A Mamba-2 mixer: ``in_proj`` to the gate ``z``, the convolved ``x, B, C`` and the time step ``dt``; a causal
    depthwise convolution and SiLU; the selective scan with the ``D`` skip; the gated RMSNorm; ``out_proj``.

    Parameter names follow the checkpoints (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
    ``out_proj``). ``state_index`` is the layer's index into the model's :class:`RecurrentState`, set when the model
    allocates it.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, chunk_size: int, eps: float, *, conv_bias: bool = True, proj_bias: bool = False,
                 activation: str = "silu", time_step_limit: tuple[float, float] | None = None,
                 quant_method: Any = None, tp_rank: int = 0, tp_size: int = 1, norm_mode: str = "gate_norm",
                 out_bias: bool | None = None):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise UnsupportedModelError(f"Mamba-2 layers with activation {activation!r}: only SiLU is supported")
        if num_heads % n_groups:
            raise ModelLoadError(f"Mamba-2: {num_heads} heads do not divide into {n_groups} groups")
        if num_heads % tp_size or (n_groups % tp_size and n_groups != 1):
            raise UnsupportedModelError(f"Mamba-2 layers of {num_heads} heads in {n_groups} groups cannot be split "
                                        f"over {tp_size} tensor-parallel ranks (the heads, and the groups unless "
                                        "there is one, must divide evenly)")
        full = num_heads * head_dim
        #: this rank's heads and groups (one group is replicated on every rank)
        self.num_heads, self.head_dim, self.state_size = num_heads // tp_size, head_dim, state_size
        self.n_groups = n_groups // tp_size if n_groups % tp_size == 0 else n_groups
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._full = (full, n_groups, num_heads)
        self.intermediate_size = self.num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        lo, hi = time_step_limit if time_step_limit is not None else (0.0, float("inf"))
        self.dt_min, self.dt_max = float(lo), float(hi)
        self.in_proj = _InProjection(hidden_size, 2 * full + 2 * n_groups * state_size + num_heads, self._rows(),
                                     bias=proj_bias, tp_rank=tp_rank, tp_size=tp_size,
                                     quant_method=quant_method)
        self.out_proj = RowParallelLinear(full, hidden_size, bias=proj_bias if out_bias is None else out_bias,
                                          tp_rank=tp_rank, tp_size=tp_size, quant_method=quant_method)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, conv_bias, self._load_conv)
        # float32, as the scan computes; this rank's heads
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        for param in (self.A_log, self.D, self.dt_bias):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        spans = n_groups == 1 and tp_size > 1
        self.norm = GatedRMSNorm(self.intermediate_size, full // n_groups, eps, spans_ranks=spans, mode=norm_mode)
        if self.norm.weight is not None:
            self.norm.weight.weight_loader = self._load_norm  # type: ignore[attr-defined]
        self.state_index = -1
        self.state: RecurrentState | None = None

    def _rows(self) -> list[tuple[int, int]]:
        """This rank's ``(start, length)`` row ranges of the checkpoint's ``in_proj`` (``z``, ``x``, ``B``, ``C``,
        ``dt``), in order."""
        full, groups, heads = self._full
        i, r, n = self.intermediate_size, self.tp_rank, self.state_size
        g0 = r * self.n_groups if self.n_groups != groups else 0
        gn = self.n_groups * n
        return [(r * i, i), (full + r * i, i), (2 * full + g0 * n, gn), (2 * full + groups * n + g0 * n, gn),
                (2 * full + 2 * groups * n + r * self.num_heads, self.num_heads)]

    # ------------------------------------------------------------------ loading

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """``conv1d``'s weight (``[C, 1, K]`` or ``[C, K]``) or bias: this rank's channels of ``x``, ``B``, ``C``."""
        if loaded.dim() == 3 and loaded.shape[1] == 1:   # nn.Conv1d's depthwise [C, 1, K]
            loaded = loaded[:, 0]
        full, groups, _ = self._full
        if loaded.shape[0] != full + 2 * groups * self.state_size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(f"Mamba-2 conv1d: expected {full + 2 * groups * self.state_size} channels of shape "
                                 f"{tuple(param.shape[1:])}, checkpoint has {tuple(loaded.shape)}")
        x_rows, b_rows, c_rows = self._rows()[1:4]
        param.data.copy_(torch.cat([loaded.narrow(0, start - full, length)
                                    for start, length in (x_rows, b_rows, c_rows)]))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_heads(param, loaded, self._full[2], self.tp_rank, "Mamba-2: expected one value per head")

    def _load_norm(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self._full[0],):
            raise ModelLoadError(f"Mamba-2 norm: expected ({self._full[0]},), checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.intermediate_size, self.intermediate_size))

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """The shapes of one sequence's convolution and scan states."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    # ------------------------------------------------------------------ forward

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:   # [T, H] -> [T, H]
        t = hidden.shape[0]
        proj = self.in_proj(hidden)
        z, xbc, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv, ssm, rows = layer_states(self, hidden, metadata)
        a = -torch.exp(self.A_log)                                                        # [H]
        dt = F.softplus(dt.float() + self.dt_bias).clamp(self.dt_min, self.dt_max)        # [T, H]
        y = torch.empty(t, self.num_heads, self.head_dim, dtype=torch.float32, device=hidden.device)
        qsl = metadata.query_start_loc_cpu
        n = metadata.num_seqs
        decodes = n if metadata.max_query_len == 1 else metadata.num_leading_decodes
        if decodes:   # one token each: all at once
            first = self.state.first_row if self.state is not None else None
            y[:decodes] = self._step(xbc[:decodes], dt[:decodes], a, conv, ssm, rows[:decodes],
                                     (first, first + decodes) if first is not None else None)
        saves = metadata.state_saves if self.state is not None else None
        for i in range(decodes, n):
            lo, hi = qsl[i], qsl[i + 1]
            if hi > lo:
                y[lo:hi] = self._prompt(xbc[lo:hi], dt[lo:hi], a, conv, ssm, rows[i:i + 1],
                                        saves.get(i) if saves else None)
        # (every row is written: the leading decodes' by _step, each prompt's by _prompt)
        out = self.norm(y.view(t, self.intermediate_size), z)
        return self.out_proj(out.to(hidden.dtype))

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, conv_dim]`` float32 to ``x [T, H, P]`` and ``B, C [T, H, N]`` (the groups expanded to the heads)."""
        t = xbc.shape[0]
        x, b, c = xbc.split([self.intermediate_size, self.n_groups * self.state_size,
                             self.n_groups * self.state_size], dim=-1)
        rep = self.num_heads // self.n_groups
        b = b.reshape(t, self.n_groups, self.state_size).repeat_interleave(rep, dim=1)
        c = c.reshape(t, self.n_groups, self.state_size).repeat_interleave(rep, dim=1)
        return x.reshape(t, self.num_heads, self.head_dim), b, c

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
              rows: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
        """One token for each of ``B`` sequences (their rows ``rows``; ``span``: they are the rows ``[lo, hi)`` in
        order, known on the host): ``y [B, H, P]``; the states updated. The scan state, the large one, is updated in
        place where the rows are a span (two passes over it and one read), else gathered and scattered."""
        window = torch.cat([conv.index_select(0, rows), xbc[:, :, None].to(conv.dtype)], dim=-1)   # [B, C, K]
        conv.index_copy_(0, rows, window[:, :, 1:])
        x, b, c = self._split_xbc(conv_last(self.conv1d, window))
        state = ssm[span[0]:span[1]] if span is not None else ssm.index_select(0, rows)   # [B, H, P, N]
        decay = torch.exp(dt * a)                                                        # [B, H]
        state.mul_(decay[..., None, None]).addcmul_((x * dt[..., None])[..., None], b[:, :, None, :])
        if span is None:
            ssm.index_copy_(0, rows, state)
        return torch.einsum("bhpn,bhn->bhp", state, c) + x * self.D[:, None]

    def _prompt(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                row: torch.Tensor, saves: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """``L`` consecutive tokens of one sequence (its row ``row``, ``[1]``): ``y [L, H, P]``; its states updated.
        ``saves``: ``[(offset, slot)]``, also keep the states after the first ``offset`` tokens in checkpoint
        ``slot`` (the scan is split there)."""
        activated, seq = conv_prompt(self.conv1d, conv, row, xbc)
        x, b, c = self._split_xbc(activated)
        y, state = scan_in_parts(self, lambda x, dt, b, c, h: ssd_scan(x, dt, a, b, c, h, self.chunk_size),
                                 (x, dt, b, c), ssm.index_select(0, row)[0], seq, saves)
        ssm.index_copy_(0, row, state[None])
        return y + x * self.D[:, None]


def state_slots(model: Any) -> int | None:
    """The prefix-cache checkpoint slots ``model``'s recurrent state has (0: none, or no such state; ``None``: a
    pipeline stage of such a model whose layers keep none, which bounds nothing)."""
    state = getattr(model, "recurrent_state", None)
    if state is None and getattr(model, "has_recurrent_state", False) and not getattr(model, "stage_has_state", True):
        return None
    return state.slots if state is not None else 0


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's selective scan of one sequence, in float32. The decays ``exp(dt * A)`` and inputs ``dt * x * B`` of
    ``chunk_size`` positions at a time are computed at once (``[Q, channels, d_state]``), then the state passes from
    position to position in one fused multiply-add each (the decay differs per channel and state feature, so the
    positions of a chunk cannot be combined in one product as Mamba-2's scalar decays can without a ``Q``-fold
    larger one), and the outputs are read through ``C`` at once.

    Args:
        x: ``[L, D]`` inputs (after the convolution and activation).
        dt: ``[L, D]`` time steps (after the bias and softplus).
        a: ``[D, N]`` the (negative) decay rates ``-exp(A_log)``.
        b, c: ``[L, N]`` input and output projections of the state.
        state: ``[D, N]`` the state before the first position.

    Returns:
        ``(y [L, D], state after the last position [D, N])``; ``y`` excludes the ``D`` skip term.
    """
    length = x.shape[0]
    outputs = []
    for lo in range(0, length, chunk_size):
        hi = min(lo + chunk_size, length)
        decay = torch.exp(dt[lo:hi, :, None] * a)                                # [Q, D, N]
        states = (dt[lo:hi] * x[lo:hi])[:, :, None] * b[lo:hi, None, :]          # [Q, D, N]: inputs, then states
        prev = state
        for t in range(hi - lo):
            prev = torch.addcmul(states[t], decay[t], prev, out=states[t])
        outputs.append(torch.einsum("tdn,tn->td", states, c[lo:hi]))
        state = prev.clone()
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0], state


class _PlainRMSNorm(nn.Module):
    """RMS normalisation in float32, with a weight or (Falcon-Mamba's) without."""

    def __init__(self, size: int, eps: float, weighted: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False) if weighted else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # float32 in and out
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight.float() if self.weight is not None else x


class Mamba1Mixer(StatefulMixer):
    """A Mamba (-1) mixer: ``in_proj`` to ``x`` and the gate ``z``; the causal depthwise convolution and SiLU on
    ``x``; ``x_proj`` to the time step's low-rank input and ``B``, ``C`` (Falcon-Mamba normalises the three without
    weights, Jamba with them); ``dt_proj`` and softplus; the selective scan with a ``[channels, d_state]`` decay
    per channel, the ``D`` skip, ``* silu(z)``; ``out_proj``.

    Parameter names follow the checkpoints. Tensor parallelism splits the channels: ``in_proj`` and ``dt_proj`` by
    output rows, ``conv1d``, ``A_log`` and ``D`` by channel, ``x_proj`` and ``out_proj`` by input columns
    (all-reduced).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 time_step_rank: int, *, conv_bias: bool = True, proj_bias: bool = False, activation: str = "silu",
                 inner_norms: str | None = None, norm_eps: float = 1e-6, quant_method: Any = None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise UnsupportedModelError(f"Mamba layers with activation {activation!r}: only SiLU is supported")
        if intermediate_size % tp_size:
            raise UnsupportedModelError(f"Mamba layers of {intermediate_size} channels cannot be split over "
                                        f"{tp_size} tensor-parallel ranks")
        i = intermediate_size // tp_size
        self.intermediate_size, self.state_size, self.conv_kernel = i, state_size, conv_kernel
        self.time_step_rank, self.tp_rank, self._full = time_step_rank, tp_rank, intermediate_size
        self.conv_dim = i
        self.in_proj = _InProjection(hidden_size, 2 * intermediate_size,
                                     [(tp_rank * i, i), (intermediate_size + tp_rank * i, i)], bias=proj_bias,
                                     tp_rank=tp_rank, tp_size=tp_size, quant_method=quant_method)
        self.conv1d = DepthwiseConv(i, conv_kernel, conv_bias, self._load_channels)
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * state_size, bias=False,
                                        tp_rank=tp_rank, tp_size=tp_size)
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, bias=True, tp_rank=tp_rank,
                                            tp_size=tp_size)
        self.A_log = nn.Parameter(torch.empty(i, state_size, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(i, dtype=torch.float32), requires_grad=False)
        for param in (self.A_log, self.D):
            param.weight_loader = self._load_channels  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=proj_bias, tp_rank=tp_rank,
                                          tp_size=tp_size, quant_method=quant_method)
        if inner_norms not in (None, "weighted", "weightless"):
            raise ValueError(f"inner_norms {inner_norms!r}")
        self.inner_norms = inner_norms
        if inner_norms is not None:
            weighted = inner_norms == "weighted"
            self.dt_layernorm = _PlainRMSNorm(time_step_rank, norm_eps, weighted)
            self.b_layernorm = _PlainRMSNorm(state_size, norm_eps, weighted)
            self.c_layernorm = _PlainRMSNorm(state_size, norm_eps, weighted)
        # positions of a prompt whose decays and states are held at once: [Q, channels, d_state] float32 tensors of
        # ~16 MiB each (a few of them live at a time)
        self.chunk_size = max(1, min(1024, 2**22 // (i * state_size)))
        self.state_index = -1
        self.state: RecurrentState | None = None

    def _load_channels(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """``conv1d`` (``[C, 1, K]`` or ``[C, K]``, bias ``[C]``), ``A_log`` ``[C, N]``, ``D`` ``[C]``: this rank's
        channels."""
        if loaded.dim() == 3 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        if loaded.shape[0] != self._full or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(f"Mamba: expected {self._full} channels of shape {tuple(param.shape[1:])}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.intermediate_size, self.intermediate_size))

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of one sequence's convolution and scan states."""
        return (self.intermediate_size, self.conv_kernel - 1), (self.intermediate_size, self.state_size)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:   # [T, H] -> [T, H]
        x, z = self.in_proj(hidden).split([self.intermediate_size, self.intermediate_size], dim=-1)
        conv, ssm, rows = layer_states(self, hidden, metadata)
        a = -torch.exp(self.A_log)                                                        # [D, N]
        qsl, n = metadata.query_start_loc_cpu, metadata.num_seqs
        # the convolution first (each sequence's window), then the projections of every token at once, then the scan
        xc, windows, decodes = convolve(self.conv1d, conv, rows, x, metadata)
        dt, b, c = self.x_proj(xc.to(hidden.dtype)).float().split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1)
        if self.inner_norms is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        # (the bias added in float32, as the reference scan adds it)
        dt = F.softplus(self.dt_proj._matmul(dt.to(hidden.dtype), None).float() + self.dt_proj.bias.float())
        y = torch.empty_like(xc)
        if decodes:
            first = self.state.first_row if self.state is not None else None
            r = rows[:decodes]
            state = ssm[first:first + decodes] if first is not None else ssm.index_select(0, r)   # [B, D, N]
            state.mul_(torch.exp(dt[:decodes, :, None] * a)).addcmul_(
                (dt[:decodes] * xc[:decodes])[:, :, None], b[:decodes, None, :])
            if first is None:
                ssm.index_copy_(0, r, state)
            y[:decodes] = torch.einsum("bdn,bn->bd", state, c[:decodes])
        saves = metadata.state_saves if self.state is not None else None
        for i in range(decodes, n):
            lo, hi = qsl[i], qsl[i + 1]
            if hi == lo:
                continue
            y[lo:hi], state = scan_in_parts(
                self, lambda x, d, b, c, h: selective_scan(x, d, a, b, c, h, self.chunk_size),
                (xc[lo:hi], dt[lo:hi], b[lo:hi], c[lo:hi]), ssm.index_select(0, rows[i:i + 1])[0], windows[i],
                saves.get(i) if saves else None)
            ssm.index_copy_(0, rows[i:i + 1], state[None])
        y = (y + xc * self.D) * F.silu(z.float())
        return self.out_proj(y.to(hidden.dtype))


def layer_states(layer: Any, hidden: torch.Tensor,
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixer's convolution and scan states of every row and the step's rows; outside serving (a start-up
    profile, a probe) zero states for each sequence, kept nowhere."""
    rows = getattr(metadata, "state_rows", None)
    if rows is None or layer.state is None:
        (c, k), ssm_shape = layer.state_shapes()
        conv = hidden.new_zeros(metadata.num_seqs, c, k)
        ssm = torch.zeros(metadata.num_seqs, *ssm_shape, dtype=torch.float32, device=hidden.device)
        return conv, ssm, torch.arange(metadata.num_seqs, device=hidden.device)
    return layer.state.conv[layer.state_index], layer.state.ssm[layer.state_index], rows


def scan_in_parts(layer: Any, scan: Any, inputs: tuple[torch.Tensor, ...], state: torch.Tensor,
                  window: torch.Tensor, saves: list[tuple[int, int]] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan ``scan(*parts, state) -> (y, state)`` over ``inputs`` (tensors of ``L`` positions each,
    cut along their first dimension) split at each save ``(offset, slot)``, whose states (the convolution's from
    ``window``, the sequence's ``[C, K-1+L]`` inputs) go to the layer's checkpoint slot; returns ``(y, state after
    the last position)``."""
    length = inputs[0].shape[0]
    parts, done = [], 0
    for o, slot in list(saves or ()) + [(length, -1)]:
        if o <= done or o > length:
            continue
        part, state = scan(*(t[done:o] for t in inputs), state)
        parts.append(part)
        if slot >= 0:
            assert layer.state is not None
            layer.state.save_layer(layer.state_index, slot, window[:, o:o + layer.conv_kernel - 1], state)
        done = o
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), state


def convolve(conv1d: DepthwiseConv, conv: torch.Tensor, rows: torch.Tensor, inputs: torch.Tensor,
             metadata: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
    """The causal convolution and SiLU of a step's inputs ``[T, C]``: the leading decode rows one window each (their
    states updated), each prompt chunk over its window. Returns ``(silu(conv) [T, C] float32, {sequence: its window
    [C, K-1+L]}, the number of leading decode rows)``."""
    out = torch.empty(inputs.shape, dtype=torch.float32, device=inputs.device)
    qsl, n = metadata.query_start_loc_cpu, metadata.num_seqs
    decodes = n if metadata.max_query_len == 1 else metadata.num_leading_decodes
    if decodes:
        window = torch.cat([conv.index_select(0, rows[:decodes]), inputs[:decodes, :, None].to(conv.dtype)], dim=-1)
        conv.index_copy_(0, rows[:decodes], window[:, :, 1:])
        out[:decodes] = conv_last(conv1d, window)
    windows: dict[int, torch.Tensor] = {}
    for i in range(decodes, n):
        lo, hi = qsl[i], qsl[i + 1]
        if hi > lo:
            out[lo:hi], windows[i] = conv_prompt(conv1d, conv, rows[i:i + 1], inputs[lo:hi])
    return out, windows, decodes


def conv_last(conv1d: DepthwiseConv, window: torch.Tensor) -> torch.Tensor:
    """``silu(conv)`` at the last position of each ``[B, C, K]`` window, float32 ``[B, C]``."""
    out = (window.float() * conv1d.weight.float()).sum(-1)
    if conv1d.bias is not None:
        out = out + conv1d.bias.float()
    return F.silu(out)


def conv_prompt(conv1d: DepthwiseConv, conv: torch.Tensor, row: torch.Tensor,
                 inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``L`` positions of one sequence (``inputs [L, C]``, its row ``row``): ``silu(conv)`` float32 ``[L, C]`` and the
    window ``[C, K-1+L]`` (the state before, then the inputs); the row's state updated."""
    length, k = inputs.shape[0], conv1d.weight.shape[1]
    seq = torch.cat([conv.index_select(0, row)[0], inputs.t().to(conv.dtype)], dim=-1)   # [C, K-1+L]
    conv.index_copy_(0, row, seq[None, :, seq.shape[1] - (k - 1):])
    bias = conv1d.bias.float() if conv1d.bias is not None else None
    out = F.conv1d(seq.float()[None], conv1d.weight.float()[:, None, :], bias, groups=seq.shape[0])[0]
    return F.silu(out[:, -length:]).t(), seq


class MambaStateMixin:
    """For a causal LM with :class:`Mamba2Mixer` layers: the per-sequence state (one :class:`RecurrentState` for
    every such layer) and the step's preparation; the model calls :meth:`begin_step` before its layers."""

    #: the model keeps per-sequence state outside the KV cache: the engine keeps states for the prefix cache,
    #: refuses speculative decoding and sends each sequence's state row with every step (set per instance by the model:
    #: :meth:`config_has_recurrent_state` of its config)
    has_recurrent_state: bool = True
    recurrent_state: RecurrentState | None = None

    @classmethod
    def config_has_recurrent_state(cls, hf_config: Any) -> bool:
        """Whether a model of this class with ``hf_config`` has Mamba layers (default: always)."""
        return True

    def mamba_layers(self) -> list[StatefulMixer]:
        return [m for m in self.modules() if isinstance(m, StatefulMixer)]  # type: ignore[attr-defined]

    @property
    def stage_has_state(self) -> bool:
        """Whether this process's layers keep state (under pipeline parallelism a stage may hold attention layers
        only, and keeps none)."""
        has = self.__dict__.get("_stage_has_state")
        if has is None:
            has = self.__dict__["_stage_has_state"] = bool(self.mamba_layers())
        return has

    def recurrent_state_bytes(self, rows: int, slots: int = 0) -> int:
        """The bytes of every Mamba layer's state for ``rows`` sequences, the scratch row and ``slots`` checkpoint
        slots (before allocating them)."""
        layers = self.mamba_layers()
        if not layers:
            return 0
        (c, k), ssm_shape = layers[0].state_shapes()
        return len(layers) * (rows + 1 + slots) * (c * k * layers[0].conv1d.weight.element_size()
                                                   + 4 * math.prod(ssm_shape))

    def allocate_recurrent_state(self, rows: int, slots: int = 0) -> int:
        """States for ``rows`` sequences and ``slots`` checkpoint slots of the prefix cache (kept if allocated
        already; rows grown if fewer); returns their bytes."""
        layers = self.mamba_layers()
        if not layers:
            return 0
        if self.recurrent_state is None:
            conv_shape, ssm_shape = layers[0].state_shapes()
            if any(layer.state_shapes() != (conv_shape, ssm_shape) for layer in layers):
                raise UnsupportedModelError("Mamba layers of different shapes in one model")
            weight = layers[0].conv1d.weight
            self.recurrent_state = RecurrentState(len(layers), rows, conv_shape, ssm_shape, weight.dtype,
                                                  weight.device, slots)
            for i, layer in enumerate(layers):
                layer.state, layer.state_index = self.recurrent_state, i
        else:
            self.recurrent_state.grow(rows)
        return self.recurrent_state.nbytes

    def transient_tensors(self) -> list[torch.Tensor]:
        """Tensors whose contents sleep mode need not keep: the states (a sleeping engine runs no request, and its
        prefix cache is forgotten)."""
        state = self.recurrent_state
        return [] if state is None else [state.conv, state.ssm, state.saved_conv, state.saved_ssm]

    def ensure_state_rows(self, need: int) -> None:
        """Room for rows ``0 .. need - 1`` (grown, with a warning, past those allocated at start-up)."""
        if not self.stage_has_state:
            return
        if self.recurrent_state is None or need > self.recurrent_state.rows:
            have = self.recurrent_state.rows if self.recurrent_state is not None else 0
            nbytes = self.allocate_recurrent_state(max(need, 2 * have, 16))
            logger.warning("recurrent state grown to %d sequences (%.1f MiB) while serving: more rows than the "
                           "%d allocated at start-up (outside the memory the KV cache was sized around)",
                           max(need, 2 * have, 16), nbytes / 2**20, have)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        """Before the layers: room for the step's rows, and zero states for the sequences that start at position 0."""
        if self.recurrent_state is not None:
            self.recurrent_state.first_row = None
        rows_cpu = metadata.state_rows_cpu
        if not rows_cpu or not self.has_recurrent_state or not self.stage_has_state:
            return
        self.ensure_state_rows(max(rows_cpu) + 1)
        assert self.recurrent_state is not None
        span = _span(rows_cpu, len(rows_cpu))   # (once a step, for every layer's decode rows)
        self.recurrent_state.first_row = span[0] if span is not None else None
        fresh = [i for i, c in enumerate(metadata.context_lens_cpu) if c == 0]
        if fresh:
            assert metadata.state_rows is not None
            self.recurrent_state.reset(metadata.state_rows[fresh])

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pipeline stage (see :meth:`~plinth.model_registry.models.decoder.DecoderForCausalLM.forward_stage`),
        after :meth:`begin_step`: each stage keeps the state of its own layers, in the same rows."""
        self.begin_step(metadata)
        return super().forward_stage(input_ids, positions, metadata, hidden, residual)  # type: ignore[misc]
