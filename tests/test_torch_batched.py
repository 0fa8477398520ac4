"""torch_batched against float64 attention computed sequence by sequence from first principles."""

from __future__ import annotations

import math

import pytest
import torch

from plinth.attention_backends.interface import AttentionSpec
from plinth.attention_backends.probe import PagedBatch, make_paged_batch
from plinth.attention_backends.torch_batched import TorchBatchedBackend, _group_sequences


def reference_attention(batch: PagedBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal (optionally windowed) softmax attention in float64, one sequence at a time."""
    md = batch.metadata
    h = batch.query.shape[1]
    out = torch.zeros(md.query_start_loc_cpu[-1], h, batch.query.shape[2], dtype=torch.float64)
    for s in range(md.num_seqs):
        a, b = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        k = batch.seq_keys[s].double()               # [L, Hkv, D]
        v = batch.seq_values[s].double()
        group = h // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        q = batch.query[a:b].double().cpu()           # [n, H, D]
        length = k.shape[0]
        q_pos = torch.arange(length - (b - a), length)[:, None]  # [n, 1]
        k_pos = torch.arange(length)[None, :]                    # [1, L]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale      # [H, n, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[a:b] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out


def run_backend(batch: PagedBatch, scale: float, sliding_window: int | None, layers: int = 2) -> torch.Tensor:
    backend = TorchBatchedBackend()
    backend.prepare(batch.metadata)
    out = None
    for _ in range(layers):  # the per-step plan is shared by every layer
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                              scale=scale, sliding_window=sliding_window)
    return out


def spec_of(h=4, hkv=2, d=16, bs=4, dtype=torch.float32, window=None) -> AttentionSpec:
    return AttentionSpec(num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, block_size=bs,
                         sliding_window=window)


CASES = {
    "prefill": ([0, 0, 0], [7, 1 + 2, 13]),
    "decode": ([5, 17, 1, 30, 8, 8, 2, 11, 40], [1] * 9),
    "mixed": ([9, 0, 3, 20], [1, 6, 1, 5]),
    "prefix_context": ([8, 12], [9, 4]),
}


@pytest.mark.parametrize("ctx,qlen", [(0, 300), (37, 256), (5, 401)])
@pytest.mark.parametrize("window", [None, 90])
def test_long_single_prefill_in_query_chunks(ctx, qlen, window):
    """One sequence's long prefill (chunked by PREFILL_CHUNK queries on a CPU) equals float64 attention."""
    from plinth.attention_backends.torch_batched import PREFILL_CHUNK

    assert qlen >= 2 * PREFILL_CHUNK
    spec = spec_of(h=6, hkv=2, bs=16, window=window)
    batch = make_paged_batch(spec, [ctx], [qlen], generator=torch.Generator().manual_seed(qlen), dtype=torch.float64)
    scale = 1 / math.sqrt(spec.head_size)
    torch.testing.assert_close(run_backend(batch, scale, window), reference_attention(batch, scale, window),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_float64_reference(case, heads, window):
    ctx, qlens = CASES[case]
    spec = spec_of(h=heads[0], hkv=heads[1], window=window)
    gen = torch.Generator().manual_seed(hash((case, heads, window)) % 1000)
    batch = make_paged_batch(spec, ctx, qlens, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(spec.head_size)
    out = run_backend(batch, scale, window)
    ref = reference_attention(batch, scale, window)
    assert out.shape == batch.query.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_low_precision_close_to_float64(dtype, tol):
    spec = spec_of(h=6, hkv=2, d=32, bs=8, dtype=dtype)
    batch = make_paged_batch(spec, [10, 0, 25], [1, 12, 3], generator=torch.Generator().manual_seed(3))
    out = run_backend(batch, 0.2, None)
    assert out.dtype == dtype
    err = (out.double() - reference_attention(batch, 0.2, None)).abs().max().item()
    assert err < tol, err


def test_cache_writes_and_padding_rows():
    """New K/V land at their slots; padding rows write to block 0 only and return zeros."""
    spec = spec_of(bs=4)
    batch = make_paged_batch(spec, [3, 6], [2, 1], pad_rows=3, generator=torch.Generator().manual_seed(1),
                             dtype=torch.float64, garbage_table_tail=True)
    before = batch.kv_cache.clone()
    out = run_backend(batch, 0.25, None)
    md = batch.metadata
    real = md.query_start_loc_cpu[-1]
    slots = md.slot_mapping
    flat = batch.kv_cache.view(2, -1, spec.num_kv_heads, spec.head_size)
    torch.testing.assert_close(flat[0, slots], batch.key)
    torch.testing.assert_close(flat[1, slots], batch.value)
    written = set(slots.tolist())
    untouched = [i for i in range(flat.shape[1]) if i not in written]
    torch.testing.assert_close(flat[:, untouched], before.view_as(flat)[:, untouched])
    assert all(s < spec.block_size for s in slots[real:].tolist())  # padding -> scratch block 0
    assert torch.count_nonzero(out[real:]) == 0
    torch.testing.assert_close(out[:real], reference_attention(batch, 0.25, None), rtol=1e-10, atol=1e-10)


def test_random_block_tables_many_shapes():
    """Random batches: varying lengths, random non-contiguous tables with garbage tails, windows."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(12):
        b = int(torch.randint(1, 7, (1,), generator=gen))
        ctx = torch.randint(0, 30, (b,), generator=gen).tolist()
        q = [int(x) if x > 1 or trial % 2 else 1 for x in torch.randint(1, 12, (b,), generator=gen)]
        window = [None, 1, 4, 64][trial % 4]
        spec = spec_of(h=4, hkv=2, bs=[1, 4, 16][trial % 3], window=window)
        batch = make_paged_batch(spec, ctx, q, generator=gen, dtype=torch.float64, garbage_table_tail=True)
        out = run_backend(batch, 0.3, window, layers=1)
        torch.testing.assert_close(out, reference_attention(batch, 0.3, window), rtol=1e-10, atol=1e-10)


def test_grouping_limits_padding():
    # all decodes form one group; very different prefills are not padded together
    groups = _group_sequences([1, 1, 500, 4, 1, 3], [10, 700, 500, 4, 3, 3])
    assert sorted(groups[0]) == [0, 1, 4]
    assert [2] in groups and [3, 5] in groups and sorted(i for g in groups for i in g) == list(range(6))
    # similar prefills share one call
    assert _group_sequences([64, 60, 62], [64, 60, 62]) == [[0, 2, 1]]


def test_supports():
    assert TorchBatchedBackend.supports(spec_of(), "cpu")
    assert TorchBatchedBackend.supports(spec_of(), "anydevice")
    no = TorchBatchedBackend.supports(spec_of(h=5, hkv=2), "cpu")
    assert not no and "multiple" in no.reason
    assert not TorchBatchedBackend.supports(spec_of(dtype=torch.int8), "cpu")
