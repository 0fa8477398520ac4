"""Batched paged attention in plain torch ops: one padded SDPA call per group of sequences.

Where the reference backend loops over sequences, this one gathers the K/V blocks of a whole
group of sequences with a single ``index_select`` over the flat block list into a padded
``[n, max_len, num_kv_heads, head_size]`` tensor and runs one scaled-dot-product attention with a
boolean mask that encodes causality, sequence length and the sliding window.

Grouping: decode sequences (one query token) and prefill chunks are grouped separately, by
length, so that padding adds at most a quarter to the work and the gathered keys of one call stay
near 1M elements; a lone long prompt therefore runs on its own, many similar ones run together.

Grouped-query attention needs no K/V repeat: the ``G = num_heads / num_kv_heads`` query heads
that share a KV head are folded into the query-length axis, ``[n, Hkv, G * max_q, D]``.

Everything here is built from ``metadata``'s host lists and device tensors with torch ops, so
the backend runs on any torch device and needs no host-device synchronisation.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from plinth.attention_backends.interface import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Support,
    math_attention,
    soft_capped,
    softmax_with_sinks,
    torch_reads_kv_cache,
    write_kv_cache,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: a prefill group may cost at most this many times the work of its sequences run one by one ...
MAX_PADDING_FACTOR = 1.25
#: ... plus this much (query x key pairs), about what one more SDPA call costs in launch overhead
CALL_OVERHEAD_PAIRS = 8192
#: gathered key elements per call (~4 MB in float32): big copies fall out of the CPU caches and
#: cost page faults; 4-8x slower than chunks this size at 32 sequences x 2048 tokens
GATHER_ELEMENTS = 1 << 20
#: CPU decode groups of at least this many sequences use matmul + softmax instead of SDPA (measured on
#: 2 AVX512 cores: SDPA wins below ~6 sequences, the matmuls win 2.6x at 32)
MATMUL_DECODE_MIN_SEQS = 6
#: a CPU prefill of one sequence with at least twice this many query tokens attends in chunks of this many
#: queries, each over the keys up to its last position only (SDPA with a mask computes every masked pair:
#: a 500-token prompt takes 4.0 instead of 5.3 ms per layer on 2 AVX512 cores)
PREFILL_CHUNK = 128


@dataclasses.dataclass
class _Group:
    """Sequences attended by one SDPA call, with the index tensors that call needs."""

    max_q: int
    num_blocks: int
    q_index: torch.Tensor       # [n * max_q] int64: flat query row of each padded query slot
    block_ids: torch.Tensor     # [n * num_blocks] int64: cache block of each padded key block
    q_pos: torch.Tensor         # [n, max_q] int64: position of each padded query slot
    seq_lens: torch.Tensor      # [n] int64
    out_rows: torch.Tensor      # [t] int64: flat output row of each real query token
    out_src: torch.Tensor       # [t] int64: its slot in the padded [n * max_q] output
    masks: dict[tuple[int, int | None], torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask(self, block_size: int, sliding_window: int | None, g: int) -> torch.Tensor:
        """The bool mask (True = attend) for ``g`` query heads per KV head, built once per layer kind.

        Shape ``[n, 1, g * max_q, L]`` with ``L = num_blocks * block_size``; for decode groups
        (``max_q == 1``) it is ``[n, 1, 1, L]`` and broadcasts over the ``g`` heads.
        """
        key = (g if self.max_q > 1 else 1, sliding_window)
        if key not in self.masks:
            length = self.num_blocks * block_size
            key_pos = torch.arange(length, device=self.q_pos.device)  # [L]
            q_pos = self.q_pos[:, :, None]                             # [n, max_q, 1]
            allowed = key_pos <= q_pos                                 # [n, max_q, L]
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            n = allowed.shape[0]
            # [n, max_q, L] -> [n, 1, G * max_q, L], rows ordered (head, query) like the folded query
            self.masks[key] = allowed[:, None, None].expand(n, 1, key[0], self.max_q, length).reshape(
                n, 1, key[0] * self.max_q, length)
        return self.masks[key]


@dataclasses.dataclass
class _Plan:
    num_real_tokens: int
    groups: list[_Group]


def _group_sequences(q_lens: list[int], seq_lens: list[int], max_keys: int = 1 << 30) -> list[list[int]]:
    """Split sequence indices into groups, one SDPA call each.

    Decodes and prefill chunks go to separate groups. Within each, sequences sorted by length are
    packed while padding stays cheap (``MAX_PADDING_FACTOR``) and the gathered keys of the
    group stay under ``max_keys`` tokens (so the copies stay in cache; a lone longer sequence
    still gets its own group).
    """
    decodes = sorted((i for i, q in enumerate(q_lens) if q == 1), key=lambda i: -seq_lens[i])
    prefills = sorted((i for i, q in enumerate(q_lens) if q > 1), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for members in (decodes, prefills):
        current: list[int] = []
        real = max_q = max_len = 0
        for i in members:
            work = q_lens[i] * seq_lens[i]
            new_q, new_len = max(max_q, q_lens[i]), max(max_len, seq_lens[i])
            padded = (len(current) + 1) * new_q * new_len
            too_padded = padded > MAX_PADDING_FACTOR * (real + work) + CALL_OVERHEAD_PAIRS
            if current and (too_padded or (len(current) + 1) * new_len > max_keys):
                groups.append(current)
                current, real, new_q, new_len = [], 0, q_lens[i], seq_lens[i]
            current.append(i)
            real += work
            max_q, max_len = new_q, new_len
        if current:
            groups.append(current)
    return groups


def _build_group(members: list[int], metadata: AttentionMetadata, block_size: int) -> _Group:
    """Index tensors of one group. Everything about queries is known on the host (from the
    ``*_cpu`` lists) and copied over; the block ids are gathered on the device. No sync."""
    device = metadata.block_tables.device
    qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in members]
    max_q = max(q_lens)
    num_blocks = -(-max(lens[i] for i in members) // block_size)
    n = len(members)

    starts = torch.tensor([qsl[i] for i in members])                  # [n] (host)
    q_len = torch.tensor(q_lens)                                      # [n]
    seq_len = torch.tensor([lens[i] for i in members])                # [n]
    slot = torch.arange(max_q)                                        # [max_q]
    clamped = torch.minimum(slot[None, :], q_len[:, None] - 1)        # [n, max_q]: padding repeats the last
    q_index = (starts[:, None] + clamped).reshape(-1)                 # [n * max_q]
    q_pos = seq_len[:, None] - q_len[:, None] + clamped               # [n, max_q]
    real = slot[None, :] < q_len[:, None]                             # [n, max_q]
    out_rows = (starts[:, None] + slot[None, :])[real]                # [t]
    out_src = (torch.arange(n)[:, None] * max_q + slot[None, :])[real]
    used = (seq_len + block_size - 1) // block_size                   # [n]
    keep = torch.arange(num_blocks)[None, :] < used[:, None]          # [n, num_blocks]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    seqs = dev(torch.tensor(members))
    table = metadata.block_tables.index_select(0, seqs)[:, :num_blocks].long()  # [n, num_blocks]
    block_ids = torch.where(dev(keep), table, 0).reshape(-1)          # unused -> scratch block 0
    return _Group(max_q, num_blocks, dev(q_index), block_ids, dev(q_pos), dev(seq_len), dev(out_rows),
                  dev(out_src))


def build_plan(metadata: AttentionMetadata, block_size: int, max_keys: int = 1 << 30) -> _Plan:
    """Group the step's sequences and precompute every index tensor (no device sync)."""
    qsl = metadata.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(metadata.num_seqs)]
    members = _group_sequences(q_lens, metadata.seq_lens_cpu, max_keys)
    return _Plan(qsl[metadata.num_seqs], [_build_group(m, metadata, block_size) for m in members])


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, on the gathered keys as they lie (no transposed copies of K/V).

    ``q`` ``[n, Hkv, G, D]``, ``k``/``v`` ``[n, L, Hkv, D]``, ``mask`` ``[n, 1, 1, L]`` -> ``[n, Hkv, G, D]``.
    With few KV heads, every query head is multiplied with every KV head's keys in one batched
    matmul over ``[L, Hkv * D]`` and the matching diagonal blocks are kept (``Hkv`` times the tiny
    FLOPs, none of the copies); with more KV heads, one matmul per head on strided slices.
    """
    n, hkv, g, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    key_mask = ~mask[:, 0]                                                             # [n, 1, L]
    if hkv <= 4:
        eye = torch.eye(hkv, dtype=q.dtype, device=q.device)
        q_all = (q[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(n, hkv * g, hkv * d)
        scores = torch.bmm(q_all, k.reshape(n, -1, hkv * d).transpose(1, 2)).to(acc) * scale   # [n, Hkv*G, L]
        if soft_cap is not None:
            scores = soft_capped(scores, soft_cap)
        head_sinks = None if sinks is None else sinks.view(1, hkv * g, 1)
        probs = softmax_with_sinks(scores.masked_fill(key_mask, float("-inf")), head_sinks).to(q.dtype)
        full = torch.bmm(probs, v.reshape(n, -1, hkv * d)).view(n, hkv, g, hkv, d)    # [n, Hkv, G, Hkv, D]
        return full.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)                      # [n, Hkv, G, D]
    outs = []
    for h in range(hkv):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).to(acc) * scale       # [n, G, L]
        if soft_cap is not None:
            scores = soft_capped(scores, soft_cap)
        head_sinks = None if sinks is None else sinks[h * g:(h + 1) * g].view(1, g, 1)
        probs = softmax_with_sinks(scores.masked_fill(key_mask, float("-inf")), head_sinks).to(q.dtype)
        outs.append(torch.bmm(probs, v[:, :, h]))                                     # [n, G, D]
    return torch.stack(outs, dim=1)


def _chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     grp: _Group, g: int, block_size: int, soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill, ``PREFILL_CHUNK`` queries at a time over the keys they can see.

    ``q`` ``[1, Hkv, G * Q, D]`` (heads-major fold), ``k``/``v`` ``[1, L, Hkv, D]``, ``mask``
    ``[1, 1, G * Q, L]`` -> ``[1, Hkv, G * Q, D]``: the same result as one masked SDPA call.
    """
    _, hkv, _, d = q.shape
    max_q, length = grp.max_q, k.shape[1]
    qv = q.view(1, hkv, g, max_q, d)
    mv = mask.view(1, 1, g, max_q, length)
    out = torch.empty_like(qv)
    last_pos = grp.q_pos[0].tolist()          # [Q] position of each query (host tensors on a CPU)
    for a in range(0, max_q, PREFILL_CHUNK):
        b = min(max_q, a + PREFILL_CHUNK)
        keys = min(length, -(-(last_pos[b - 1] + 1) // block_size) * block_size)
        qc = qv[:, :, :, a:b].reshape(1, hkv, g * (b - a), d)
        mc = mv[:, :, :, a:b, :keys].reshape(1, 1, g * (b - a), keys)
        o = _attend(qc, k[:, :keys].transpose(1, 2), v[:, :keys].transpose(1, 2), mc, scale,
                    soft_cap, _folded_sinks(sinks, hkv, g, b - a))      # [1, Hkv, G * (b - a), D]
        out[:, :, :, a:b] = o.view(1, hkv, g, b - a, d)
    return out.view(1, hkv, g * max_q, d)


def _folded_sinks(sinks: torch.Tensor | None, hkv: int, g: int, num_queries: int) -> torch.Tensor | None:
    """Per-head sinks ``[Hkv * G]`` laid out as the heads-major fold of queries, ``[1, Hkv, G * Q, 1]``."""
    if sinks is None:
        return None
    return sinks.view(1, hkv, g, 1).expand(1, hkv, g, num_queries).reshape(1, hkv, g * num_queries, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            soft_cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked SDPA, or the step-by-step math when ``soft_cap`` or ``sinks`` (folded as the queries) is set (SDPA
    has neither)."""
    if soft_cap is not None or sinks is not None:
        return math_attention(q, k, v, mask, scale, soft_cap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class TorchBatchedBackend(AttentionBackend):
    """Paged attention with one padded, masked SDPA call per group of sequences; any device."""

    decode_rows_may_share_sequences = True   # every key and value is written before attention
    supports_soft_cap = True                 # the scores are computed here when a cap is set
    supports_sinks = True                    # ... and when the heads have sinks
    shares_kv_cache = True                   # the cache is read and written through its strides

    name = "torch_batched"
    priority = 5
    #: a compiled CPU decode step may pass a ``StaticDecode`` as ``metadata.backend_data``
    compile_safe_decode = True

    @classmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        if spec.dtype not in SUPPORTED_DTYPES:
            return Support.no(f"dtype {spec.dtype} unsupported")
        if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
            return Support.no(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        return Support.yes()

    @classmethod
    def supports_kv_cache_dtype(cls, spec: AttentionSpec, device_type: str) -> Support:
        """Any cache type torch converts from (keys and values are gathered, then converted)."""
        return torch_reads_kv_cache(spec, device_type)

    def prepare(self, metadata: AttentionMetadata) -> None:
        # The block size is only known from the cache in forward(); keep the plan lazy but shared.
        metadata.backend_data = {}

    def _plan(self, metadata: AttentionMetadata, kv_shape: torch.Size) -> _Plan:
        cache = metadata.backend_data if isinstance(metadata.backend_data, dict) else None
        key = ("torch_batched", tuple(kv_shape[2:]))
        if cache is not None and key in cache:
            return cache[key]
        _, _, block_size, num_kv_heads, head_size = kv_shape
        plan = build_plan(metadata, block_size, max(1, GATHER_ELEMENTS // (num_kv_heads * head_size)))
        if cache is not None:
            cache[key] = plan
        return plan

    def forward(
        self,
        query: torch.Tensor,     # [T, H, D]
        key: torch.Tensor,       # [T, Hkv, D]
        value: torch.Tensor,     # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:           # [T, H, D]
        static = metadata.backend_data
        if getattr(static, "static_decode", False):   # padded decode batch of a compiled step
            return static.attend(query, key, value, kv_cache, metadata.slot_mapping, scale, sliding_window,
                                 soft_cap=soft_cap, sinks=sinks)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        num_heads = query.shape[1]
        g = num_heads // num_kv_heads
        plan = self._plan(metadata, kv_cache.shape)
        out = torch.empty_like(query)
        out[plan.num_real_tokens:].zero_()  # graph-padding rows
        for grp in plan.groups:
            n = grp.seq_lens.shape[0]
            length = grp.num_blocks * block_size
            # [n * max_q, H, D] -> [n, Hkv, G * max_q, D]: query heads sharing a KV head side by side
            q = query.index_select(0, grp.q_index).view(n, grp.max_q, num_kv_heads, g, head_size)
            q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, g * grp.max_q, head_size)
            # [n * num_blocks, block_size, Hkv, D] -> [n, L, Hkv, D]
            k = kv_cache[0].index_select(0, grp.block_ids).view(n, length, num_kv_heads, head_size).to(query.dtype)
            v = kv_cache[1].index_select(0, grp.block_ids).view(n, length, num_kv_heads, head_size).to(query.dtype)
            mask = grp.mask(block_size, sliding_window, g)  # [n, 1, G * max_q or 1, L]
            if grp.max_q == 1 and n >= MATMUL_DECODE_MIN_SEQS and q.device.type == "cpu":
                o = _decode_attention(q, k, v, mask, scale, soft_cap, sinks)   # CPU: 3-4x faster than SDPA at 16-32 seqs
            elif n == 1 and grp.max_q >= 2 * PREFILL_CHUNK and q.device.type == "cpu":
                o = _chunked_prefill(q, k, v, mask, scale, grp, g, block_size, soft_cap, sinks)
            else:
                o = _attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale, soft_cap,
                            _folded_sinks(sinks, num_kv_heads, g, grp.max_q))  # [n, Hkv, G*max_q, D]
            o = o.view(n, num_kv_heads, g, grp.max_q, head_size).permute(0, 3, 1, 2, 4)
            o = o.reshape(n * grp.max_q, num_heads, head_size)
            out.index_copy_(0, grp.out_rows, o.index_select(0, grp.out_src))
        return out
