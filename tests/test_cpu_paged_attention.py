"""cpu_paged: the native decode kernel against torch_sdpa (float64 and same-dtype), its delegation for
prefill/mixed steps, an end-to-end run with the backend forced, and its "unsupported" answers."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from plinth import LLM, SamplingParams
from plinth.attention_backends import cpu_paged_build
from plinth.attention_backends.cpu_paged import ENABLE_ENV, CpuPagedBackend, paged_decode
from plinth.attention_backends.interface import AttentionSpec
from plinth.attention_backends.probe import PagedBatch, make_paged_batch, max_error, run_steps
from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.errors import SelectionError


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """One build (or load of an earlier build) for the whole file; skipped on a machine with no C++ compiler,
    where the backend declines (its unsupported answers are tested with a simulated missing compiler)."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on this machine: cpu_paged declines here")
    build = cpu_paged_build.load_kernel()
    assert build.library is not None, build.reason
    return build


def spec_of(h=8, hkv=2, d=64, bs=16, dtype=torch.float32, window=None) -> AttentionSpec:
    return AttentionSpec(num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, block_size=bs,
                         sliding_window=window)


def sdpa_reference(batch: PagedBatch, scale: float, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """torch_sdpa on a copy of the batch cast to ``dtype`` (float64: the exact answer)."""
    cast = [t.to(dtype) for t in (batch.query, batch.key, batch.value, batch.kv_cache)]
    return TorchSDPABackend().forward(*cast, batch.metadata, scale=scale, sliding_window=window)


def run_paged(batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    backend = CpuPagedBackend()
    backend.prepare(batch.metadata)
    return backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                           scale=scale, sliding_window=window)


@pytest.fixture(params=["amx", "vec"])
def decode_kernel(request):
    """The bfloat16 decode kernel on AMX tiles (skipped where it cannot run) or on AVX512-BF16 vectors; the
    default back afterwards."""
    from plinth.attention_backends.cpu_paged import set_decode_amx
    from plinth.kernels.cpu_native import amx_switch_on

    on = set_decode_amx(request.param == "amx")
    try:
        if request.param == "amx" and not on:
            pytest.skip("this CPU has no AMX-BF16 (or Linux refuses the tile state)")
        yield request.param
    finally:
        set_decode_amx(amx_switch_on())


# several sequences of different lengths: shorter than a block, exactly a block, partial last blocks, long
DECODE_CONTEXTS = [0, 4, 15, 16, 33, 100, 257]


@pytest.mark.parametrize("heads,d,bs", [
    ((8, 2, ), 64, 16),     # GQA 4
    ((9, 3), 64, 16),       # SmolLM2's shapes
    ((4, 4), 128, 8),       # MHA, head size 128
    ((6, 1), 80, 16),       # MQA, head size with a tail (no compile-time specialisation)
    ((2, 1), 256, 4),       # the largest head size
    ((14, 2), 64, 16),      # GQA 7: the AVX2 kernel's rows in blocks of 3, 2 and 2
    ((10, 2), 128, 16),     # GQA 5: blocks of 3 and 2, head size 128
], ids=["gqa4", "smollm2", "mha-d128", "mqa-d80", "d256", "gqa7", "gqa5-d128"])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_float32_matches_sdpa(heads, d, bs, window):
    spec = spec_of(h=heads[0], hkv=heads[1], d=d, bs=bs, window=window)
    gen = torch.Generator().manual_seed(d + bs + (window or 0))
    batch = make_paged_batch(spec, DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), generator=gen, pad_rows=2,
                             garbage_table_tail=True)
    scale = 1 / math.sqrt(d)
    ref64 = sdpa_reference(batch, scale, window, torch.float64)      # before the cache is written
    ref32 = sdpa_reference(batch, scale, window, torch.float32)
    out = run_paged(batch, scale, window)
    assert out.shape == batch.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out, ref32, rtol=1e-5, atol=5e-6)
    assert torch.count_nonzero(out[len(DECODE_CONTEXTS):]) == 0     # padding rows


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_decode_of_few_sequences_splits_their_blocks(threads, dtype, window, decode_kernel):
    """A sequence's blocks are split into ranges for different threads (a range per two blocks, at most two per
    thread) and the partial softmax states merged. Same answer as the float64 reference for short
    and long contexts, one KV head (MQA) or three, a window that leaves ranges with no visible key, and a
    sequence with no query row in the step. In bfloat16 on AMX tiles (``decode_kernel``), the items take all of a
    sequence's KV heads where there are 8 query rows or more (9 x 3, 8 x 2), however few the sequences."""
    if dtype == torch.float32 and decode_kernel == "amx":
        pytest.skip("float32 caches have one kernel (the vector one)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for heads, contexts in (((9, 3), [700]), ((4, 1), [5, 300]), ((8, 2), [1]), ((9, 3), [64, 33])):
            spec = spec_of(h=heads[0], hkv=heads[1], d=64, bs=16, dtype=dtype, window=window)
            batch = make_paged_batch(spec, contexts, [1] * len(contexts),
                                     generator=torch.Generator().manual_seed(sum(contexts)))
            ref64 = sdpa_reference(batch, 0.125, window, torch.float64)
            out = run_paged(batch, 0.125, window)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=2e-6)
            else:
                err = (out.double() - ref64).abs().max().item()
                ref_err = (sdpa_reference(batch, 0.125, window, torch.bfloat16).double() - ref64).abs().max().item()
                assert err <= max(ref_err, 1e-2), (heads, contexts, err, ref_err)
        # two sequences, the first without a query row this step: the second's row is unchanged
        md = batch.metadata
        starts = torch.tensor([0, 0, 1], dtype=torch.int32)
        only_second = paged_decode(batch.query[1:], batch.kv_cache, md.block_tables, md.seq_lens, starts, 2, 0.125,
                                   window)
        torch.testing.assert_close(only_second.double(), out[1:].double(), rtol=0, atol=0)
        # no sequences: nothing to do (and no division by the item count)
        none = paged_decode(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0, 0.125)
        assert torch.count_nonzero(none) == 0
        # a NaN in one query head: that head's output is NaN however the blocks are split, the others finite
        spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=dtype, window=window)
        batch = make_paged_batch(spec, [700], [1], generator=torch.Generator().manual_seed(7))
        batch.query[0, 0, 5] = float("nan")
        out = run_paged(batch, 0.125, window)
        assert bool(out[0, 0].isnan().all()) and bool(out[0, 1:].isfinite().all())
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_decode_rows_do_not_depend_on_the_batch(threads, dtype, window, decode_kernel):
    """A sequence's decode output is the same, bit for bit, alone and beside others: how its blocks are split
    between threads depends on its own length only (with 8-bit decode inputs a rounding-level change here grew
    into changed greedy tokens)."""
    if dtype == torch.float32 and decode_kernel == "amx":
        pytest.skip("float32 caches have one kernel (the vector one)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        contexts = [3, 40, 130, 333, 700, 64, 17, 250, 90]
        spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=dtype, window=window)
        batch = make_paged_batch(spec, contexts, [1] * len(contexts), generator=torch.Generator().manual_seed(5))
        md = batch.metadata
        together = paged_decode(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                len(contexts), 0.125, window)
        one = torch.tensor([0, 1], dtype=torch.int32)
        for i in range(len(contexts)):
            alone = paged_decode(batch.query[i:i + 1].contiguous(), batch.kv_cache, md.block_tables[i:i + 1],
                                 md.seq_lens[i:i + 1], one, 1, 0.125, window)
            assert torch.equal(alone[0], together[i]), (i, contexts[i])
        for n in (2, 5):   # and in smaller batches
            part = paged_decode(batch.query[:n].contiguous(), batch.kv_cache, md.block_tables[:n], md.seq_lens[:n],
                                md.query_start_loc[:n + 1], n, 0.125, window)
            assert torch.equal(part[:n], together[:n])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("heads,d", [((8, 2), 64), ((9, 3), 64), ((12, 2), 64), ((4, 2), 128)],
                         ids=["gqa4", "smollm2", "gqa6", "d128"])
