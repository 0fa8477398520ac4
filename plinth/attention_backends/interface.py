"""The attention-backend contract and the per-step attention metadata.

KV-cache layout (every backend unless it overrides :meth:`AttentionBackend.kv_cache_shape`)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]
              (index 0 = keys, 1 = values)

Block 0 is never given to a sequence: it is the scratch block that padding rows (CUDA-graph
padding) write into, so ``slot_mapping`` is never negative and writes need no mask.

A token at position ``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]``
at offset ``p % block_size``; its flat slot is ``block * block_size + offset``.

The batch of one step is flat: the ``T`` scheduled tokens of ``B`` sequences laid end to end.
Sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]`` of q/k/v; those tokens sit
at positions ``context_lens[s] .. seq_lens[s]-1`` of the sequence, after ``context_lens[s]``
tokens that are already in the cache (an earlier chunk, an earlier step, or a prefix-cache hit).
Attention is causal over the whole sequence.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch

from plinth.kernels import cpu_native


@dataclasses.dataclass(frozen=True)
class Support:
    """A yes/no answer with the reason for a no."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> Support:
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


@dataclasses.dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch.

    Device tensors are on the model's device; ``*_cpu`` lists are host copies made from
    the same numpy arrays (no device sync needed to read them).
    """

    num_tokens: int                 # T: scheduled tokens (may include padding for graphs)
    num_seqs: int                   # B
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32: tokens in the cache after this step
    context_lens: torch.Tensor      # [B] int32: tokens already in the cache before this step
    slot_mapping: torch.Tensor      # [T] int64: where each new token's K/V is written (padding -> block 0)
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32
    query_start_loc_cpu: list[int]  # [B + 1]
    seq_lens_cpu: list[int]         # [B]
    backend_data: Any = None        # whatever the selected backend precomputes once per step
    #: rows of a decode step may be one sequence's consecutive positions (speculative decoding's drafts): every
    #: row's keys and values must be in the cache before any row attends
    rows_share_sequences: bool = False
    #: ``[B]`` int64: each sequence's row of the model's recurrent state (models with Mamba layers), and its host
    #: copy; ``None``: the step keeps no state (a model without such layers, a start-up profile)
    state_rows: torch.Tensor | None = None
    state_rows_cpu: list[int] | None = None
    #: prefix caching of such states: sequence index -> ``[(offset, slot)]`` (increasing offsets), save the state
    #: after the first ``offset`` tokens of the sequence's chunk (fewer than its tokens: inside a prompt chunk) into
    #: checkpoint slot ``slot``; ``None``: none this step (saves at the end of a chunk are copies of rows, made after
    #: the forward)
    state_saves: dict[int, list[tuple[int, int]]] | None = None
    #: image positions that attend bidirectionally within their image (Gemma 3): ``(sequence, first row, rows, first
    #: position, end position)`` per image, its rows this step's queries; every position before the end is in the
    #: cache by the end of the step (the scheduler never ends a chunk inside such an image); ``None``: none
    image_spans: tuple[tuple[int, int, int, int, int], ...] | None = None
    #: ``[T]`` int64: each row's segment (token type) for an encoder that reads text pairs (BERT); ``None``: 0
    token_types: torch.Tensor | None = None
    #: the step as other kinds of layers see it, made once per step (:func:`chunked_attention_view`; a copy of this
    #: metadata that changes the step, ``dataclasses.replace``, must start with ``views={}``)
    views: dict[Any, AttentionMetadata] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_leading_decodes(self) -> int:
        """How many leading sequences compute one token (the scheduler puts decodes first): the decode part of a
        mixed step; 0 when every sequence computes one token (a decode-only step has no such split)."""
        q = self.query_start_loc_cpu
        n = 0
        while n < self.num_seqs and q[n + 1] - q[n] == 1:
            n += 1
        return 0 if n == self.num_seqs else n

    @property
    def context_lens_cpu(self) -> list[int]:
        q = self.query_start_loc_cpu
        return [self.seq_lens_cpu[i] - (q[i + 1] - q[i]) for i in range(self.num_seqs)]


def check_chunk_blocks(chunk: int, block_size: int, where: str) -> None:
    """Refuse KV blocks that do not divide an attention chunk (:func:`chunked_attention_view` starts each chunk's
    block table at a block boundary).

    Raises:
        ConfigError: ``chunk % block_size != 0``.
    """
    if chunk % block_size:
        from plinth.config import ConfigError

        raise ConfigError(f"{where}: attention in chunks of {chunk} tokens, which the {block_size}-token KV blocks "
                          "do not divide; choose a --block-size that divides it")


def chunked_attention_view(metadata: AttentionMetadata, chunk: int, block_size: int,
                           backend: AttentionBackend | None = None) -> AttentionMetadata:
    """The step as a layer of chunked local attention sees it (Llama 4): a query at position ``p`` attends to the
    positions ``p // chunk * chunk .. p`` only.

    Each sequence's queries are cut where they cross a chunk boundary, and each piece becomes a sequence of its own
    whose block table starts at its chunk's first block (``chunk`` is a multiple of ``block_size``): plain causal
    attention over that view is chunked attention over the step, so every backend runs it unchanged. The query rows
    keep their order and the new keys and values their slots. A decode-only step keeps one piece per row and is
    made with device ops alone (a decode graph captures it); other steps are cut on the host. Made once per step
    and ``chunk`` (kept in ``metadata.views``) and prepared by ``backend``.
    """
    if chunk % block_size:
        raise ValueError(f"an attention chunk of {chunk} tokens is not a multiple of the {block_size}-token blocks")
    if metadata.max_seq_len <= 0 or len(metadata.seq_lens_cpu) != metadata.num_seqs:
        raise RuntimeError("chunked attention needs the step's sequence lengths on the host (a step without them, "
                           "such as a compiled CPU decode step's, cannot be cut into chunks)")
    key = ("chunked", chunk, block_size)
    view = metadata.views.get(key)
    if view is not None:
        return view
    per_chunk = chunk // block_size
    tables = metadata.block_tables
    device = tables.device
    width = min(tables.shape[1], per_chunk)
    if metadata.is_decode_only:   # one query per row: its chunk is that of its sequence's last position
        lens = metadata.seq_lens
        first = torch.div((lens - 1).clamp(min=0), chunk, rounding_mode="floor") * per_chunk   # [B] blocks skipped
        rows = tables   # each piece's sequence's table row
        qsl, qsl_cpu = metadata.query_start_loc, metadata.query_start_loc_cpu
        new_lens = (lens - first * block_size).to(torch.int32)
        context = (metadata.context_lens - first * block_size).clamp(min=0).to(torch.int32)
        lens_cpu = [n - max(n - 1, 0) // chunk * chunk for n in metadata.seq_lens_cpu]
        max_query = metadata.max_query_len
    else:
        starts, first_cpu, src_cpu, qsl_cpu, lens_cpu = [], [], [], [0], []
        q = metadata.query_start_loc_cpu
        for s, total in enumerate(metadata.seq_lens_cpu):
            n = q[s + 1] - q[s]
            begin = total - n   # the position of the sequence's first query of the step
            c = max(begin, 0) // chunk if n else max(total - 1, 0) // chunk
            while True:   # (a sequence without queries keeps one empty piece, at its last chunk)
                end = min(total, (c + 1) * chunk) if n else total
                src_cpu.append(s)
                first_cpu.append(c * per_chunk)
                lens_cpu.append(end - c * chunk)
                qsl_cpu.append(qsl_cpu[-1] + (end - max(begin, c * chunk) if n else 0))
                starts.append(max(begin, c * chunk) - c * chunk)
                if end >= total:
                    break
                c += 1
        host = torch.tensor([src_cpu, first_cpu, lens_cpu, starts, qsl_cpu[:-1]], dtype=torch.int64)
        host = host.to(device, non_blocking=True)
        first, new_lens, context = host[1], host[2].to(torch.int32), host[3].to(torch.int32)
        rows = tables[host[0]]
        qsl = torch.cat([host[4], host.new_tensor([qsl_cpu[-1]])]).to(torch.int32)
        max_query = max(b - a for a, b in zip(qsl_cpu, qsl_cpu[1:], strict=False)) if len(qsl_cpu) > 1 else 0
    columns = (first[:, None] + torch.arange(width, device=device)).clamp(max=tables.shape[1] - 1)
    view = dataclasses.replace(
        metadata, num_seqs=len(lens_cpu), max_query_len=max_query,
        max_seq_len=min(metadata.max_seq_len, chunk), query_start_loc=qsl, seq_lens=new_lens,
        context_lens=context, block_tables=rows.gather(1, columns.to(torch.int64)),
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu, backend_data=None, state_rows=None, state_rows_cpu=None,
        state_saves=None, views={})
    if backend is not None:
        backend.prepare(view)
    metadata.views[key] = view
    return view


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention shapes of a model, used by ``supports`` and by selection benchmarks."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    #: the KV cache's element type; ``None``: ``dtype``
    kv_cache_dtype: torch.dtype | None = None
    #: attention scores pass through ``cap * tanh(score / cap)`` before the softmax (Gemma 2); ``None``: not
    logit_soft_cap: float | None = None
    #: each head has a learned sink logit in its softmax's denominator (gpt-oss)
    sinks: bool = False

    def attend_kwargs(self, device: torch.device | str = "cpu") -> dict[str, Any]:
        """The per-layer keywords of :meth:`AttentionBackend.forward` these shapes call for; where the model has
        sinks, stand-ins on ``device`` (from -1 to 2 across the heads) for selection's checks and timings."""
        kw = attend_kwargs(self.sliding_window, self.logit_soft_cap)
        if self.sinks:
            kw["sinks"] = torch.linspace(-1.0, 2.0, self.num_heads, dtype=torch.float32, device=device)
        return kw

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


