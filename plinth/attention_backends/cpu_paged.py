"""Native paged attention for CPUs: decode steps read the KV cache in place.

Decode-only steps run a C++ kernel (:mod:`plinth.attention_backends.cpu_paged_build`) that walks
each sequence's blocks through its block-table row, one work item per (sequence, KV head) spread
over OpenMP threads, with every query head of the GQA group scored together and a float32 online
softmax (bfloat16 caches on AVX512-BF16: two passes, every score first, then the probabilities and P V).
Unlike :mod:`~plinth.attention_backends.torch_batched`, no step gathers the context of
its sequences into padded tensors, so the work grows with the tokens attended, not with a copy of
them. Prefill and mixed steps run a second kernel (:func:`paged_prefill`: causal over each sequence's
cache, tiles of 16 query positions per KV head, each block's keys transposed once so a row's scores are
plain vector multiply-adds; head sizes 64 and 128, AVX512 or AVX2); other shapes, and the static-shape decode of
a compiled step, run the ``torch_batched`` path this backend extends. bfloat16 prefill sequences of at least
:func:`fused_min_rows` rows take a fused attention (:func:`sdpa_prefill`) on CPUs with AMX tiles: the AMX kernel
(:func:`amx_prefill`) from :data:`AMX_MIN_ROWS` rows, else torch's (oneDNN's AMX micro-kernels) from
:data:`SDPA_MIN_ROWS`. Without AMX, torch's fused attention is slower than the native kernel, which keeps them.

``PLINTH_CPU_PAGED_ATTENTION=0`` turns the backend off (``supports()`` says so).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from plinth.attention_backends.cpu_paged_build import load_kernel
from plinth.attention_backends.interface import AttentionMetadata, AttentionSpec, Support, write_kv_cache
from plinth.attention_backends.torch_batched import TorchBatchedBackend
from plinth.config import ConfigError

ENABLE_ENV = "PLINTH_CPU_PAGED_ATTENTION"
SDPA_PREFILL_ENV = "PLINTH_CPU_SDPA_PREFILL"
#: bfloat16 prefill sequences of at least this many query rows take torch's fused attention, one call per sequence,
#: on CPUs with AMX: alone, one sequence is even with the native kernel at ~64 rows and ahead from ~96 (500 rows 1.12
#: against 2.74 ms a layer); several short ones in a step run faster in the kernel's single call (8 x 40 rows 0.32
#: against 0.72 ms). float32: about even, not routed. Without AMX (AVX512-BF16 vectors) torch's attention is ~3x
#: slower than the native kernel (SmolLM2 shapes: 128 rows 0.49 against 0.17 ms, 500 rows 5.1 against 1.6, 2,000
#: rows 39 against 21), so there the route is off by default (:func:`_sdpa_prefill_on`)
SDPA_MIN_ROWS = 128
#: with the AMX prefill kernel (:func:`amx_prefill`), sequences of at least this many rows take it: it beats the
#: native kernel from 16 rows (one sequence of 16 fresh rows 0.021 against 0.024 ms a layer, 32 rows after 1,000
#: cached tokens 0.47 against 0.58, 32 prompts of 50 rows 1.5 against 3.7 in 32 calls against one)
AMX_MIN_ROWS = 16
MAX_HEAD_SIZE = 256
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: the 8-bit cache the native decode kernel reads (bfloat16 models, head sizes 64 and 128, AVX512-BF16)
FP8_CACHE_DTYPE = torch.float8_e4m3fn
FP8_HEAD_SIZES = (64, 128)
#: the decode entry point's dtype code for bfloat16 queries over an FP8 E4M3 cache
FP8_DTYPE_CODE = 2
#: the decode and prefill entry points' dtype code for float32 queries over a bfloat16 cache (AVX2 builds)
F32_BF16_DTYPE_CODE = 3


def _dtype_code(query: torch.Tensor, kv_cache: torch.Tensor) -> int | None:
    """The entry points' dtype code for these queries over this cache (None: no kernel for the pair)."""
    if kv_cache.dtype == query.dtype:
        return _DTYPE_CODES.get(query.dtype)
    if query.dtype == torch.bfloat16 and kv_cache.dtype == FP8_CACHE_DTYPE:
        return FP8_DTYPE_CODE
    if query.dtype == torch.float32 and kv_cache.dtype == torch.bfloat16:
        return F32_BF16_DTYPE_CODE
    return None