def test_decode_bfloat16_within_tolerance(heads, d):
    """bfloat16 scores 16 keys at a time (dpbf16 over transposed key pairs), rows four at a time (group 6: a
    partial second set), head sizes 64 and 128."""
    spec = spec_of(h=heads[0], hkv=heads[1], d=d, dtype=torch.bfloat16)
    # 14 sequences: at least 4 per thread on 2-3 threads, so a work item takes all of a sequence's KV heads
    contexts = DECODE_CONTEXTS + [1, 17, 31, 48, 64, 129, 300]
    batch = make_paged_batch(spec, contexts, [1] * len(contexts), generator=torch.Generator().manual_seed(5))
    assert_bfloat16_decode_matches(batch, None)


def assert_bfloat16_decode_matches(batch: PagedBatch, window: int | None) -> None:
    """The bfloat16 decode step against float64 SDPA: float32 accumulation, so no worse than torch_sdpa in bfloat16
    (or 1e-2), and within bfloat16 rounding of it."""
    ref64 = sdpa_reference(batch, 0.125, window, torch.float64)
    ref16 = sdpa_reference(batch, 0.125, window, torch.bfloat16)
    out = run_paged(batch, 0.125, window)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref64).abs().max().item()
    ref_err = (ref16.double() - ref64).abs().max().item()
    assert err <= max(ref_err, 1e-2), (err, ref_err)
    torch.testing.assert_close(out, ref16, rtol=2e-2, atol=2e-2)