#: device types where torch converts and copies 8-bit floats (the torch backends read such caches there)
FP8_TORCH_DEVICES = ("cpu", "cuda")
#: KV-cache element types below the model's precision, and the largest value each holds
FP8_KV_DTYPES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def torch_reads_kv_cache(spec: AttentionSpec, device_type: str) -> Support:
    """The answer of a backend that gathers keys and values with torch and widens them: any cache type torch
    converts from (16-bit floats everywhere, 8-bit floats on the devices where it converts them)."""
    if spec.cache_dtype == spec.dtype or spec.cache_dtype not in FP8_KV_DTYPES or device_type in FP8_TORCH_DEVICES:
        return Support.yes()
    return Support.no(f"an 8-bit KV cache on {device_type!r} unsupported (torch converts 8-bit floats on "
                      f"{', '.join(FP8_TORCH_DEVICES)})")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type a ``kv_cache_dtype`` setting (``auto``, ``bfloat16``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``)
    stands for."""
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's element type: an 8-bit float cache gets values clamped to its range first (a value
    beyond it would otherwise become NaN or infinity)."""
    if x.dtype == dtype:
        return x
    limit = FP8_KV_DTYPES.get(dtype)
    if limit is not None:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class AttentionBackend(abc.ABC):
    """A paged-attention implementation.

    One instance serves every attention layer of a model; per-layer state (the scale, the
    sliding window) is passed to :meth:`forward`.
    """

    #: registry name, e.g. ``"torch_sdpa"``
    name: ClassVar[str]
    #: with ``--selection off`` the highest-priority supported backend wins
    priority: ClassVar[int] = 0
    #: decode steps may be captured in a device graph: ``forward`` reads no host values that change
    #: between steps (only tensors, ``num_seqs``, ``num_tokens`` and the block-table width)
    graph_safe: ClassVar[bool] = False
    #: ``forward`` also takes ``rotary=(cos, sin)`` (``[T, head_size]`` each): ``query`` and ``key`` then
    #: arrive before their rotate-half RoPE and the backend applies it (so a decode kernel can rotate and
    #: write the cache in the same launch); the attention layer rotates them itself for other backends. A
    #: subclass that overrides ``forward`` must take ``rotary`` too, or set this back to False
    fuses_rotary: ClassVar[bool] = False
    #: ``forward`` honours ``AttentionMetadata.rows_share_sequences``: with it, a step's keys and values are all
    #: written before any row attends, so a sequence's token and its draft tokens can run as rows of a decode
    #: step (a replayed decode graph). A subclass that overrides ``forward`` must honour it too, or set this back
    #: to False (its drafts then run as multi-token queries)
    decode_rows_may_share_sequences: ClassVar[bool] = False
    #: ``forward`` takes ``soft_cap`` (attention-logit soft-capping, ``cap * tanh(score / cap)``, Gemma 2);
    #: :meth:`check` refuses models that need it for backends that do not
    supports_soft_cap: ClassVar[bool] = False
    #: ``forward`` takes ``sinks`` (``[num_heads]`` float32: each head's learned sink logit, which joins the
    #: softmax's denominator and has no value, gpt-oss); :meth:`check` refuses models that need them for backends
    #: that do not
    supports_sinks: ClassVar[bool] = False
    #: a layer whose values are its keys (multi-head latent attention) may get one tensor viewed as both halves
    #: of its cache (``kv_cache[0]`` and ``kv_cache[1]`` the same memory, a stride-0 first dimension): ``forward``
    #: then reads and writes the cache through strides only (writing identical keys and values to it)
    shares_kv_cache: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        """Say whether this backend can run ``spec`` on ``device_type`` (``"cpu"``, ``"cuda"``, ...).

        Returns:
            ``Support.yes()`` or ``Support.no(reason)``; the reason is shown to users
            (e.g. ``"flash_attn not installed"``, ``"head size 96 unsupported"``).
            Must not raise for a missing optional package.
        """

    @classmethod
    def supports_kv_cache_dtype(cls, spec: AttentionSpec, device_type: str) -> Support:
        """Whether the backend keeps a KV cache of ``spec.cache_dtype`` (default: the model's dtype only; a backend
        that reads 8-bit caches overrides this)."""
        if spec.cache_dtype == spec.dtype:
            return Support.yes()
        return Support.no(f"an 8-bit KV cache ({str(spec.cache_dtype).removeprefix('torch.')}, --kv-cache-dtype) "
                          f"unsupported: keeps the model's {str(spec.dtype).removeprefix('torch.')}")

    @classmethod
    def check(cls, spec: AttentionSpec, device_type: str) -> Support:
        """:meth:`supports` and :meth:`supports_kv_cache_dtype` together (what selection asks). A cache of another
        type than the model's needs the class itself to define :meth:`supports_kv_cache_dtype`: a subclass with
        its own kernels does not inherit its parent's answer; so does a model with attention-logit soft-capping
        for :attr:`supports_soft_cap`."""
        if spec.logit_soft_cap is not None and not applies_soft_cap(cls):
            return Support.no("attention-logit soft-capping (attn_logit_softcapping, Gemma 2) unsupported")
        if spec.sinks and not applies_sinks(cls):
            return Support.no("attention sinks (gpt-oss) unsupported")
        support = cls.supports(spec, device_type)
        if not support or spec.cache_dtype == spec.dtype:
            return support
        if "supports_kv_cache_dtype" not in cls.__dict__:
            return AttentionBackend.supports_kv_cache_dtype.__func__(cls, spec, device_type)
        return cls.supports_kv_cache_dtype(spec, device_type)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The shape of one layer's KV-cache tensor."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Precompute per-step data once for all layers (store it in ``metadata.backend_data``).

        Called by the model runner after building the metadata and before the forward pass.
        """

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,     # [T, num_heads, head_size]
        key: torch.Tensor,       # [T, num_kv_heads, head_size]
        value: torch.Tensor,     # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:           # [T, num_heads, head_size]
        """Write the new keys/values into ``kv_cache`` at ``slot_mapping``, then attend.

        Each query token attends causally to every cached and new token of its own sequence
        at a position <= its own (and > position - sliding_window when a window is set).
        Rows beyond ``query_start_loc[-1]`` (graph padding) may hold anything. A backend with
        :attr:`supports_soft_cap` also takes ``soft_cap: float | None`` (scores ``scale * q.k`` become
        ``soft_cap * tanh(score / soft_cap)`` before the softmax); it is passed only when set. A backend with
        :attr:`supports_sinks` also takes ``sinks: torch.Tensor | None`` (``[num_heads]``): head ``h``'s softmax
        is ``exp(s_j) / (exp(sinks[h]) + sum_i exp(s_i))``; passed only when the model has sinks.
        """


def attend_kwargs(sliding_window: int | None, soft_cap: float | None) -> dict[str, Any]:
    """The per-layer keywords of :meth:`AttentionBackend.forward` (``soft_cap`` only where set, so backends
    without it still run every other model; ``sinks``, a tensor, is added by the layer that holds them)."""
    kw: dict[str, Any] = {"sliding_window": sliding_window}
    if soft_cap is not None:
        kw["soft_cap"] = soft_cap
    return kw


def soft_capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: attention scores (Gemma 2) or logits (Gemma 2/3's final cap) kept in ``(-cap, cap)``."""
    return torch.tanh(x / cap) * cap