def _enabled() -> bool:
    from plinth.config import env_flag

    return env_flag(ENABLE_ENV, True)


class CpuPagedBackend(TorchBatchedBackend):
    """Decode and prefill through native kernels over the paged cache; other shapes as ``torch_batched``."""

    #: part of the start-up selection's cache key: a changed kernel or route (here bfloat16 prompts on CPUs without
    #: AMX kept on the native prefill kernel) is timed afresh
    selection_revision = 7

    name = "cpu_paged"
    priority = 6
    shares_kv_cache = False   # the native kernels take a contiguous cache

    @classmethod
    def supports_kv_cache_dtype(cls, spec: AttentionSpec, device_type: str) -> Support:
        """The model's dtype; a bfloat16 cache (``--kv-cache-dtype bfloat16``) for float32 models where the kernel
        library reads one under float32 queries (AVX2 builds), decode and prefill rows alike; or an FP8 E4M3 cache
        (``--kv-cache-dtype fp8``) for bfloat16 models with head size 64 or 128 where the kernel library has its FP8
        decode (AVX512-BF16): decode rows read it in place, prefill rows widen the context they attend to
        bfloat16."""
        if spec.cache_dtype == spec.dtype:
            return Support.yes()
        if spec.cache_dtype == torch.bfloat16:
            if spec.dtype != torch.float32:
                return Support.no(f"a bfloat16 KV cache unsupported for {str(spec.dtype).removeprefix('torch.')} "
                                  f"models (float32 only)")
            if not f32_bf16_available():
                return Support.no("a bfloat16 KV cache under float32 queries unsupported: the kernel reads one on "
                                  "CPUs with AVX2 and no AVX512 (this CPU or build differs)")
            return Support.yes()
        if spec.cache_dtype != FP8_CACHE_DTYPE:
            return Support.no(f"an 8-bit KV cache of {str(spec.cache_dtype).removeprefix('torch.')} unsupported: "
                              f"reads float8_e4m3fn (--kv-cache-dtype fp8)")
        if spec.dtype != torch.bfloat16 or spec.head_size not in FP8_HEAD_SIZES:
            return Support.no(f"an FP8 KV cache unsupported for {str(spec.dtype).removeprefix('torch.')} models of "
                              f"head size {spec.head_size}: bfloat16 and head sizes 64, 128 only")
        if not fp8_decode_available():
            return Support.no("an FP8 KV cache unsupported: this CPU (or build) has no AVX512-BF16 kernel for it")
        return Support.yes()

    @classmethod
    def supports(cls, spec: AttentionSpec, device_type: str) -> Support:
        """CPU, float32 or bfloat16, head size up to 256, and a C++ compiler (or an earlier build)."""
        try:
            if not _enabled():
                return Support.no(f"unsupported: turned off by {ENABLE_ENV}")
        except ConfigError as exc:
            return Support.no(f"unsupported: {exc}")
        if device_type != "cpu":
            return Support.no(f"unsupported: runs on CPUs only, not {device_type}")
        if spec.dtype not in _DTYPE_CODES:
            return Support.no(f"unsupported: dtype {spec.dtype} (float32 and bfloat16 only)")
        if not 0 < spec.head_size <= MAX_HEAD_SIZE:
            return Support.no(f"unsupported: head size {spec.head_size} (at most {MAX_HEAD_SIZE})")
        if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
            return Support.no(f"unsupported: num_heads {spec.num_heads} is not a multiple of num_kv_heads "
                              f"{spec.num_kv_heads}")
        build = load_kernel()
        if build.library is None:
            return Support.no(f"unsupported: {build.reason}")
        return Support.yes()

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
    ) -> torch.Tensor:           # [T, H, D]
        static = getattr(metadata.backend_data, "static_decode", False)
        if (not static and query.device.type == "cpu" and query.dtype == torch.bfloat16
                and kv_cache.dtype == FP8_CACHE_DTYPE):
            out = self._forward_fp8(query, key, value, kv_cache, metadata, scale, sliding_window)
            if out is not None:
                return out
        if (static or query.device.type != "cpu" or query.dtype not in _DTYPE_CODES
                or _dtype_code(query, kv_cache) not in (0, 1, F32_BF16_DTYPE_CODE)):
            return super().forward(query, key, value, kv_cache, metadata, scale=scale, sliding_window=sliding_window)
        if not metadata.is_decode_only:
            # prefill chunks (with decode rows mixed in): the native causal kernel over the cache, where it
            # takes the shapes (the same written cache, then one call for every sequence's rows)
            if _prefill_supported(query, kv_cache):
                write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
                out = self._mixed(query, key, value, kv_cache, metadata, scale, sliding_window)
                if out is not None:
                    return out
            return super().forward(query, key, value, kv_cache, metadata, scale=scale, sliding_window=sliding_window)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return paged_decode(query, kv_cache, *self._step_indices(metadata), metadata.num_seqs, scale, sliding_window,
                            max_seq_len=metadata.max_seq_len, every_row_owned=query.shape[0] == metadata.num_seqs)

    def _forward_fp8(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor | None:
        """A step over an FP8 E4M3 cache (``None``: a shape for the ``torch_batched`` path): the new keys and values
        written (clamped and rounded), then the steps of a 16-bit cache: decode rows through the (FP8) decode kernel,
        every prefill sequence through :func:`sdpa_prefill` (see :meth:`_prefill`)."""
        if query.shape[-1] not in FP8_HEAD_SIZES or not fp8_decode_available():
            return None
        if metadata.is_decode_only:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            return paged_decode(query, kv_cache, *self._step_indices(metadata), metadata.num_seqs, scale,
                                sliding_window, max_seq_len=metadata.max_seq_len,
                                every_row_owned=query.shape[0] == metadata.num_seqs)
        num_decodes = self._decode_split(metadata, self._step_indices(metadata)[2])[0]
        seq_lens = metadata.seq_lens_cpu
        if metadata.query_start_loc_cpu[metadata.num_seqs] != query.shape[0] or (
                sliding_window and any(seq_lens[i] > sliding_window for i in range(num_decodes, metadata.num_seqs))):
            return None   # padding rows, or windowed prompts: torch_batched's masks
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return self._mixed(query, key, value, kv_cache, metadata, scale, sliding_window)

    def _mixed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor | None:
        """A step with prefill rows: its leading one-token sequences (the scheduler puts decodes first)
        through the decode kernel, which reads each KV head's cache once for all the query heads that
        share it, and the rest through :meth:`_prefill` (``None``: the kernel declined)."""
        tables, lens, starts = self._step_indices(metadata)
        num_decodes, longest_decode, prefill_starts = self._decode_split(metadata, starts)
        first = metadata.query_start_loc_cpu[num_decodes]
        if num_decodes == 0:
            return self._prefill(query, key, value, kv_cache, metadata, 0, tables, lens, prefill_starts, scale,
                                 sliding_window)
        out = torch.empty(query.shape, dtype=query.dtype)   # both parts written into it (the decode rows first)
        rest = self._prefill(query[first:], key[first:], value[first:], kv_cache, metadata, num_decodes,
                             tables[num_decodes:], lens[num_decodes:], prefill_starts, scale, sliding_window,
                             out=out[first:])
        if rest is None:
            return None
        paged_decode(query[:num_decodes], kv_cache, tables, lens, starts, num_decodes, scale, sliding_window,
                     max_seq_len=longest_decode, every_row_owned=True, out=out[:num_decodes])
        return out

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, first_seq: int, tables: torch.Tensor, lens: torch.Tensor,
                 starts: torch.Tensor, scale: float, sliding_window: int | None,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Sequences ``first_seq ..`` of the step, whose query rows start at row 0 of ``query`` (their output written
        into ``out`` ``[T, H, D]``, contiguous rows, when given; returned): bfloat16
        sequences of at least :func:`fused_min_rows` rows through a fused attention (:func:`sdpa_prefill`: the AMX
        kernel, else torch's, whose oneDNN bfloat16 micro-kernels run ~2.4x the native kernel at 500 rows), the
        rest through the native causal kernel in one call. Over an FP8 cache every sequence takes the fused
        attention (the native causal kernel reads 16-bit caches; the caller leaves no windowed prompt)."""
        num_seqs = metadata.num_seqs - first_seq
        q0 = metadata.query_start_loc_cpu[first_seq]
        bounds = [q - q0 for q in metadata.query_start_loc_cpu[first_seq:]]
        seq_lens = metadata.seq_lens_cpu[first_seq:]
        fp8 = kv_cache.dtype == FP8_CACHE_DTYPE
        route = fp8 or (query.dtype == torch.bfloat16 and _sdpa_prefill_on())
        min_rows = fused_min_rows() if route and not fp8 else 0
        fused, others = [], []
        for i in range(num_seqs):
            long_enough = bounds[i + 1] - bounds[i] >= min_rows
            (fused if route and long_enough and (not sliding_window or seq_lens[i] <= sliding_window)
             else others).append(i)
        if not fused:
            rest = paged_prefill(query, kv_cache, tables, lens, starts, num_seqs, scale, sliding_window,
                                 max_seq_len=max(seq_lens, default=0))
            return rest if out is None or rest is None else out.copy_(rest)
        if out is None and not others and len(fused) == 1 and bounds[1] - bounds[0] == query.shape[0]:
            # one prompt: its output as is
            return sdpa_prefill(query, key, value, kv_cache, tables[fused[0]], seq_lens[fused[0]], scale).contiguous()
        # rows past the sequences' (padding) stay zero
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype)
        if bounds[num_seqs] != query.shape[0]:
            out[bounds[num_seqs]:] = 0
        if others:   # the native kernel for the short ones, on their rows gathered in order
            rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in others])
            sub_starts = torch.tensor([0, *itertools.accumulate(bounds[i + 1] - bounds[i] for i in others)],
                                      dtype=torch.int32)
            index = torch.tensor(others)
            sub = paged_prefill(query[rows], kv_cache, tables[index], lens[index], sub_starts, len(others), scale,
                                sliding_window, max_seq_len=max(seq_lens[i] for i in others))
            if sub is None:
                return None
            out[rows] = sub
        for i in fused:
            a, b = bounds[i], bounds[i + 1]
            sdpa_prefill(query[a:b], key[a:b], value[a:b], kv_cache, tables[i], seq_lens[i], scale, out=out[a:b])
        return out

    @staticmethod
    def _decode_split(metadata: AttentionMetadata, starts: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """How many leading sequences compute one token, the longest of them, and the query offsets of the
        others (from 0); once per step."""
        step = metadata.backend_data if isinstance(metadata.backend_data, dict) else {}
        split = step.get("cpu_paged_split")
        if split is None:
            n = metadata.num_leading_decodes   # 0 for every sequence one token, some not sampled: the prefill kernel
            longest = max(metadata.seq_lens_cpu[:n], default=0)
            split = step["cpu_paged_split"] = (n, longest, (starts[n:] - n).contiguous())
        return split

    @staticmethod
    def _step_indices(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's block tables, sequence lengths and query offsets as int32: the same for every layer of
        the step, so converted once (kept in the step's ``backend_data``)."""
        step = metadata.backend_data if isinstance(metadata.backend_data, dict) else {}
        indices = step.get("cpu_paged")
        if indices is None:
            indices = step["cpu_paged"] = (metadata.block_tables.to(torch.int32).contiguous(),
                                           metadata.seq_lens.to(torch.int32).contiguous(),
                                           metadata.query_start_loc.to(torch.int32).contiguous())
        return indices


def paged_decode(
    query: torch.Tensor,            # [T, H, D] float32 or bfloat16
    kv_cache: torch.Tensor,         # [2, num_blocks, block_size, Hkv, D], same dtype (or see _dtype_code)
    block_tables: torch.Tensor,     # [>= B, W] int32
    seq_lens: torch.Tensor,         # [>= B] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [>= B + 1] int32: one query row per sequence
    num_seqs: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,  # the largest of seq_lens[:B] when the caller knows it (saves a reduction)
    every_row_owned: bool = False,   # the caller knows every query row belongs to a sequence (no zeroing)
    out: torch.Tensor | None = None,  # [T, H, D] contiguous rows to write into (with every_row_owned)
) -> torch.Tensor:                  # [T, H, D]; rows not owned by a sequence are zero
    """Attention of each sequence's one query token over its cached keys, read in place.

    The block ids in ``block_tables`` are trusted (the engine's block manager hands them out); the
    lengths are checked against the table's width.

    Raises:
        RuntimeError: the kernel could not be built or loaded (``CpuPagedBackend.supports`` says why).
        ValueError: shapes or dtypes the kernel does not take.
    """
    build = load_kernel()
    if build.library is None:
        raise RuntimeError(f"CPU paged-attention kernel unavailable: {build.reason}")
    fp8 = kv_cache.dtype == FP8_CACHE_DTYPE
    if fp8 and (query.dtype != torch.bfloat16 or query.shape[-1] not in FP8_HEAD_SIZES):
        raise ValueError(f"an FP8 cache is read for bfloat16 queries of head size 64 or 128, not {query.dtype} "
                         f"queries of head size {query.shape[-1]}")
    code = _dtype_code(query, kv_cache)
    if code is None:
        raise ValueError(f"query/kv_cache dtypes {query.dtype}/{kv_cache.dtype}: need one of float32, bfloat16 "
                         f"(or bfloat16 queries over a float8_e4m3fn cache, float32 queries over a bfloat16 one)")
    t, h, d = query.shape
    _, num_blocks, block_size, hkv, d_cache = kv_cache.shape
    if d != d_cache or d > MAX_HEAD_SIZE or h % hkv:
        raise ValueError(f"query [{t}, {h}, {d}] does not fit a cache with {hkv} KV heads of size {d_cache}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    query = query if query.stride(2) == 1 and query.stride(1) == d else query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    longest = int(lens[:num_seqs].max()) if max_seq_len is None and num_seqs else (max_seq_len or 0)
    if (longest > tables.shape[1] * block_size or tables.shape[0] < num_seqs or lens.shape[0] < num_seqs
            or starts.shape[0] <= num_seqs):
        raise ValueError(f"{num_seqs} sequences of up to {longest} tokens do not fit block tables "
                         f"{list(tables.shape)} of {block_size}-token blocks and {starts.shape[0]} query offsets")
    if fp8 and not fp8_decode_available():
        raise RuntimeError("this build of the CPU paged-attention kernel has no FP8 decode (needs AVX512-BF16)")
    if code == F32_BF16_DTYPE_CODE and not f32_bf16_available():
        raise RuntimeError("this build of the CPU paged-attention kernel reads no bfloat16 cache under float32 "
                           "queries (AVX2 builds without AVX512 do)")
    # rows not owned by a sequence (padding) stay zero
    if out is None:
        out = (torch.empty if every_row_owned else torch.zeros)(query.shape, dtype=query.dtype, device=query.device)
    elif not every_row_owned or out.shape != query.shape or out.dtype != query.dtype or out.stride()[1:] != (d, 1):
        raise ValueError(f"out must be a [{t}, {h}, {d}] {query.dtype} tensor of contiguous rows, every row owned")
    build.library.plinth_cpu_paged_decode(
        query.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
        out.data_ptr(), code, num_seqs, h, hkv, d, num_blocks,
        block_size, tables.shape[1],
        query.stride(0), out.stride(0), float(scale), int(sliding_window or 0), torch.get_num_threads())
    return out


def sdpa_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 table: torch.Tensor, seq_len: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's ``L`` query rows ``[L, H, D]`` (its last ``L`` positions) through
    :func:`amx_prefill` where it runs, else ``F.scaled_dot_product_attention``: over this step's keys and values as
    they are when the sequence has no earlier tokens, else over its ``seq_len`` cached ones (this step's written),
    gathered from its blocks, with the causal mask aligned to the last position; from an FP8 cache always the cached
    ones, widened to bfloat16 (:func:`gather_e4m3`). ``[L, H, D]``, written into ``out`` when given."""
    rows, h, d = query.shape
    if kv_cache.dtype == FP8_CACHE_DTYPE:   # this step's rows too, as the cache holds them, widened
        k, v = gather_e4m3(kv_cache, table, seq_len)                        # [S, Hkv, D] each
    elif seq_len == rows:
        k, v = key, value
    else:
        block_size = kv_cache.shape[2]
        blocks = table[: -(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]                     # [S, Hkv, D]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    causal = seq_len == rows
    mask = None if causal else torch.ones(rows, seq_len, dtype=torch.bool).tril(seq_len - rows)
    fast = amx_prefill(query, k, v, scale, out=out)
    if fast is not None:
        return fast
    y = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
                                       scale=scale, enable_gqa=k.shape[1] != h)[0].transpose(0, 1)
    return y if out is None else out.copy_(y)


def gather_e4m3(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of one sequence (its blocks in ``table``) from a contiguous FP8 E4M3
    cache (head sizes 64 and 128), widened to bfloat16 (exactly) by the native kernel: ``[S, Hkv, D]`` each."""
    _, _, block_size, hkv, d = kv_cache.shape
    if table.numel() * block_size < seq_len:
        raise ValueError(f"{seq_len} tokens do not fit a block table of {table.numel()} {block_size}-token blocks")
    if not kv_cache.is_contiguous() or not fp8_decode_available():
        raise RuntimeError("gathering from an FP8 cache needs a contiguous cache and the kernel's AVX512-BF16 build")
    table32 = table.to(torch.int32).contiguous()
    out = torch.empty((2, seq_len, hkv, d), dtype=torch.bfloat16)
    for half in range(2):
        if load_kernel().library.plinth_cpu_gather_e4m3(kv_cache[half].data_ptr(), table32.data_ptr(), seq_len,
                                                        block_size, hkv * d, out[half].data_ptr(),
                                                        torch.get_num_threads()) != 0:
            raise RuntimeError(f"the FP8 gather takes rows of a multiple of 32 values, not {hkv} x {d}")
    return out[0], out[1]


def set_decode_amx(on: bool) -> bool:
    """Run the decode kernel's bfloat16 caches on AMX tiles (``on``, the default unless ``PLINTH_CPU_AMX=0``) or
    on AVX512-BF16 vectors, for this process; returns whether decode now runs on the tiles (``on``, a build with
    AMX-BF16 and the tile state granted by Linux)."""
    build = load_kernel()
    if build.library is None:
        return False
    return build.library.plinth_cpu_paged_set_decode_amx(1 if on else 0) == 1 and on


def decode_amx_heads(num_heads: int, num_kv_heads: int, head_size: int, block_size: int) -> int:
    """How many KV heads :func:`paged_decode` takes per AMX call for a bfloat16 cache of this shape (any batch: AMX
    work items take all of a sequence's KV heads), or 0 where it runs on AVX512-BF16 vectors (no AMX,
    :func:`set_decode_amx` off, fewer than 8 query rows per call, other head or block sizes)."""
    build = load_kernel()
    if build.library is None:
        return 0
    return build.library.plinth_cpu_paged_decode_amx_heads(num_heads, num_kv_heads, head_size, block_size)


@functools.cache
def fp8_decode_available() -> bool:
    """Whether the kernel library reads FP8 E4M3 caches (built with AVX512-BF16)."""
    build = load_kernel()
    return build.library is not None and build.library.plinth_cpu_paged_has_fp8() == 1


def f32_bf16_available() -> bool:
    """Whether the kernel library reads bfloat16 caches under float32 queries (AVX2 builds without AVX512)."""
    build = load_kernel()
    return build.library is not None and build.library.plinth_cpu_paged_has_f32_bf16() == 1


def fused_min_rows() -> int:
    """The fewest query rows of a bfloat16 prefill sequence that :func:`sdpa_prefill` takes: :data:`AMX_MIN_ROWS`
    where the AMX kernel runs, else :data:`SDPA_MIN_ROWS`."""
    return AMX_MIN_ROWS if _amx_prefill_on() else SDPA_MIN_ROWS


def amx_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of ``L`` bfloat16 query rows ``[L, H, D]`` (the last ``L`` of ``S`` positions) over keys and
    values ``[S, Hkv, D]`` on AMX tiles (``plinth_cpu_amx_prefill``: 32 query rows of a head per work item, key
    blocks of 32, an online softmax in float32 with the probabilities rounded to bfloat16) -> ``[L, H, D]`` (written
    into ``out`` when given: bfloat16 rows of contiguous heads, any row stride); ``None``
    where it does not run (no AMX-BF16, ``PLINTH_CPU_AMX=0``, head sizes other than 64 and 128, other dtypes)."""
    rows, h, d = query.shape
    if (any(t.dtype != torch.bfloat16 for t in (query, key, value)) or d not in (64, 128) or key.shape[0] < rows
            or not _amx_prefill_on()):
        return None
    if query.stride(2) != 1 or query.stride(1) != d:
        query = query.contiguous()
    if key.stride(2) != 1 or key.stride(1) != d or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    if out is None:
        out = torch.empty((rows, h, d), dtype=torch.bfloat16)
    elif out.shape != (rows, h, d) or out.dtype != torch.bfloat16 or out.stride()[1:] != (d, 1):
        raise ValueError(f"out must be a [{rows}, {h}, {d}] bfloat16 tensor with contiguous heads")
    rc = load_kernel().library.plinth_cpu_amx_prefill(
        query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(), key.stride(0), out.data_ptr(),
        out.stride(0),
        rows, key.shape[0], h, key.shape[1], d, float(scale), torch.get_num_threads())
    return out if rc == 0 else None


@functools.cache
def _amx_prefill_on() -> bool:
    """The AMX prefill kernel runs here (built with AMX-BF16, the tile state granted) and ``PLINTH_CPU_AMX`` is not
    off: one tiny call answers."""
    from plinth.kernels.cpu_native import amx_switch_on

    build = load_kernel()
    if build.library is None or not amx_switch_on():
        return False
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    return build.library.plinth_cpu_amx_prefill(x.data_ptr(), 64, x.data_ptr(), x.data_ptr(), 64, out.data_ptr(), 64,
                                                1, 1, 1, 1, 64, 1.0, 1) == 0


@functools.cache
def _sdpa_prefill_on() -> bool:
    """``PLINTH_CPU_SDPA_PREFILL``: long bfloat16 prefill sequences through a fused attention (:func:`sdpa_prefill`).
    Default: on where the CPU has AMX tiles (the AMX kernel, or torch's on oneDNN's AMX micro-kernels), off elsewhere
    (see :data:`SDPA_MIN_ROWS`)."""
    from plinth.config import env_flag

    return env_flag(SDPA_PREFILL_ENV, _cpu_has_amx())


@functools.cache
def _cpu_has_amx() -> bool:
    """This CPU has AMX tiles, as torch's probe says (what its oneDNN kernels take)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _prefill_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill` takes these shapes (checked before the cache is written, so that a
    fallback to the batched path writes it once)."""
    return (query.shape[-1] in (64, 128) and kv_cache.shape[2] % 16 == 0 and kv_cache.is_contiguous()
            and query.shape[1] % kv_cache.shape[3] == 0 and _prefill_kernel_ok())


@functools.cache
def _prefill_kernel_ok() -> bool:
    """The library's prefill kernel runs on this CPU (built with AVX512 or AVX2/FMA): one tiny call answers."""
    q = torch.zeros(1, 1, 64)
    cache = torch.zeros(2, 2, 16, 1, 64)
    one = torch.ones(1, dtype=torch.int32)
    return paged_prefill(q, cache, one.view(1, 1), one, torch.tensor([0, 1], dtype=torch.int32), 1, 1.0) is not None


def paged_prefill(
    query: torch.Tensor,            # [T, H, D] float32 or bfloat16
    kv_cache: torch.Tensor,         # [2, num_blocks, block_size, Hkv, D], same dtype (or bfloat16 under float32
                                    # queries, AVX2 builds), this step's K/V written
    block_tables: torch.Tensor,     # [>= B, W] int32
    seq_lens: torch.Tensor,         # [>= B] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [>= B + 1] int32: sequence s owns query rows [start[s], start[s + 1])
    num_seqs: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,  # at least the largest of seq_lens[:B] when the caller knows it (saves a reduction)
) -> torch.Tensor | None:           # [T, H, D]; rows not owned by a sequence are zero
    """Causal attention of every sequence's query rows (the last ``q_len`` positions of its ``seq_len`` cached
    tokens) over its cache, read in place: prefill chunks, with or without cached context, and decode rows, in
    one call. ``None`` where the kernel does not take these shapes (head sizes 64 and 128, block sizes that are
    multiples of 16, AVX512 or AVX2/FMA); the caller then runs its own path.

    Raises:
        ValueError: lengths or query offsets that do not fit the block tables or the query rows."""
    build = load_kernel()
    code = _dtype_code(query, kv_cache)
    if build.library is None or code not in (0, 1, F32_BF16_DTYPE_CODE):
        return None
    t, h, d = query.shape
    _, num_blocks, block_size, hkv, d_cache = kv_cache.shape
    if d != d_cache or h % hkv or not kv_cache.is_contiguous():
        return None
    query = query if query.stride(2) == 1 and query.stride(1) == d else query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    longest = int(lens[:num_seqs].max()) if max_seq_len is None and num_seqs else (max_seq_len or 0)
    if (longest > tables.shape[1] * block_size or tables.shape[0] < num_seqs or lens.shape[0] < num_seqs
            or starts.shape[0] <= num_seqs or (num_seqs and int(starts[num_seqs]) > t)):
        raise ValueError(f"{num_seqs} sequences of up to {longest} tokens do not fit block tables "
                         f"{list(tables.shape)} of {block_size}-token blocks, {starts.shape[0]} query offsets "
                         f"and {t} query rows")
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    rc = build.library.plinth_cpu_paged_prefill(
        query.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
        out.data_ptr(), code, num_seqs, h, hkv, d, num_blocks, block_size, tables.shape[1],
        query.stride(0), out.stride(0), float(scale), int(sliding_window or 0), torch.get_num_threads())
    return out if rc == 0 else None