def nan_outside_context(batch: PagedBatch) -> None:
    """NaN in every cache slot no sequence has written (the step's new tokens land in theirs when it runs): a
    kernel that reads whole 16-token chunks must not let the slots past a sequence's end reach its output."""
    md = batch.metadata
    bs, flat = batch.kv_cache.shape[2], batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    used = torch.zeros(flat.shape[1], dtype=torch.bool)
    for s in range(md.block_tables.shape[0]):
        pos = torch.arange(int(md.seq_lens[s]))
        used[md.block_tables[s, pos // bs].long() * bs + pos % bs] = True
    flat[:, ~used] = float("nan")


@pytest.mark.parametrize("heads,d,bs", [((9, 3), 64, 16), ((8, 2), 64, 16), ((16, 2), 128, 32), ((32, 8), 64, 16),
                                        ((16, 16), 64, 16), ((12, 1), 128, 16), ((20, 1), 64, 16), ((4, 2), 64, 16)],
                         ids=["smollm2", "gqa4", "gqa8-d128-bs32", "32x8", "mha16", "mqa12-d128", "mqa20", "4x2"])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_bfloat16_kernels_match_float64(heads, d, bs, window, decode_kernel):
    """Both bfloat16 decode kernels against float64 attention, for 14 sequences (a work item takes all of a
    sequence's KV heads): the AMX one takes calls of 8-16 query rows (an item of 32 rows in two calls of 4 KV heads;
    MHA in one of 16; group 20 and items of 4 rows stay on vectors, as the shape query says), reads keys straight
    from the cache 16 tokens at a time (slots past a sequence's end hold NaN), and a NaN in one query head spoils
    that head's output only."""
    from plinth.attention_backends.cpu_paged import decode_amx_heads

    h, hkv = heads
    contexts = DECODE_CONTEXTS + [1, 17, 31, 48, 64, 129, 300]
    per_call = min(hkv, 16 // (h // hkv))
    expected = per_call if decode_kernel == "amx" and h // hkv <= 16 and per_call * (h // hkv) >= 8 else 0
    assert decode_amx_heads(h, hkv, d, bs) == expected
    spec = spec_of(h=h, hkv=hkv, d=d, bs=bs, dtype=torch.bfloat16, window=window)
    batch = make_paged_batch(spec, contexts, [1] * len(contexts), generator=torch.Generator().manual_seed(h + d + bs))
    nan_outside_context(batch)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_bfloat16_decode_matches(batch, window)
        batch.query[3, 1, 7] = float("nan")
        out = run_paged(batch, 0.125, window)
    finally:
        torch.set_num_threads(previous)
    assert bool(out[3, 1].isnan().all())
    finite = torch.ones(out.shape[:2], dtype=torch.bool)
    finite[3, 1] = False
    assert bool(out[finite].isfinite().all())


def test_decode_bfloat16_amx_equals_vectors_within_rounding():
    """The two kernels round the same probabilities to bfloat16 and add in float32 in different orders: on
    SmolLM2's shapes their outputs differ by at most a bfloat16 rounding step of the output."""
    from plinth.attention_backends.cpu_paged import set_decode_amx
    from plinth.kernels.cpu_native import amx_switch_on

    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16)
    contexts = [330] * 16 + [1, 700, 47]
    batch = make_paged_batch(spec, contexts, [1] * len(contexts), generator=torch.Generator().manual_seed(11))
    try:
        if not set_decode_amx(True):
            pytest.skip("this CPU has no AMX-BF16 (or Linux refuses the tile state)")
        amx = run_paged(batch, 0.125, None)
        set_decode_amx(False)
        vec = run_paged(batch, 0.125, None)
    finally:
        set_decode_amx(amx_switch_on())
    step = amx.double().abs().clamp_min(2.0 ** -10) * 2.0 ** -7   # one bfloat16 step (8 significant bits)
    assert bool(((amx.double() - vec.double()).abs() <= step).all())
    assert (amx != vec).float().mean().item() < 0.05


@pytest.mark.parametrize("bs,window", [(16, None), (48, None), (16, 1500)], ids=["bs16", "bs48", "window"])
def test_decode_bfloat16_over_several_key_segments(bs, window, decode_kernel):
    """Long contexts: the bfloat16 path takes an item's keys in segments (128 KiB of key rows: 1,024 tokens of one
    64-feature KV head) and rescales the earlier segments' sums when a later one holds a larger score; keys of
    very different sizes per block make the segments' maxima differ. Blocks of 48 (three 16-key chunks each), a
    window starting inside a block and spanning segments; 10 sequences (a work item takes all KV heads); 8 query
    heads on one KV head, so the AMX kernel takes them too."""
    spec = spec_of(h=8, hkv=1, d=64, bs=bs, dtype=torch.bfloat16, window=window)
    contexts = [2500, 3100, 1, 700, 1024, 1025, 2047, 40, 4000, 3333]
    batch = make_paged_batch(spec, contexts, [1] * len(contexts), generator=torch.Generator().manual_seed(bs))
    sizes = 1 + 6 * torch.rand(batch.kv_cache.shape[1], generator=torch.Generator().manual_seed(1))
    batch.kv_cache[0] *= sizes.to(torch.bfloat16)[:, None, None, None]
    assert_bfloat16_decode_matches(batch, window)


@pytest.mark.parametrize("window", [5, 23])
def test_decode_bfloat16_sliding_window(window):
    """A window that starts inside a block: the bfloat16 path's 16-key chunks begin at the first visible key."""
    spec = spec_of(h=9, hkv=3, dtype=torch.bfloat16, window=window)
    batch = make_paged_batch(spec, DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS),
                             generator=torch.Generator().manual_seed(6))
    assert_bfloat16_decode_matches(batch, window)


def test_cache_writes_match_sdpa():
    """The new keys/values land in the same slots as the reference's, nothing else changes."""
    spec = spec_of(h=4, hkv=2, d=64, bs=8)
    batch = make_paged_batch(spec, [3, 9, 30], [1, 1, 1], generator=torch.Generator().manual_seed(2), pad_rows=1)
    ref_cache = batch.kv_cache.clone()
    TorchSDPABackend().forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, scale=0.1)
    run_paged(batch, 0.1, None)
    assert torch.equal(batch.kv_cache, ref_cache)