def applies_soft_cap(backend: type[AttentionBackend] | AttentionBackend) -> bool:
    """Whether a backend class (or instance) sets ``supports_soft_cap`` itself: a subclass with its own kernels
    does not inherit its parent's answer."""
    cls = backend if isinstance(backend, type) else type(backend)
    return bool(cls.__dict__.get("supports_soft_cap", False))


def applies_sinks(backend: type[AttentionBackend] | AttentionBackend) -> bool:
    """Whether a backend class (or instance) sets ``supports_sinks`` itself (not inherited, as
    :func:`applies_soft_cap`)."""
    cls = backend if isinstance(backend, type) else type(backend)
    return bool(cls.__dict__.get("supports_sinks", False))


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores)`` over the last dimension, with ``sinks`` (broadcast to ``scores[..., :1]``) as one more
    logit in each denominator when given. Masked scores are ``-inf``; a row with no allowed key gives zeros."""
    if sinks is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   scale: float, cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention computed step by step in float32 (at least): for what SDPA has no argument for, soft-capped
    scores, ``cap * tanh(scale * q.k / cap)``, and sink logits (``sinks`` broadcast to ``[..., Q, 1]``).

    ``q`` ``[..., Q, D]``, ``k``/``v`` ``[..., L, D]``, ``allowed`` (bool, broadcast to ``[..., Q, L]``) or
    ``None`` -> ``[..., Q, D]`` in ``q``'s dtype; a row with no allowed key gives zeros.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if cap is not None:
        scores = soft_capped(scores, cap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(softmax_with_sinks(scores, sinks), v.to(acc)).to(q.dtype)


def attend_within_images(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                         *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (a backend's causal attention of the step) with the rows of ``metadata.image_spans`` attended again
    as transformers' Gemma 3 masks them: a position of an image sees every earlier position and every position of its
    own image (and, in a sliding-window layer, those within the window behind it: keys ``(p - window, end)``).

    The keys and values are read from ``kv_cache`` (the default layout, :meth:`AttentionBackend.kv_cache_shape`),
    where the backend wrote this step's; ``query`` is rotated already.
    """
    if not metadata.image_spans:
        return out
    bs = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[-2]
    for seq, first, rows, pos, end in metadata.image_spans:
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        base = lo // bs * bs
        blocks = metadata.block_tables[seq, base // bs:-(-end // bs)].long()
        k = kv_cache[0, blocks].flatten(0, 1)[lo - base:end - base].transpose(0, 1)            # [Hkv, L, D]
        v = kv_cache[1, blocks].flatten(0, 1)[lo - base:end - base].transpose(0, 1)
        k, v = k.to(query.dtype), v.to(query.dtype)
        q = query[first:first + rows].transpose(0, 1)                                             # [Hq, R, D]
        allowed = None
        if sliding_window is not None:
            q_pos = torch.arange(pos, pos + rows, device=query.device)[:, None]
            k_pos = torch.arange(lo, end, device=query.device)[None, :]
            allowed = k_pos > q_pos - sliding_window
        if soft_cap is not None or sinks is not None:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            o = math_attention(q, k, v, allowed, scale, soft_cap, None if sinks is None else sinks[:, None, None])
        else:   # (the key heads shared by their query heads, not copied)
            o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed,
                                                                 scale=scale, enable_gqa=group > 1)[0]
        out[first:first + rows] = o.transpose(0, 1)
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into a ``[2, num_blocks, block_size, H, D]`` cache at ``slot_mapping``."""
    if kv_cache.device.type == "cpu" and cpu_native.kv_write_supported(key, value, kv_cache):
        cpu_native.write_kv(key, value, kv_cache, slot_mapping)   # one native copy loop (CPU)
        return
    n = slot_mapping.shape[0]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, num_slots, H, D]
    key, value = to_cache_dtype(key[:n], kv_cache.dtype), to_cache_dtype(value[:n], kv_cache.dtype)
    if kv_cache.dtype in FP8_KV_DTYPES:   # torch copies 8-bit floats as their bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)
