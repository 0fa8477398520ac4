"""Gated DeltaNet mixer layers (the linear-attention layers of Qwen3-Next and Qwen3.5), with per-sequence state.

Each value head keeps a ``[d_k, d_v]`` float32 state ``S``. A token with (L2-normalised) key ``k``, value ``v``,
query ``q`` (scaled by ``d_k ** -0.5``), gate ``g = -exp(A_log) * softplus(a + dt_bias)`` and write strength
``beta = sigmoid(b)`` does::

    S = exp(g) * S                       # decay
    S = S + k (beta * (v - S^T k))^T     # the delta rule: move S's answer for k towards v
    o = S^T q

Prompts run a chunked form (:func:`gated_delta_scan`): within a chunk the writes depend on each other through a
unit lower-triangular system, solved once per chunk, and the state passes from chunk to chunk. Before the scan,
``q``, ``k`` and ``v`` go through a causal depthwise convolution and SiLU, whose last ``d_conv - 1`` inputs are the
second per-sequence state; after it, each head's output is RMS-normalised (a weight shared by the heads) and gated
by ``silu(z)``. The states live in the model's :class:`~plinth.model_registry.layers.mamba.RecurrentState` as the
Mamba layers' do, so the prefix cache's checkpoints, the CUDA decode graphs and sleep mode treat them alike.

Key heads may be fewer than value heads (``r = num_v_heads // num_k_heads`` value heads read one key head).
Tensor parallelism splits the key heads, each rank holding its key heads' value heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.kernels import cpu_native, ops
from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from plinth.model_registry.layers.mamba import (
    DepthwiseConv,
    GatedRMSNorm,
    StatefulMixer,
    _InProjection,
    convolve,
    layer_states,
    load_rank_heads,
    scan_in_parts,
)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the normalisation the released kernels apply)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _chunked(t: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """``[P, H, ...]`` positions to ``[H, n, c, ...]`` chunks, zero-padded at the end (padded positions write nothing,
    with ``beta`` 0, and do not decay, with ``g`` 0)."""
    t = t.movedim(0, 1)
    pad = n * c - t.shape[1]
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.reshape(t.shape[0], n, c, *t.shape[2:])


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk_size: int, chunks_at_once: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's gated delta rule, ``chunk_size`` positions at a time, in float32.

    Within a chunk, with ``G`` the cumulative log decays from the chunk's start and ``S0`` the state before it, the
    writes ``u_t = beta_t (v_t - S'_t^T k_t)`` satisfy ``(I + A) U = beta (V - exp(G) K S0)`` where ``A[t, s] =
    beta_t exp(G_t - G_s) k_t . k_s`` for ``s < t`` (unit lower-triangular), so ``U = U0 - W S0`` with ``U0`` and
    ``W`` the solutions for ``beta V`` and ``beta exp(G) K``, which do not depend on the state. Then ``o_t = exp(G_t)
    S0^T q_t + sum_{s <= t} exp(G_t - G_s) (q_t . k_s) u_s`` and the state after the chunk is ``exp(G_last) S0 +
    sum_s exp(G_last - G_s) k_s u_s^T``. Everything but the last three products is computed for ``chunks_at_once``
    chunks together (one solve for all of them); the state then passes from chunk to chunk in three products each.

    Args:
        q, k: ``[L, H, K]`` queries (normalised and scaled) and keys (normalised), one per value head.
        v: ``[L, H, V]`` values.
        g: ``[L, H]`` log decays (at most 0).
        beta: ``[L, H]`` write strengths.
        state: ``[H, K, V]`` the state before the first position.

    Returns:
        ``(o [L, H, V], state after the last position [H, K, V])``.
    """
    length = q.shape[0]
    c = min(chunk_size, length)   # (a prompt shorter than a chunk: one chunk of its length, no padding)
    outputs = []
    span = c * chunks_at_once
    for lo in range(0, length, span):
        hi = min(lo + span, length)
        n = -(-(hi - lo) // c)
        qc, kc, vc, gc, bc = (_chunked(t[lo:hi], n, c) for t in (q, k, v, g, beta))
        cum = gc.cumsum(-1)                                                    # [H, N, C]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")))   # [H, N, C, C]
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(c, dtype=q.dtype, device=q.device)
        start = torch.exp(cum)[..., None]                                      # [H, N, C, 1]
        solved = torch.linalg.solve_triangular(system, bc[..., None] * torch.cat([vc, start * kc], dim=-1),
                                               upper=False, unitriangular=True)
        u0, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)             # [H, N, C, V], [H, N, C, K]
        qk = (qc @ kc.transpose(-1, -2)) * decay                               # [H, N, C, C]
        q_start = qc * start
        k_end = (kc * torch.exp(cum[..., -1:] - cum)[..., None]).transpose(-1, -2)   # [H, N, K, C]
        chunk_decay = torch.exp(cum[..., -1])[..., None, None]                 # [H, N, 1, 1]
        out = torch.empty_like(u0)
        for i in range(n):
            u = u0[:, i] - w[:, i] @ state
            out[:, i] = q_start[:, i] @ state + qk[:, i] @ u
            state = chunk_decay[:, i] * state + k_end[:, i] @ u
        outputs.append(out.reshape(out.shape[0], n * c, -1)[:, :hi - lo].movedim(1, 0))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0], state