def test_non_contiguous_tables_and_a_sequence_without_query():
    """Blocks scattered over the cache in no order; a direct paged_decode call where one sequence has no row."""
    spec = spec_of(h=4, hkv=1, d=64, bs=4)
    batch = make_paged_batch(spec, [10, 6], [1, 1], generator=torch.Generator().manual_seed(4), spare_blocks=0)
    md = batch.metadata
    steps = md.block_tables[0, 1:3].long() - md.block_tables[0, :2].long()
    assert (steps != 1).any()                                   # not laid out one after another
    ref = sdpa_reference(batch, 0.2, None, torch.float64)
    out = run_paged(batch, 0.2, None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)
    # sequence 1 with no query this step: its row (row 1) is left zero, sequence 0 is unchanged
    starts = torch.tensor([0, 1, 1], dtype=torch.int32)
    only_first = paged_decode(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, starts, 2, 0.2)
    torch.testing.assert_close(only_first[0].double(), ref[0], rtol=1e-5, atol=2e-6)
    assert torch.count_nonzero(only_first[1]) == 0


def prefill_kernel_expected() -> bool:
    """Whether this CPU has what the native prefill kernel needs (AVX512F, or AVX2 with FMA; Linux flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


@pytest.mark.parametrize("bs", [1, 8, 16], ids=["bs1-batched", "bs8-batched", "bs16-native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_mixed_steps_through_the_backend(dtype, bs, monkeypatch):
    """probe.run_steps (prefill, mixed, decode from an empty cache the backend writes) against torch_sdpa; with
    16-token blocks every step runs a native kernel where the CPU has the prefill kernel (no batched fallback).
    One-token blocks too: the check's padding rows share the scratch block's one slot (the check refused every
    backend but the reference at that size)."""
    from plinth.attention_backends import cpu_paged
    from plinth.attention_backends.torch_batched import TorchBatchedBackend

    if bs == 16 and cpu_paged._prefill_kernel_ok():
        monkeypatch.setattr(TorchBatchedBackend, "forward",
                            lambda *a, **k: (_ for _ in ()).throw(AssertionError("fell back to torch_batched")))
    spec = spec_of(h=6, hkv=2, d=64, bs=bs, dtype=dtype, window=7)
    reference = run_steps(TorchSDPABackend, spec, torch.device("cpu"))
    err = max_error(CpuPagedBackend, reference, spec, torch.device("cpu"))
    assert err < (1e-5 if dtype == torch.float32 else 5e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_nan_key_reaches_the_rows_that_see_it(dtype):
    """A NaN in one cached key: exactly the query rows that attend to it (causal, within the window) come out NaN,
    as from SDPA; every other row stays finite."""
    from plinth.attention_backends.cpu_paged import paged_prefill

    for window in (None, 9):
        spec = spec_of(h=4, hkv=2, d=64, bs=16, dtype=dtype, window=window)
        batch = make_paged_batch(spec, [0], [40], generator=torch.Generator().manual_seed(3))
        md = batch.metadata
        run_paged(batch, 0.125, window)                        # writes the cache
        block, slot = divmod(20, 16)
        batch.kv_cache[0, int(md.block_tables[0, block]), slot, 1, 7] = float("nan")   # key of position 20, KV head 1
        out = paged_prefill(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, 1, 0.125,
                            window)
        if out is None:
            pytest.skip("no native prefill kernel on this CPU")
        sees = torch.tensor([20 <= p and (window is None or p - 20 < window) for p in range(40)])
        nan = out.isnan().any(-1)                              # [T, H]
        assert torch.equal(nan[:, 2:], sees[:, None].expand(40, 2)), nan   # query heads 2, 3 share KV head 1
        assert not nan[:, :2].any()


def test_prefill_lengths_that_do_not_fit_are_value_errors():
    from plinth.attention_backends.cpu_paged import paged_prefill

    batch = make_paged_batch(spec_of(h=4, hkv=2, d=64, bs=16), [3], [9])
    md = batch.metadata
    with pytest.raises(ValueError, match="do not fit"):
        paged_prefill(batch.query, batch.kv_cache, md.block_tables, md.seq_lens * 100, md.query_start_loc, 1, 0.1)
    with pytest.raises(ValueError, match="do not fit"):
        paged_prefill(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc * 2, 1, 0.1)


def test_bad_inputs_are_value_errors():
    spec = spec_of(h=4, hkv=2, d=64, bs=8)
    batch = make_paged_batch(spec, [3], [1])
    md = batch.metadata
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode(batch.query.double(), batch.kv_cache.double(), md.block_tables, md.seq_lens,
                     md.query_start_loc, 1, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(batch.query[:, :3], batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, 1, 0.1)
    with pytest.raises(ValueError, match="do not fit block tables"):   # longer than the table covers
        paged_decode(batch.query, batch.kv_cache, md.block_tables, md.seq_lens * 100, md.query_start_loc, 1, 0.1)


# ------------------------------------------------------------------------------- support answers


def test_supports():
    assert CpuPagedBackend.supports(spec_of(), "cpu")
    assert CpuPagedBackend.supports(spec_of(dtype=torch.bfloat16, d=256), "cpu")
    for spec, device, words in [
        (spec_of(), "cuda", "CPUs only"),
        (spec_of(dtype=torch.float16), "cpu", "dtype"),
        (spec_of(d=320), "cpu", "head size 320"),
        (spec_of(h=6, hkv=4), "cpu", "multiple"),
    ]:
        answer = CpuPagedBackend.supports(spec, device)
        assert not answer and answer.reason.startswith("unsupported: ") and words in answer.reason


def test_env_switch(monkeypatch):
    monkeypatch.setenv(ENABLE_ENV, "0")
    answer = CpuPagedBackend.supports(spec_of(), "cpu")
    assert not answer and ENABLE_ENV in answer.reason
    monkeypatch.setenv(ENABLE_ENV, "maybe")
    answer = CpuPagedBackend.supports(spec_of(), "cpu")
    assert not answer and "expected 1/0" in answer.reason
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert CpuPagedBackend.supports(spec_of(), "cpu")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty cache directory and a forgotten in-process build; the real one comes back afterwards."""
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    cpu_paged_build.load_kernel.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_paged_build.load_kernel.cache_clear()


