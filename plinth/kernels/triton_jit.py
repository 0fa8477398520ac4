"""Triton kernels for the small per-layer ops of a decoder and for skinny (decode) GEMMs.

- ``rmsnorm_kernel``: ``h = x (+ residual)``; ``y = h * rsqrt(mean(h^2) + eps) * w`` (one row per program),
  optionally quantized per row for the next layer's W8A8 GEMM.
- ``silu_mul_kernel``: ``y = silu(x[:, :d]) * x[:, d:]``; ``silu_mul_quant_kernel`` writes it quantized per row.
- ``rotary_kernel``: rotate-half RoPE of the q and k heads of one token, in place.
- ``skinny_gemm_kernel``: ``y = x @ w.T`` for a few rows of ``x`` (decode batches), streaming each weight
  tile once for all rows.
- ``moe_gemv_kernel``: one row times one expert's weight per slot (a token's copy for one of its experts), for
  mixture-of-experts layers with a few tokens: each chosen expert's weights streamed once; optionally
  ``silu(gate) * up`` of a ``[gate | up]`` row as it is read (the down projection after the gate/up one).
- ``moe_route_kernel``: softmax top-k routing of one token (weights, optionally renormalised, and expert ids).
- ``moe_combine_kernel``: a token's expert outputs weighted and summed.

Import through :func:`plinth.kernels.ops.jit_module` (which switches Triton to its interpreter first when
``PLINTH_TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:   # programmatic dependent launch (Triton 3.4+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: DEPENDENT stays False (stand-ins keep the kernels'
    gdc_launch_dependents = gdc_wait = tl.debug_barrier  # globals resolvable)
    HAS_GDC = False


@triton.jit
def dependent_start(DEPENDENT: tl.constexpr):
    """The first statement of a kernel that may be launched as a programmatic dependent (``DEPENDENT``,
    launched with ``launch_pdl``, see :func:`plinth.kernels.ops.dependent_options`): wait until the kernel
    before it in the stream has finished and its writes are visible (it may still be running when this
    one starts), then let the kernel after it start (a GEMV streams its weights meanwhile). Nothing may
    touch memory before it."""
    if DEPENDENT:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def tanh(x):
    """``tanh(x)`` in float32 (through the sigmoid, which every Triton backend has)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, s_ptr,   # x, residual (read), weight, output, new residual (write), scales
    N, stride_x, stride_r, stride_y, stride_h, eps, QMAX,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr = False,
    QUANT: tl.constexpr = False,
):
    """With ``QUANT`` the normalized row (rounded to the activation dtype) is written quantized per row
    (``s = max|y| / QMAX``, ``y / s`` clamped, in ``y``'s dtype, the scale to ``s_ptr[row]``): the
    arithmetic of ``quant_rows_kernel`` on this kernel's unquantized output."""
    dependent_start(DEPENDENT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = x + r                                       # in the activation dtype, as the reference
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if QUANT:
        y = (normed * w).to(x.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / QMAX, 1e-12)
        tl.store(s_ptr + row, scale)
        y = tl.minimum(tl.maximum(y / scale, -QMAX), QMAX)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + row * stride_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, D, stride_x, stride_y, BLOCK: tl.constexpr,
                    DEPENDENT: tl.constexpr = False):
    dependent_start(DEPENDENT)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_rounded(x_ptr, row_start, D, offs, mask):
    """``silu(gate) * up`` of features ``offs`` of a row starting at ``x_ptr + row_start``, rounded to the input
    dtype (as ``silu_mul_kernel`` stores it), in float32."""
    gate = tl.load(x_ptr + row_start + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row_start + D + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def silu_mul_quant_kernel(x_ptr, y_ptr, s_ptr, D, stride_x, stride_y, QMAX, BLOCK: tl.constexpr,
                          ONE_PASS: tl.constexpr, DEPENDENT: tl.constexpr = False):
    """``silu_mul_kernel`` quantized per row, one row per program: the arithmetic of ``quant_rows_kernel``
    on ``silu_mul_kernel``'s output (the activation rounded to the input dtype first). ``ONE_PASS``
    (``BLOCK >= D``): the row stays in registers; otherwise two passes, the maximum then the scaled values
    (the second rereads the row, from L2)."""
    dependent_start(DEPENDENT)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < D
        y = _silu_mul_rounded(x_ptr, row * stride_x, D, offs, mask)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / QMAX, 1e-12)
        tl.store(s_ptr + row, scale)
        y = tl.minimum(tl.maximum(y / scale, -QMAX), QMAX)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            y = _silu_mul_rounded(x_ptr, row * stride_x + d0, D, offs, d0 + offs < D)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0) / QMAX, 1e-12)
        tl.store(s_ptr + row, scale)
        for d0 in range(0, D, BLOCK):
            mask = d0 + offs < D
            y = _silu_mul_rounded(x_ptr, row * stride_x + d0, D, offs, mask)
            y = tl.minimum(tl.maximum(y / scale, -QMAX), QMAX)
            tl.store(y_ptr + row * stride_y + d0 + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One token per program: every q head then every k head; features ``[0, 2*HALF)`` are rotated."""
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    for h0 in range(0, HQ, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < HQ)[:, None] & dmask[None, :]
        p = q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p, (a * c1[None, :] - b * s1[None, :]).to(x1.dtype), mask=m)
        tl.store(p + HALF, (b * c2[None, :] + a * s2[None, :]).to(x1.dtype), mask=m)
    for h0 in range(0, HK, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < HK)[:, None] & dmask[None, :]
        p = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p, (a * c1[None, :] - b * s1[None, :]).to(x1.dtype), mask=m)
        tl.store(p + HALF, (b * c2[None, :] + a * s2[None, :]).to(x1.dtype), mask=m)


@triton.jit
def skinny_gemm_kernel(
    x_ptr,              # [M, K] activations
    w_ptr,              # [N, K] weight (nn.Linear layout)
    y_ptr,              # [M, N] output (activation dtype, or float32 partial sums when SPLIT_K > 1)
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``; ``K`` is a multiple of ``BLOCK_K * SPLIT_K``.

    ``USE_DOT``: the rows padded to ``BLOCK_M >= 16`` go through ``tl.dot``; otherwise (``M == 1``)
    a multiply-add over ``[BLOCK_N, BLOCK_K]`` tiles, reduced once at the end.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)                 # [BN, BK]
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)                 # [BM, BK]
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        x_ptrs = x_ptr + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)                 # [BN, BK]
            x = tl.load(x_ptrs)                                                   # [BK] (row 0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc2, axis=1)                                                # [BN]
        if SPLIT_K == 1:
            tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.atomic_add(y_ptr + offs_n, out, mask=mask_n)


@triton.jit
def quant_rows_kernel(x_ptr, y_ptr, s_ptr, K, stride_x, stride_y, QMAX, BLOCK: tl.constexpr):
    """Dynamic per-row quantization: ``s = max|x| / QMAX``, ``y = clamp(x / s)`` in ``y``'s dtype.

    One row per program, two passes over it (the maximum, then the scaled values): the row is read
    twice and written once, with no float32 copy in memory.
    """
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / QMAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
        tl.store(y_ptr + row * stride_y + k0 + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, xa_ptr,    # x [T, IN], A [K, S, R, IN], slots [T] int32 (-1: none), xa [T, K*R] f32
    IN, S, stride_x,
    KR: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, BLOCK_IN: tl.constexpr,
):
    """``xa[t, k*R + r] = x[t] . A[k, slot[t], r]`` for ``ROWS`` of the ``K*R`` outputs per program (zeros for a
    token without an adapter: its loads are masked off)."""
    t = tl.program_id(0)
    c = tl.program_id(1) * ROWS + tl.arange(0, ROWS)                     # [ROWS] output columns
    s = tl.load(slot_ptr + t)
    used = (c * 0 + s) >= 0                                               # the token has an adapter
    row = ((c // R) * S + s) * R + c % R                                  # A's row of each column
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for i0 in range(0, IN, BLOCK_IN):
        i = i0 + tl.arange(0, BLOCK_IN)
        imask = (i < IN) & ((i * 0 + s) >= 0)
        xv = tl.load(x_ptr + t * stride_x + i, mask=imask, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + row[:, None].to(tl.int64) * IN + i[None, :],
                     mask=((c < KR) & used)[:, None] & imask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(xa_ptr + t * KR + c, acc, mask=c < KR)


@triton.jit
def lora_expand_kernel(
    xa_ptr, b_ptr, slot_ptr, y_ptr,    # xa [T, K*R] f32, B [OUT, K, S, R], slots [T] int32, y [T, OUT] (in place)
    OUT, S, stride_y,
    KR: tl.constexpr, R: tl.constexpr, KR_P: tl.constexpr, BLOCK_OUT: tl.constexpr,
):
    """``y[t, o] += sum_c xa[t, c] B[o, c // R, slot[t], c % R]`` for a block of outputs per program (nothing for a
    token without an adapter)."""
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    s = tl.load(slot_ptr + t)
    ymask = (o < OUT) & ((o * 0 + s) >= 0)                                # nothing for a token without an adapter
    c = tl.arange(0, KR_P)
    cmask = (c < KR) & ((c * 0 + s) >= 0)
    xa = tl.load(xa_ptr + t * KR + c, mask=cmask, other=0.0)
    col = ((c // R) * S + s) * R + c % R                                  # B's column of each xa entry
    b = tl.load(b_ptr + o[:, None].to(tl.int64) * (S * KR) + col[None, :],
                mask=ymask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * xa[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + o, mask=ymask, other=0.0)
    tl.store(y_ptr + t * stride_y + o, (y.to(tl.float32) + delta).to(y.dtype), mask=ymask)


@triton.jit
def _group_scales(k0, cols, s_rows, z_rows, mask_n, mask, stride_sk, SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales and zero points of integer codes at columns ``cols`` of a tile starting at ``k0``: one per row
    (``[BN, 1]``) where a group covers the tile, else one per element (``[BN, len(cols)]``)."""
    # one return after the static branch: Triton 3.6 refuses returns of different shapes in one function, even in
    # branches of a constexpr condition
    if SBK % BLOCK_K == 0:
        group = (k0 // SBK) * stride_sk
        scale = tl.load(s_rows + group, mask=mask_n, other=0.0)[:, None]
        zero = tl.load(z_rows + group, mask=mask_n, other=0.0)[:, None]
    else:
        groups = ((cols // SBK) * stride_sk)[None, :]
        scale = tl.load(s_rows[:, None] + groups, mask=mask, other=0.0)
        zero = tl.load(z_rows[:, None] + groups, mask=mask, other=0.0)
    return scale, zero


@triton.jit
def _widened_tile(w, k0, offs_k, s_rows, z_rows, mask_n, wmask, stride_sk, W_FP8: tl.constexpr,
                  W_INT: tl.constexpr, SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """A ``[BN, BK]`` weight tile at column ``k0`` of the expert kernels in float32: FP8 E4M3 bytes times their
    scales (one per row where a scale block covers the tile), 8-bit codes as ``(q - zero) * scale``, float as is."""
    if W_FP8:
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if SBK % BLOCK_K == 0:
            w = w * tl.load(s_rows + (k0 // SBK) * stride_sk, mask=mask_n, other=0.0)[:, None]
        else:
            s_cols = ((k0 + offs_k) // SBK) * stride_sk
            w = w * tl.load(s_rows[:, None] + s_cols[None, :], mask=wmask, other=0.0)
    if W_INT:
        scale, zero = _group_scales(k0, k0 + offs_k, s_rows, z_rows, mask_n, wmask, stride_sk, SBK, BLOCK_K)
        w = (w.to(tl.float32) - zero) * scale
    return w.to(tl.float32)


@triton.jit
def _int4_tiles(byte, k0, cols, s_rows, z_rows, mask_n, mask, stride_sk, SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The two ``[BN, BK / 2]`` float32 tiles of a tile of 4-bit code pairs (``cols``: the even columns): the low
    nibbles (even columns) and the high ones (odd), widened as ``(q - zero) * scale`` (a group of an even width
    holds both codes of a byte)."""
    scale, zero = _group_scales(k0, cols, s_rows, z_rows, mask_n, mask, stride_sk, SBK, BLOCK_K)
    return ((byte & 15).to(tl.float32) - zero) * scale, ((byte >> 4).to(tl.float32) - zero) * scale


@triton.jit
def _expert_input(ptrs, mask, K, ACT_IN: tl.constexpr):
    """Inputs of the expert kernels (a row's ``[BK]`` or a ``[BM, BK]`` tile) in float32: ``x`` at ``ptrs``, or
    ``silu(gate) * up`` with ``ACT_IN`` (``ptrs`` at the gate half, the up half ``K`` further)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ACT_IN:
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * up
    return x


@triton.jit
def moe_gemv_kernel(
    x_ptr,              # [R, K] rows; slot s reads row s // ROW_DIV
    w_ptr,              # [E, N, K] stacked expert weights (each in nn.Linear layout, K contiguous); FP8 bytes with
                        # W_FP8; integer codes with W_INT ([E, N, K / 2], two per byte, low nibble first, at 4 bits)
    b_ptr,              # [E, N] biases (read with HAS_BIAS)
    s_ptr,              # [E, ceil(N / SBN), ceil(K / SBK)] FP8 scales (W_FP8), or [E, N, K / SBK] group scales (W_INT)
    z_ptr,              # [E, N, K / SBK] group zero points, strided as the scales (read with W_INT)
    y_ptr,              # [S, N] one output row per slot
    expert_ptr,         # [S] each slot's expert
    N, K,
    stride_xr, stride_we, stride_wn, stride_be, stride_ys, stride_se, stride_sn, stride_sk,
    ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, W_FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_INT: tl.constexpr = False, BITS: tl.constexpr = 8,
    ACT_IN: tl.constexpr = False,
):
    """Grid ``(S, cdiv(N, BLOCK_N))``: ``y[s, n] = x[s // ROW_DIV] . w[e_s, n] (+ b[e_s, n])``, accumulated in
    float32 over ``[BLOCK_N, BLOCK_K]`` tiles and reduced once at the end. With ``W_FP8`` the weight is FP8 E4M3
    bytes, each ``SBN x SBK`` block multiplied by its scale (per output channel: ``SBN = 1``, ``SBK >= K``);
    where ``SBK`` is a multiple of ``BLOCK_K`` a tile shares one scale per row. With ``W_INT`` it is ``BITS``-bit
    codes ``q`` widened as ``(q - zero) * scale`` per group of ``SBK`` features. With ``ACT_IN`` each row of ``x``
    is ``[gate | up]`` (``2 K`` wide) and the input is ``silu(gate) * up``, in float32."""
    slot = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ptr + slot).to(tl.int64)
    row = (slot // ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn             # [BN, 1] pointers
    x_ptrs = x_ptr + row * stride_xr + offs_k
    s_rows = s_ptr + expert * stride_se + (offs_n // SBN) * stride_sn                # [BN] pointers
    z_rows = z_ptr + expert * stride_se + offs_n * stride_sn
    if W_INT and BITS == 4:
        # a tile's BLOCK_K / 2 bytes per row load contiguously; their low nibbles multiply the even inputs and
        # their high nibbles the odd ones (K is even; a group of an even width holds both codes of a byte)
        offs_h = tl.arange(0, BLOCK_K // 2)
        acc_h = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        x_even = x_ptr + row * stride_xr + 2 * offs_h
        for k0 in range(0, K, BLOCK_K):
            h_ok = offs_h < (K - k0) // 2
            hmask = mask_n[:, None] & h_ok[None, :]
            byte = tl.load(w_rows + k0 // 2 + offs_h[None, :], mask=hmask, other=0).to(tl.int32)   # [BN, BK/2]
            lo, hi = _int4_tiles(byte, k0, k0 + 2 * offs_h, s_rows, z_rows, mask_n, hmask, stride_sk, SBK, BLOCK_K)
            x_lo = _expert_input(x_even + k0, h_ok, K, ACT_IN)
            x_hi = _expert_input(x_even + k0 + 1, h_ok, K, ACT_IN)
            acc_h += lo * x_lo[None, :] + hi * x_hi[None, :]
        out = tl.sum(acc_h, axis=1)                                               # [BN]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            wmask = mask_n[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=wmask, other=0)        # [BN, BK]
            w = _widened_tile(w, k0, offs_k, s_rows, z_rows, mask_n, wmask, stride_sk, W_FP8, W_INT, SBK, BLOCK_K)
            x = _expert_input(x_ptrs, k_ok, K, ACT_IN)                              # [BK]
            acc += w * x[None, :]
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)                                                 # [BN]
    if HAS_BIAS:
        out += tl.load(b_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + slot * stride_ys + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def moe_route_kernel(logit_ptr, weight_ptr, id_ptr, E, stride_l, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                     RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Grid ``(T,)``: token ``t``'s ``TOP_K`` largest softmax probabilities over its ``E`` router logits (float32;
    divided by their sum with ``RENORM``) and their experts (int64), largest first; of equal logits the lower
    expert first; an expert is chosen once, also among ``-inf`` logits. An id is never past ``E - 1`` (NaN logits
    choose nothing: the ids stay in range)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logit_ptr + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    total = tl.sum(tl.where(offs < E, tl.exp(logits - top), 0.0), axis=0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    taken = offs >= E
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), logits), axis=0)
        idx = tl.minimum(tl.min(tl.where((logits == best) & ~taken, offs, BLOCK_E), axis=0), E - 1)
        weights = tl.where(slots == j, tl.exp(best - top) / total, weights)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        taken = taken | (offs == idx)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weight_ptr + t * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(id_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


@triton.jit
def moe_combine_kernel(y_ptr, weight_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``out[t] = sum_j weight[t, j] * y[t * TOP_K + j]``, summed in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weight_ptr + t * TOP_K + j)
        acc += w * tl.load(y_ptr + (t * TOP_K + j) * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_grouped_kernel(
    x_ptr,              # [R, K] input rows (``[R, 2K]`` gate | up with ACT_IN)
    w_ptr,              # [E, N, K] stacked expert weights, as for moe_gemv_kernel (FP8 bytes, integer codes)
    b_ptr,              # [E, N] biases (read with HAS_BIAS)
    s_ptr, z_ptr,       # scales and zero points, as for moe_gemv_kernel
    y_ptr,              # [S, N] outputs
    order_ptr,          # [S] the slots sorted by expert (sorted position m holds slot order[m])
    block_ends_ptr,     # [E] int32: cumulative count of BLOCK_M-row blocks per expert
    row_ends_ptr,       # [E] int32: cumulative count of slots per expert (their end in sorted order)
    E, N, K,
    stride_xr, stride_we, stride_wn, stride_be, stride_ys, stride_se, stride_sn, stride_sk,
    GATHER_IN: tl.constexpr, ROW_DIV: tl.constexpr, SCATTER_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr, W_INT: tl.constexpr, BITS: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    ACT_IN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Grid ``(cdiv(S, BLOCK_M) + E, cdiv(N, BLOCK_N))``: one expert's block of up to ``BLOCK_M`` sorted slots
    times a ``BLOCK_N`` slice of its weight, widened in registers (FP8, integer codes) and multiplied with
    ``tl.dot``; programs past the last block return at once. Which expert and rows a program takes is read from
    the block and row counts on the device (no host read: a device graph can capture it). Input row of sorted
    position ``m``: ``order[m] // ROW_DIV`` with ``GATHER_IN``, else ``m``; output row: ``order[m]`` with
    ``SCATTER_OUT``, else ``m``."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(block_ends_ptr + offs_e, mask=offs_e < E, other=2147483647)
    e = tl.sum((ends <= blk).to(tl.int32), axis=0)
    if e >= E:
        return
    first_block = tl.load(block_ends_ptr + e - 1, mask=e > 0, other=0)
    row_start = tl.load(row_ends_ptr + e - 1, mask=e > 0, other=0)
    row_end = tl.load(row_ends_ptr + e)
    offs_m = row_start + (blk - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    if GATHER_IN or SCATTER_OUT:
        slot = tl.load(order_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    if GATHER_IN:
        in_rows = slot // ROW_DIV
    else:
        in_rows = offs_m.to(tl.int64)
    expert = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn                   # [BN, 1]
    s_rows = s_ptr + expert * stride_se + (offs_n // SBN) * stride_sn                   # [BN]
    z_rows = z_ptr + expert * stride_se + offs_n * stride_sn
    x_rows = x_ptr + in_rows[:, None] * stride_xr                                      # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_INT and BITS == 4:
        # low nibbles multiply the even inputs, high nibbles the odd ones (as in moe_gemv_kernel)
        offs_h = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, K, BLOCK_K):
            h_ok = offs_h < (K - k0) // 2
            wmask = mask_n[:, None] & h_ok[None, :]
            byte = tl.load(w_rows + k0 // 2 + offs_h[None, :], mask=wmask, other=0).to(tl.int32)   # [BN, BK/2]
            lo, hi = _int4_tiles(byte, k0, k0 + 2 * offs_h, s_rows, z_rows, mask_n, wmask, stride_sk, SBK, BLOCK_K)
            xmask = mask_m[:, None] & h_ok[None, :]
            x_lo = _expert_input(x_rows + k0 + 2 * offs_h[None, :], xmask, K, ACT_IN)
            x_hi = _expert_input(x_rows + k0 + 1 + 2 * offs_h[None, :], xmask, K, ACT_IN)
            acc = _grouped_dot(x_lo, lo, acc, x_ptr, IEEE)
            acc = _grouped_dot(x_hi, hi, acc, x_ptr, IEEE)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            wmask = mask_n[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=wmask, other=0)            # [BN, BK]
            w = _widened_tile(w, k0, offs_k, s_rows, z_rows, mask_n, wmask, stride_sk, W_FP8, W_INT, SBK, BLOCK_K)
            x = _expert_input(x_rows + k0 + offs_k[None, :], mask_m[:, None] & k_ok[None, :], K, ACT_IN)
            acc = _grouped_dot(x, w, acc, x_ptr, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SCATTER_OUT:
        out_rows = slot
    else:
        out_rows = offs_m.to(tl.int64)
    tl.store(y_ptr + out_rows[:, None] * stride_ys + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_dot(x, w, acc, x_ptr, IEEE: tl.constexpr):
    """``acc + x @ w.T`` (``x`` ``[BM, BK]``, ``w`` ``[BN, BK]`` float32): in float32 with ``IEEE`` (float32 models),
    else with both tiles in the input's type (bfloat16, float16) on the tensor cores."""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    dtype = x_ptr.dtype.element_ty
    return tl.dot(x.to(dtype), tl.trans(w.to(dtype)), acc)


@triton.jit
def gated_delta_step_kernel(state_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, row_stride, H, KD, VD,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One decode token of a gated DeltaNet layer: program (b, h, j) updates columns ``j * BLOCK_V ...`` of the
    ``[KD, VD]`` float32 state of value head ``h`` of sequence ``b`` (at row ``rows[b]`` of ``state``) in place,
    reading it once: ``r_k = S^T k``, ``r_q = S^T q`` before the decay ``e = exp(g)``; ``w = beta (v - e r_k)``;
    ``out = e r_q + (k . q) w``; ``S = e S + k w^T``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    item = b * H + h
    row = tl.load(rows_ptr + b).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < KD
    mv = offs_v < VD
    mask = mk[:, None] & mv[None, :]
    ptrs = state_ptr + row * row_stride + h * KD * VD + offs_k[:, None] * VD + offs_v[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    kk = tl.load(k_ptr + item * KD + offs_k, mask=mk, other=0.0)
    qq = tl.load(q_ptr + item * KD + offs_k, mask=mk, other=0.0)
    vv = tl.load(v_ptr + item * VD + offs_v, mask=mv, other=0.0)
    e = tl.exp(tl.load(g_ptr + item))
    bt = tl.load(beta_ptr + item)
    rk = tl.sum(s * kk[:, None], axis=0)
    rq = tl.sum(s * qq[:, None], axis=0)
    kq = tl.sum(kk * qq, axis=0)
    w = bt * (vv - e * rk)
    tl.store(out_ptr + item * VD + offs_v, e * rq + kq * w, mask=mv)
    tl.store(ptrs, e * s + kk[:, None] * w[None, :], mask=mask)