def gated_delta_step(ssm: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
    """One token for each of ``B`` sequences: their states (rows ``rows`` of ``ssm`` ``[rows, H, K, V]``; ``span``:
    they are the rows ``[lo, hi)`` in order, known on the host) updated in place; returns ``o [B, H, V]``. One fused
    pass over each state where a kernel runs (Triton on GPUs, the native CPU kernel), else torch ops (the state
    updated in place where the rows are a span, else gathered and scattered)."""
    out = None
    if ops.gated_delta_step_enabled(ssm):
        out = ops.gated_delta_step(ssm, rows, q, k, v, g, beta)
    elif cpu_native.gated_delta_step_enabled(ssm):
        out = cpu_native.gated_delta_step(ssm, rows, q, k, v, g, beta)
    if out is not None:
        return out
    state = ssm[span[0]:span[1]] if span is not None else ssm.index_select(0, rows)   # [B, H, K, V]
    state.mul_(torch.exp(g)[..., None, None])
    write = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state.add_(k[..., None] * write[:, :, None, :])
    if span is None:
        ssm.index_copy_(0, rows, state)
    return torch.einsum("bhkv,bhk->bhv", state, q)


class GatedDeltaNetMixer(StatefulMixer):
    """A gated DeltaNet layer (``linear_attn.*`` in the checkpoints).

    ``layout`` ``"qkvz"`` (Qwen3-Next): ``in_proj_qkvz`` holds, for each key head in turn, its ``q``, ``k``, its value
    heads' ``v`` and ``z``; ``in_proj_ba`` for each key head its value heads' ``b`` then ``a``. ``"split"`` (Qwen3.5):
    ``in_proj_qkv`` (every ``q``, then every ``k``, then every ``v``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    ``conv1d`` (no bias) runs over ``q``, ``k``, ``v`` in that order; ``A_log`` and ``dt_bias`` are per value head;
    ``norm`` is a ``[d_v]`` weight shared by the heads.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, *, layout: str = "qkvz", activation: str = "silu",
                 chunk_size: int = 64, quant_method: Any = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise UnsupportedModelError(f"gated DeltaNet layers with activation {activation!r}: only SiLU is "
                                        "supported")
        if layout not in ("qkvz", "split"):
            raise ValueError(f"gated DeltaNet layout {layout!r}")
        if num_v_heads % num_k_heads:
            raise ModelLoadError(f"gated DeltaNet: {num_v_heads} value heads do not divide into {num_k_heads} key "
                                 "heads")
        if num_k_heads % tp_size:
            raise UnsupportedModelError(f"gated DeltaNet layers of {num_k_heads} key heads cannot be split over "
                                        f"{tp_size} tensor-parallel ranks")
        self.layout = layout
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.num_k_heads, self.num_v_heads = num_k_heads // tp_size, num_v_heads // tp_size   # on this rank
        self.ratio = num_v_heads // num_k_heads
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._full = (num_k_heads * head_k_dim, num_v_heads * head_v_dim, num_v_heads)
        full_k, full_v, _ = self._full
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        if layout == "qkvz":
            # each key head's rows are contiguous, so a rank's rows are one range
            self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * full_k + 2 * full_v, bias=False,
                                                     quant_method=quant_method, **tp)
            self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * num_v_heads, bias=False, quant_method=quant_method,
                                                   **tp)
        else:
            r, kd, vd = tp_rank, self.key_dim, self.value_dim
            self.in_proj_qkv = _InProjection(hidden_size, 2 * full_k + full_v,
                                             [(r * kd, kd), (full_k + r * kd, kd), (2 * full_k + r * vd, vd)],
                                             bias=False, quant_method=quant_method, **tp)
            self.in_proj_z = ColumnParallelLinear(hidden_size, full_v, bias=False, quant_method=quant_method, **tp)
            self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, bias=False, quant_method=quant_method, **tp)
            self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, bias=False, quant_method=quant_method, **tp)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_kernel, False, self._load_conv)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        self.norm = GatedRMSNorm(self.value_dim, head_v_dim, eps, mode="norm_gate")
        assert self.norm.weight is not None
        self.norm.weight.weight_loader = self._load_norm  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(full_v, hidden_size, bias=False, quant_method=quant_method, **tp)
        self.state_index = -1
        self.state = None

    # ------------------------------------------------------------------ loading

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """``conv1d.weight`` (``[C, 1, K]`` or ``[C, K]``): this rank's channels of ``q``, ``k`` and ``v``."""
        if loaded.dim() == 3 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        full_k, full_v, _ = self._full
        if loaded.shape[0] != 2 * full_k + full_v or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(f"gated DeltaNet conv1d: expected {2 * full_k + full_v} channels of shape "
                                 f"{tuple(param.shape[1:])}, checkpoint has {tuple(loaded.shape)}")
        r, kd, vd = self.tp_rank, self.key_dim, self.value_dim
        param.data.copy_(torch.cat([loaded.narrow(0, r * kd, kd), loaded.narrow(0, full_k + r * kd, kd),
                                    loaded.narrow(0, 2 * full_k + r * vd, vd)]))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_heads(param, loaded, self._full[2], self.tp_rank, "gated DeltaNet: expected one value per value head")

    def _load_norm(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.head_v_dim,):
            raise ModelLoadError(f"gated DeltaNet norm: expected ({self.head_v_dim},), checkpoint has "
                                 f"{tuple(loaded.shape)}")
        param.data.copy_(loaded.repeat(self.num_v_heads))

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    # ------------------------------------------------------------------ forward

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qkv [T, conv_dim] in the convolution's channel order, z [T, value_dim], b [T, Hv], a [T, Hv])``."""
        t = hidden.shape[0]
        if self.layout == "split":
            return (self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden),
                    self.in_proj_a(hidden))
        kd, vd, r = self.head_k_dim, self.head_v_dim, self.ratio
        per_head = self.in_proj_qkvz(hidden).view(t, self.num_k_heads, 2 * kd + 2 * r * vd)
        q, k, v, z = per_head.split([kd, kd, r * vd, r * vd], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        return qkv, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:   # [T, H] -> [T, H]
        t = hidden.shape[0]
        qkv, z, b, a = self._project(hidden)
        conv, ssm, rows = layer_states(self, hidden, metadata)
        beta = torch.sigmoid(b.float())                                                       # [T, Hv]
        g = -torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)                     # [T, Hv]
        qsl, n = metadata.query_start_loc_cpu, metadata.num_seqs
        xc, windows, decodes = convolve(self.conv1d, conv, rows, qkv, metadata)
        q, k, v = xc.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.view(t, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = l2_normalize(k.view(t, self.num_k_heads, self.head_k_dim))
        if self.ratio > 1:   # each value head reads its key head
            q, k = q.repeat_interleave(self.ratio, dim=1), k.repeat_interleave(self.ratio, dim=1)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        y = torch.empty_like(v)
        if decodes:
            first = self.state.first_row if self.state is not None else None
            y[:decodes] = gated_delta_step(ssm, rows[:decodes], q[:decodes], k[:decodes], v[:decodes], g[:decodes],
                                           beta[:decodes], (first, first + decodes) if first is not None else None)
        saves = metadata.state_saves if self.state is not None else None
        for i in range(decodes, n):
            lo, hi = qsl[i], qsl[i + 1]
            if hi == lo:
                continue
            y[lo:hi], state = scan_in_parts(
                self, lambda qq, kk, vv, gg, bb, h: gated_delta_scan(qq, kk, vv, gg, bb, h, self.chunk_size),
                (q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi]), ssm.index_select(0, rows[i:i + 1])[0],
                windows[i], saves.get(i) if saves else None)
            ssm.index_copy_(0, rows[i:i + 1], state[None])
        out = self.norm(y.view(t, self.value_dim), z)
        return self.out_proj(out.to(hidden.dtype))