def test_missing_compiler_is_unsupported(fresh_build, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    answer = CpuPagedBackend.supports(spec_of(), "cpu")
    assert not answer and answer.reason.startswith("unsupported: no C++ compiler found")
    with pytest.raises(SelectionError, match="cpu_paged.*cannot run here: unsupported: no C\\+\\+ compiler"):
        LLM(str(tiny_llama_dir), dtype="float32", block_size=4, attention_backend="cpu_paged")
    # without forcing it, the engine starts on another backend
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=4, selection="off") as llm:
        assert llm.engine.runner.backend.name != "cpu_paged"


def test_failed_build_is_unsupported(fresh_build, monkeypatch):
    failing = fresh_build / "cxx"
    failing.write_text("#!/bin/sh\necho 'error: this compiler always fails' >&2\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    answer = CpuPagedBackend.supports(spec_of(), "cpu")
    assert not answer and "kernel build failed" in answer.reason and "always fails" in answer.reason
    assert not list((fresh_build / "cache" / "cpu_paged").glob("*.so"))  # no partial library left behind


def test_build_is_reused_by_a_later_process(fresh_build):
    first = cpu_paged_build.load_kernel()
    assert first.library is not None and first.path.parent == fresh_build / "cache" / "cpu_paged"
    cpu_paged_build.load_kernel.cache_clear()   # as a new process would: finds the file, compiles nothing
    second = cpu_paged_build.load_kernel()
    assert second.path == first.path and second.seconds == 0.0 and second.library is not None


# ------------------------------------------------------------------------------------ end to end


PROMPTS = [[5, 17, 99], list(range(20, 61)), list(range(100, 117)), [7] * 9, [1, 2]]


def _generate(model_dir, dtype: str, backend: str, params: SamplingParams):
    with LLM(str(model_dir), dtype=dtype, block_size=4, attention_backend=backend) as llm:
        assert llm.engine.runner.backend.name == backend
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_llm_float32_greedy_tokens_match_torch_sdpa(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in _generate(tiny_llama_dir, "float32", "torch_sdpa", params)]
    got = [o.token_ids for o in _generate(tiny_llama_dir, "float32", "cpu_paged", params)]
    assert got == ref
    assert all(len(t) == 24 for t in got)


#: bfloat16 logits of this random model lie close together; a greedy choice may flip only where the
#: reference's top two log-probabilities are this close (torch_sdpa rounds scores to bfloat16, cpu_paged does not)
BF16_TIE = 0.05


def test_llm_bfloat16_greedy_tokens_match_torch_sdpa_up_to_ties(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    ref = _generate(tiny_llama_dir, "bfloat16", "torch_sdpa", params)
    got = _generate(tiny_llama_dir, "bfloat16", "cpu_paged", params)
    same = 0
    for r, g in zip(ref, got, strict=True):
        if r.token_ids == g.token_ids:
            same += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=True)) if a != b)
        top = r.logprobs[i]
        assert g.token_ids[i] in top, (i, r.token_ids, g.token_ids)
        margin = top[r.token_ids[i]].logprob - top[g.token_ids[i]].logprob
        assert margin <= BF16_TIE, (i, margin)
    assert same >= len(PROMPTS) - 2


