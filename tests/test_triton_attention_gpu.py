"""The Triton paged-attention backend on a CUDA GPU: many shapes, bf16, long contexts, graphs.

Skipped without CUDA. Run with ``python -m pytest tests/test_triton_attention_gpu.py``.
The reference is float64 attention over each sequence's full keys/values, in query chunks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: these tests are for compiled kernels", allow_module_level=True)

from attention_batches import Batch  # noqa: E402

from plinth.attention_backends.interface import AttentionMetadata, AttentionSpec  # noqa: E402
from plinth.attention_backends.triton.backend import TritonAttentionBackend  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int,
               dtype: torch.dtype, block_size: int = 16, pad_tokens: int = 0, seed: int = 0,
               extra_table_columns: int = 2) -> Batch:
    """Shuffled blocks, random block ids in the unused table tail, NaN in every unowned slot."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    nblk = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(nblk) + 3
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    width = max(nblk) + extra_table_columns
    tables = torch.randint(0, num_blocks, (len(seqs), width), generator=g, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                          dtype=dtype, device=DEVICE)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    full_k, full_v, keys, values, slots = [], [], [], [], []
    used = 0
    for s, (ctx, _) in enumerate(seqs):
        n = seq_lens[s]
        tables[s, : nblk[s]] = order[used: used + nblk[s]].to(torch.int32)
        used += nblk[s]
        pos = torch.arange(n)
        slot = (tables[s, pos // block_size].long() * block_size + pos % block_size).to(DEVICE)  # [n]
        k = torch.randn(n, num_kv_heads, head_size, device=DEVICE).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, device=DEVICE).to(dtype)
        flat[0, slot[:ctx]] = k[:ctx]
        flat[1, slot[:ctx]] = v[:ctx]
        full_k.append(k)
        full_v.append(v)
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slots.append(slot[ctx:])
    num_real = sum(q for _, q in seqs)
    keys.append(torch.randn(pad_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype))
    values.append(torch.randn(pad_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype))
    slots.append(torch.arange(pad_tokens, device=DEVICE) % block_size)  # padding -> scratch block 0
    query = torch.randn(num_real + pad_tokens, num_heads, head_size, device=DEVICE).to(dtype)
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        num_tokens=num_real + pad_tokens, num_seqs=len(seqs), max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.cat(slots).long(), block_tables=tables.to(DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return Batch(query, torch.cat(keys), torch.cat(values), kv_cache, md, full_k, full_v, num_real)


def reference_attention(batch: Batch, scale: float, sliding_window: int | None, chunk: int = 1024,
                        soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 causal attention per sequence with an explicit softmax (scores soft-capped with ``soft_cap``; head
    ``h``'s denominator also holds ``exp(sinks[h])``). Returns [T_real, H, D]."""
    md = batch.metadata
    h = batch.query.shape[1]
    outs = []
    for s in range(md.num_seqs):
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        n = md.seq_lens_cpu[s]
        group = h // batch.full_k[s].shape[1]
        k = batch.full_k[s].double().repeat_interleave(group, dim=1)   # [n, H, D]
        v = batch.full_v[s].double().repeat_interleave(group, dim=1)
        k_pos = torch.arange(n, device=DEVICE)[None, :]
        for c in range(lo, hi, chunk):
            q = batch.query[c: min(c + chunk, hi)].double()               # [c, H, D]
            q_pos = (n - (hi - lo) + (c - lo) + torch.arange(q.shape[0], device=DEVICE))[:, None]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is None:
                w = torch.softmax(scores, dim=-1)
            else:   # the sink as one more logit per row, dropped after the softmax
                sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
                w = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            outs.append(torch.einsum("hqk,khd->qhd", w, v))
    return torch.cat(outs)


def check(batch: Batch, sliding_window: int | None = None, backend: TritonAttentionBackend | None = None,
          soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    backend = backend or TritonAttentionBackend()
    scale = batch.query.shape[-1] ** -0.5
    backend.prepare(batch.metadata)
    extras = {k: v for k, v in (("soft_cap", soft_cap), ("sinks", sinks)) if v is not None}
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                          scale=scale, sliding_window=sliding_window, **extras)
    got = out[: batch.num_real_tokens].double()
    assert torch.isfinite(got).all()
    tol = TOLERANCE[batch.query.dtype]
    expected = reference_attention(batch, scale, sliding_window, soft_cap=soft_cap, sinks=sinks)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[-2:])
    assert torch.equal(flat[0][batch.metadata.slot_mapping], batch.key)
    assert torch.equal(flat[1][batch.metadata.slot_mapping], batch.value)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256, 80])
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (12, 4), (16, 2), (32, 4)])
def test_mixed_batches(dtype, head_size, heads):
    seqs = [(0, 100), (37, 1), (200, 64), (1, 1), (64, 129), (500, 1)]
    batch = make_batch(seqs, *heads, head_size, dtype, pad_tokens=5, seed=head_size + heads[0])
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (32, 4), (9, 3)])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode(dtype, head_size, heads, splits):
    seqs = [(n, 1) for n in (1, 15, 16, 17, 300, 1000, 2047, 64)]
    batch = make_batch(seqs, *heads, head_size, dtype, pad_tokens=3, seed=splits or 0)
    check(batch, backend=TritonAttentionBackend(decode_splits=splits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_latent_heads(dtype, splits):
    """DeepSeek's multi-head latent attention: 16 and 128 query heads on one KV head of 576 features."""
    for heads in ((16, 1), (128, 1)):
        check(make_batch([(0, 70), (33, 1), (300, 1), (5, 17), (1000, 1)], *heads, 576, dtype, pad_tokens=2,
                         seed=heads[0]), backend=TritonAttentionBackend(decode_splits=splits))
        check(make_batch([(n, 1) for n in (1, 17, 300, 2047)], *heads, 576, dtype, seed=3),
              backend=TritonAttentionBackend(decode_splits=splits))


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("decode", [False, True])
def test_block_sizes(block_size, decode):
    seqs = [(300, 1), (129, 1)] if decode else [(300, 77), (0, 130), (129, 1)]
    batch = make_batch(seqs, 16, 4, 128, torch.bfloat16, block_size=block_size)
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 64])
def test_soft_cap(dtype, window):
    """Gemma 2's attention-logit soft cap (queries scaled up so the cap changes the output), head size 256."""
    for seqs in ([(300, 90), (3, 20), (700, 1)], [(300, 1), (3, 1), (700, 1)]):
        batch = make_batch(seqs, 8, 4, 256, dtype, seed=11)
        batch = dataclasses.replace(batch, query=batch.query * 4)
        scale = 256 ** -0.5
        assert (reference_attention(batch, scale, window, soft_cap=1.0)
                - reference_attention(batch, scale, window)).abs().max() > 0.05
        check(batch, sliding_window=window, soft_cap=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_sinks(dtype, window, splits):
    """gpt-oss's per-head sinks (head size 64, 64 query and 8 KV heads, window 128) in prefill, mixed and decode
    steps, with one and several KV splits."""
    for seqs in ([(300, 90), (3, 20), (700, 1)], [(300, 1), (3, 1), (700, 1), (2000, 1)]):
        batch = make_batch(seqs, 64, 8, 64, dtype, seed=12)
        sinks = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 2 + 2
        scale = 64 ** -0.5
        assert (reference_attention(batch, scale, window, sinks=sinks)
                - reference_attention(batch, scale, window)).abs().max() > 0.05
        check(batch, sliding_window=window, sinks=sinks, backend=TritonAttentionBackend(decode_splits=splits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 64, 1000])
def test_sliding_window(dtype, window):
    check(make_batch([(700, 90), (3, 20), (1200, 1)], 16, 4, 128, dtype, seed=window), sliding_window=window)
    check(make_batch([(700, 1), (3, 1), (1200, 1)], 16, 4, 128, dtype, seed=window), sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_decode_8k(dtype):
    batch = make_batch([(8191, 1), (8000, 1), (4096, 1), (12, 1)], 32, 8, 128, dtype, seed=3,
                       extra_table_columns=64)
    check(batch)


def test_long_prefill_8k_with_prefix():
    batch = make_batch([(4096, 4096), (0, 2048)], 8, 2, 128, torch.bfloat16, seed=4)
    check(batch)


def test_decode_graph_replay_with_new_lengths():
    """One captured decode launch stays right when the lengths and tables change between replays."""
    seqs = [(100, 1), (1900, 1), (300, 1), (2100, 1)]
    batch = make_batch(seqs, 32, 8, 128, torch.bfloat16, seed=5, extra_table_columns=8)
    backend = TritonAttentionBackend()
    md = batch.metadata
    scale = 128 ** -0.5
    backend.prepare(md)
    static_out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, md, scale=scale)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, md, scale=scale)
    for seed, lens in ((6, (120, 40, 31, 1990)), (7, (1, 1500, 7, 2050))):
        other = make_batch([(n, 1) for n in lens], 32, 8, 128, torch.bfloat16, seed=seed, extra_table_columns=0)
        assert other.metadata.block_tables.shape[1] <= md.block_tables.shape[1]
        assert other.kv_cache.shape[1] <= batch.kv_cache.shape[1]
        batch.kv_cache.fill_(float("nan"))
        batch.kv_cache[:, : other.kv_cache.shape[1]].copy_(other.kv_cache)
        for dst, src in ((batch.query, other.query), (batch.key, other.key), (batch.value, other.value),
                         (md.seq_lens, other.metadata.seq_lens), (md.slot_mapping, other.metadata.slot_mapping)):
            dst.copy_(src)
        md.block_tables.zero_()
        md.block_tables[:, : other.metadata.block_tables.shape[1]].copy_(other.metadata.block_tables)
        graph.replay()
        got = static_out.double()
        other.kv_cache = batch.kv_cache
        torch.testing.assert_close(got, reference_attention(other, scale, None), atol=2e-2, rtol=2e-2)


def test_decode_kernels_launched_as_dependents_in_a_graph(monkeypatch):
    """Where the decode steps run weight-prefetching GEMVs, the split and merge kernels are launched as
    programmatic dependents (Hopper) and wait for the kernel before them first: in a graph whose query is
    written by the kernel right before the split kernel, and whose output is read by an RMSNorm (also a
    dependent) right after the merge, every replay equals ordinary eager launches bit for bit, with new
    queries between replays, and matches float64 attention."""
    from plinth.kernels import nvrtc, ops

    monkeypatch.setattr(nvrtc, "prefetching_kernels", nvrtc.dependent_launches)
    batch = make_batch([(100, 1), (1900, 1), (300, 1), (2100, 1)], 32, 8, 128, torch.bfloat16, seed=5)
    hopper = torch.cuda.get_device_capability() >= (9, 0) and nvrtc.dependent_launches(DEVICE)
    assert ops.dependent_options(batch.query) == ({"DEPENDENT": True, "launch_pdl": True} if hopper else {})
    backend = TritonAttentionBackend()
    md, scale = batch.metadata, 128 ** -0.5
    source = batch.query.clone()
    norm_w = torch.rand(128, device=DEVICE).to(torch.bfloat16) + 0.5

    def step():
        torch.mul(source, 2.0, out=batch.query)
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, md, scale=scale)
        return out, ops.rms_norm(out.view(-1, 128), norm_w, 1e-5)

    backend.prepare(md)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, normed = step()
    monkeypatch.setenv("PLINTH_PDL", "0")   # the references below: ordinary launches
    assert ops.dependent_options(batch.query) == {}
    gen = torch.Generator(device=DEVICE)
    for seed in (1, 2, 3):
        source.copy_(torch.randn(source.shape, generator=gen.manual_seed(seed), device=DEVICE))
        graph.replay()
        expect, expect_normed = step()
        torch.cuda.synchronize()
        assert torch.equal(out, expect) and torch.equal(normed, expect_normed), seed
    torch.testing.assert_close(out.double(), reference_attention(batch, scale, None), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_with_rotary_in_the_kernel(dtype, head_size, splits):
    """``rotary=(cos, sin)`` on a decode step: the kernel rotates q and the new keys and writes the cache;
    the same as rotating with ``ops.rotary_`` first and attending (checked against float64 in ``check``)."""
    from plinth.kernels import ops

    seqs = [(n, 1) for n in (0, 15, 16, 300, 2047, 64)]
    batch = make_batch(seqs, 32, 8, head_size, dtype, seed=head_size + (splits or 0))
    angles = torch.rand(batch.query.shape[0], head_size // 2, device=DEVICE) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = dataclasses.replace(batch, query=batch.query.clone(), key=batch.key.clone(),
                                  kv_cache=batch.kv_cache.clone(), full_k=list(batch.full_k))
    ops.rotary_(rotated.query, rotated.key, cos, sin)
    for s in range(len(seqs)):   # each sequence's new key is its last
        rotated.full_k[s] = torch.cat([batch.full_k[s][:-1], rotated.key[s:s + 1]])
    backend = TritonAttentionBackend(decode_splits=splits)
    check(rotated, backend=backend)   # the separate kernels, against float64
    expected_cache = rotated.kv_cache

    md = batch.metadata
    backend.prepare(md)
    query, key = batch.query.clone(), batch.key.clone()
    out = backend.forward(query, key, batch.value, batch.kv_cache, md, scale=head_size ** -0.5, rotary=(cos, sin))
    assert torch.equal(query, batch.query) and torch.equal(key, batch.key)   # inputs left as they were
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference_attention(rotated, head_size ** -0.5, None), atol=tol, rtol=tol)
    # the cache: the rotated keys (within one rounding of the separate kernel's) and the values at the slots,
    # nothing else touched
    flat, flat_expected = (c.view(2, -1, *c.shape[-2:]) for c in (batch.kv_cache, expected_cache))
    slots = md.slot_mapping
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(flat[0][slots], flat_expected[0][slots], atol=4 * eps, rtol=2 * eps)
    assert torch.equal(flat[1][slots], batch.value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched].isnan(), flat_expected[:, untouched].isnan())
    assert torch.equal(flat[:, untouched].nan_to_num(), flat_expected[:, untouched].nan_to_num())


def test_supports_on_cuda():
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=16)
    assert TritonAttentionBackend.supports(spec, "cuda")