def test_timed_against_the_other_cpu_candidates(tmp_path):
    from plinth.config import DeviceConfig
    from plinth.core.selection import AttentionWorkload, select_attention_backend
    from plinth.platforms.cpu.platform import CpuPlatform

    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16)
    workload = AttentionWorkload(prefill_seqs=1, prefill_len=32, decode_seqs=8, decode_context=64)
    pair = ["torch_batched", "cpu_paged"]
    result = select_attention_backend(spec, CpuPlatform(), DeviceConfig(selection="benchmark"), cache_dir=tmp_path,
                                      workload=workload, candidates=pair)
    assert result.winner in pair and result.how == "benchmark"
    report = result.report("cpu_paged")
    assert report.supported and not report.reason and set(report.times_ms) == {"prefill", "decode"}
    assert report.max_error < 5e-2


def test_registered_as_a_candidate():
    from plinth.plugins import get_plugin_manager

    regs = get_plugin_manager().registrations("attention_backends")
    assert "cpu_paged" in regs and regs["cpu_paged"].load() is CpuPagedBackend
    assert os.path.isfile(cpu_paged_build.SOURCE)


@pytest.mark.parametrize("heads,d,bs", [((8, 2), 64, 16), ((9, 3), 64, 32), ((4, 4), 128, 16)],
                         ids=["gqa4", "smollm2-bs32", "mha-d128"])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["interleaved", "decodes-first"])
def test_prefill_kernel_matches_sdpa(heads, d, bs, window, dtype, layout, monkeypatch):
    """The native prefill kernel (prefill chunks with and without cached context, decode rows mixed in,
    a partial last tile, sliding windows) against float64 SDPA; the batched fallback must not run. With
    the decodes first (the scheduler's order) those rows go through the decode kernel."""
    from plinth.attention_backends import cpu_paged
    from plinth.attention_backends.torch_batched import TorchBatchedBackend

    def no_fallback(*args, **kwargs):
        raise AssertionError("the prefill step fell back to torch_batched")

    if prefill_kernel_expected():
        assert cpu_paged._prefill_kernel_ok(), "this CPU has AVX512 or AVX2/FMA: the prefill kernel must run"
    if cpu_paged._prefill_kernel_ok():   # a build for a CPU without AVX2/FMA has none: the fallback is checked
        monkeypatch.setattr(TorchBatchedBackend, "forward", no_fallback)
    spec = spec_of(h=heads[0], hkv=heads[1], d=d, bs=bs, dtype=dtype, window=window)
    if layout == "interleaved":
        contexts, q_lens = [0, 5, 40, 100, 0, 16], [17, 1, 33, 3, 64, 1]
    else:
        contexts, q_lens = [30, 7, 100, 0, 40, 16], [1, 1, 1, 20, 5, 33]
    batch = make_paged_batch(spec, contexts, q_lens, generator=torch.Generator().manual_seed(d + bs))
    assert not batch.metadata.is_decode_only
    scale = 1 / math.sqrt(d)
    ref = sdpa_reference(batch, scale, window, torch.float64)
    got = run_paged(batch, scale, window)
    assert got.dtype == dtype and got.shape == ref.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - ref).abs().max().item() < tol
    if dtype == torch.bfloat16:   # on average no further from float64 than bfloat16 SDPA (P V in bfloat16 pairs)
        ref16 = sdpa_reference(batch, scale, window, torch.bfloat16)
        assert (got.double() - ref).abs().mean() <= 1.25 * (ref16.double() - ref).abs().mean()


def test_prefill_kernel_declines_shapes_it_does_not_take():
    """Head sizes other than 64/128 and block sizes that are not multiples of 16 take the batched path."""
    from plinth.attention_backends.cpu_paged import paged_prefill

    for d, bs in ((80, 16), (64, 8)):
        batch = make_paged_batch(spec_of(h=4, hkv=2, d=d, bs=bs), [3, 0], [5, 9])
        md = batch.metadata
        assert paged_prefill(batch.query, batch.kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                             md.num_seqs, 0.125) is None
        ref = sdpa_reference(batch, 0.125, None, torch.float64)
        torch.testing.assert_close(run_paged(batch, 0.125, None).double(), ref, rtol=1e-5, atol=2e-6)


def test_engine_prompt_scores_with_the_prefill_kernel_equal_sdpa(tmp_path, monkeypatch):
    """A Llama with 64-wide heads (the kernel's shapes), float32: prompt log-probabilities and greedy tokens of
    chunked prefills (a 16-token budget splits the prompts) through cpu_paged equal torch_sdpa's."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=211, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    prompts = [[5, 17, 99, 3, 120, 41, 7, 7, 112, 64, 33, 2, 90, 11, 150, 8, 19, 200, 4], [9, 8, 7], list(range(40, 77))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)

    def run(backend: str):
        with LLM(str(tmp_path), dtype="float32", attention_backend=backend, selection="off", block_size=16,
                 max_num_batched_tokens=16) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        scores = [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs]
        return scores, [o.outputs[0].token_ids for o in outs]

    from plinth.attention_backends import cpu_paged
    from plinth.attention_backends.torch_batched import TorchBatchedBackend

    with monkeypatch.context() as mp:   # every cpu_paged step runs a native kernel (no batched fallback)
        if cpu_paged._prefill_kernel_ok():
            mp.setattr(TorchBatchedBackend, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fallback")))
        paged_scores, paged_tokens = run("cpu_paged")
    sdpa_scores, sdpa_tokens = run("torch_sdpa")
    assert paged_tokens == sdpa_tokens
    for a, b in zip(paged_scores, sdpa_scores, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("cut", [False, True], ids=["no-window", "window"])
def test_bfloat16_prefill_sequences_take_torch_fused_attention(cut, monkeypatch):
    """bfloat16 prefill sequences of at least ``fused_min_rows()`` query rows (fresh prompts, and chunks after cached
    context, whose keys come from the cache) go through ``sdpa_prefill``; shorter ones, decode rows and those a
    sliding window cuts stay on the native kernels, in the same step. Against float64 attention either way, and
    within bfloat16 rounding of the step with the route off (``PLINTH_CPU_SDPA_PREFILL=0``)."""
    from plinth.attention_backends import cpu_paged

    if not cpu_paged._prefill_kernel_ok():
        pytest.skip("no native prefill kernel on this CPU")
    monkeypatch.setenv(cpu_paged.SDPA_PREFILL_ENV, "1")   # the route's default follows AMX (see the next test)
    monkeypatch.setattr(cpu_paged, "_sdpa_prefill_on", cpu_paged._sdpa_prefill_on.__wrapped__)   # read per call
    calls = []
    real = cpu_paged.sdpa_prefill

    def counted(query, *args, **kwargs):
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(cpu_paged, "sdpa_prefill", counted)
    n = cpu_paged.fused_min_rows()   # 128 for torch's attention, 16 with the AMX kernel
    window = n + 82 if cut else None
    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16, window=window)
    contexts, q_lens = [20, 0, 5, 0, 70, 9], [1, 200, n - 1, n, n + 22, 1]
    batch = make_paged_batch(spec, contexts, q_lens, generator=torch.Generator().manual_seed(3))
    scale = 0.125
    ref = sdpa_reference(batch, scale, window, torch.float64)
    got = run_paged(batch, scale, window)
    # 200 fresh rows, n fresh rows, n + 22 rows after 70 cached tokens; with a window of n + 82 the sequences longer
    # than it (n + 92 tokens; 200 where n is 16) run the kernel
    routed = [(200, 200), (n, n), (n + 22, n + 92)]
    assert sorted(calls) == sorted(rows for rows, tokens in routed if window is None or tokens <= window)
    assert (got.double() - ref).abs().max().item() < 2e-2
    monkeypatch.setattr(cpu_paged, "_sdpa_prefill_on", lambda: False)
    calls.clear()
    native = run_paged(batch, scale, window)
    assert calls == []
    assert (native.double() - ref).abs().max().item() < 2e-2
    torch.testing.assert_close(got.double(), native.double(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_fused_prefill_route_defaults_to_cpus_with_amx(amx, monkeypatch):
    """Unset, ``PLINTH_CPU_SDPA_PREFILL`` routes long bfloat16 prompts to the fused attention only on CPUs with AMX
    (without AMX torch's fused attention is ~3x slower than the native kernel); ``1``/``0`` force it either way."""
    from plinth.attention_backends import cpu_paged

    if not cpu_paged._prefill_kernel_ok():
        pytest.skip("no native prefill kernel on this CPU")
    monkeypatch.setattr(cpu_paged, "_cpu_has_amx", lambda: amx)
    monkeypatch.setattr(cpu_paged, "_sdpa_prefill_on", cpu_paged._sdpa_prefill_on.__wrapped__)   # read per call
    calls = []
    real = cpu_paged.sdpa_prefill
    monkeypatch.setattr(cpu_paged, "sdpa_prefill", lambda query, *a, **k: calls.append(query.shape[0]) or real(query, *a, **k))
    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16)
    batch = make_paged_batch(spec, [0], [200], generator=torch.Generator().manual_seed(5))
    ref = sdpa_reference(batch, 0.125, None, torch.float64)
    for env, routed in ((None, amx), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv(cpu_paged.SDPA_PREFILL_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_paged.SDPA_PREFILL_ENV, env)
        calls.clear()
        got = run_paged(batch, 0.125, None)
        assert calls == ([200] if routed else []), env
        assert (got.double() - ref).abs().max().item() < 2e-2


def _causal_reference(query, key, value, scale, dtype):
    rows, keys = query.shape[0], key.shape[0]
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.to(dtype).transpose(0, 1).unsqueeze(0), key.to(dtype).transpose(0, 1).unsqueeze(0),
        value.to(dtype).transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("rows,keys,heads,d", [
    (500, 500, (9, 3), 64), (1, 1, (9, 3), 64), (31, 31, (8, 2), 64), (33, 33, (4, 4), 64), (64, 64, (8, 1), 128),
    (100, 260, (8, 2), 128), (129, 300, (9, 3), 64), (17, 40, (2, 1), 64)],
    ids=["smollm2-500", "one", "31", "33-mha", "64-mqa-d128", "context-d128", "context", "short-context"])
def test_amx_prefill_matches_float64_attention(rows, keys, heads, d):
    """The AMX prefill kernel (32 query rows a work item, key blocks of 32, the causal edge inside a block, partial
    last row and key blocks, query rows after cached context) against float64 attention: no further from it than
    torch's bfloat16 attention, on query/key/value rows that are slices of one wider row (as a QKV projection's)."""
    from plinth.attention_backends import cpu_paged

    if not cpu_paged._amx_prefill_on():
        pytest.skip("this CPU has no AMX-BF16 (or PLINTH_CPU_AMX is off)")
    h, hkv = heads
    gen = torch.Generator().manual_seed(rows + keys + d)
    qkv = torch.randn(keys, (h + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    query = qkv[keys - rows:, : h * d].view(rows, h, d)
    key = qkv[:, h * d: (h + hkv) * d].view(keys, hkv, d)
    value = qkv[:, (h + hkv) * d:].view(keys, hkv, d)
    scale = 1 / math.sqrt(d)
    got = cpu_paged.amx_prefill(query, key, value, scale)
    assert got is not None and got.shape == (rows, h, d) and got.dtype == torch.bfloat16
    assert cpu_paged.amx_prefill(query, key.float(), value, scale) is None    # bfloat16 only
    ref = _causal_reference(query, key, value, scale, torch.float64)
    ref16 = _causal_reference(query, key, value, scale, torch.bfloat16)
    err, err16 = (got.double() - ref).abs(), (ref16.double() - ref).abs()
    assert err.max().item() <= max(err16.max().item(), 1e-2), (err.max().item(), err16.max().item())
    assert err.mean().item() <= 1.25 * err16.mean().item() + 1e-6


def test_long_bfloat16_prefill_runs_on_amx_tiles(monkeypatch):
    """Where the AMX kernel runs, the fused-attention route of long bfloat16 prefill sequences (fresh, and after
    cached context) takes it; without it (``_amx_prefill_on`` false) torch's attention gives the same within
    bfloat16 rounding."""
    from plinth.attention_backends import cpu_paged

    if not cpu_paged._amx_prefill_on() or not cpu_paged._prefill_kernel_ok():
        pytest.skip("this CPU has no AMX-BF16 (or PLINTH_CPU_AMX is off)")
    calls = []
    real = cpu_paged.amx_prefill
    monkeypatch.setattr(cpu_paged, "amx_prefill", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16)
    batch = make_paged_batch(spec, [20, 0, 70], [1, 300, 150], generator=torch.Generator().manual_seed(4))
    ref = sdpa_reference(batch, 0.125, None, torch.float64)
    got = run_paged(batch, 0.125, None)
    assert sorted(calls) == [150, 300]
    assert (got.double() - ref).abs().max().item() < 2e-2
    monkeypatch.setattr(cpu_paged, "_amx_prefill_on", lambda: False)
    calls.clear()
    other = run_paged(batch, 0.125, None)
    assert sorted(calls) == [150, 300]   # asked, declined: torch's attention ran
    torch.testing.assert_close(got.double(), other.double(), atol=2e-2, rtol=0)


def test_kernels_write_into_a_given_output():
    """``paged_decode`` and ``amx_prefill`` write into an ``out`` they are given (a mixed step's decode rows and
    prefill sequences share one output): the same values as their own outputs, nothing else touched; an ``out``
    of the wrong shape or layout is refused."""
    from plinth.attention_backends import cpu_paged

    gen = torch.Generator().manual_seed(11)
    spec = spec_of(h=9, hkv=3, d=64, bs=16, dtype=torch.bfloat16)
    batch = make_paged_batch(spec, [30, 70, 5], [1, 1, 1], generator=gen)
    md = batch.metadata
    args = (batch.query, batch.kv_cache, md.block_tables.to(torch.int32), md.seq_lens.to(torch.int32),
            md.query_start_loc.to(torch.int32), md.num_seqs, 0.125)
    want = cpu_paged.paged_decode(*args, every_row_owned=True)
    big = torch.full((5, 9, 64), 7.0, dtype=torch.bfloat16)
    got = cpu_paged.paged_decode(*args, every_row_owned=True, out=big[1:4])
    assert got.data_ptr() == big[1].data_ptr() and torch.equal(big[1:4], want)
    assert bool((big[0] == 7).all()) and bool((big[4] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        cpu_paged.paged_decode(*args, every_row_owned=True, out=big[:2])
    with pytest.raises(ValueError, match="out must be"):
        cpu_paged.paged_decode(*args, out=big[1:4])   # rows not all owned: the kernel's zeroing is needed
    if not cpu_paged._amx_prefill_on():
        return
    q = torch.randn(40, 9, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(40, 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    want = cpu_paged.amx_prefill(q, k, v, 0.125)
    wide = torch.full((40, 2, 9, 64), 7.0, dtype=torch.bfloat16)   # rows of another stride
    got = cpu_paged.amx_prefill(q, k, v, 0.125, out=wide[:, 1])
    assert torch.equal(got, want) and torch.equal(wide[:, 1], want) and bool((wide[:, 0] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        cpu_paged.amx_prefill(q, k, v, 0.125, out=wide[:, :, 0])
