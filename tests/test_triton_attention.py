"""The Triton paged-attention backend against a float64 reference, in Triton's CPU interpreter.

The interpreter is chosen when the kernels are decorated, so the kernel modules are imported
with ``TRITON_INTERPRET=1`` set; every test sets it again (with ``PLINTH_TRITON_INTERPRET``)
for its own duration only, so other test modules see an unchanged environment. float32 and
float16 are exact in the interpreter; bfloat16 is not, and is covered by the GPU tests.
On a machine with CUDA this module is skipped (tests/test_triton_attention_gpu.py runs there)
unless ``PLINTH_TRITON_INTERPRET=1`` is set.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("PLINTH_TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the GPU test file covers the kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from attention_batches import Batch, make_batch, reference_attention  # noqa: E402
from triton_interpreter import (  # noqa: E402
    import_interpreted,
    interpreter_usable,  # noqa: F401 (read by the skip conditions)
    needs,
    run_in_fresh_process,
    set_interpreter_env,
)

from plinth.attention_backends.interface import (  # noqa: E402
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    chunked_attention_view,
)
from plinth.attention_backends.triton import backend as triton_backend  # noqa: E402
from plinth.attention_backends.triton import tiles  # noqa: E402
from plinth.attention_backends.triton.backend import TritonAttentionBackend  # noqa: E402

INTERPRETED = import_interpreted(lambda: triton_backend._load_kernels().prefill._prefill_kernel)
needs_interpreter = needs(INTERPRETED)


def test_in_a_fresh_process():
    run_in_fresh_process(__file__, INTERPRETED)


TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    set_interpreter_env(monkeypatch)


def _extras(soft_cap: float | None, sinks: torch.Tensor | None) -> dict:
    """The optional per-layer keywords of ``forward``, only where set."""
    return {k: v for k, v in (("soft_cap", soft_cap), ("sinks", sinks)) if v is not None}


def run_and_check(batch: Batch, sliding_window: int | None = None, backend: AttentionBackend | None = None,
                  soft_cap: float | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None):
    """``chunk``: the step through :func:`chunked_attention_view` (chunked local attention)."""
    backend = backend or TritonAttentionBackend()
    head_size = batch.query.shape[-1]
    scale = head_size**-0.5
    backend.prepare(batch.metadata)
    md = batch.metadata
    if chunk is not None:
        md = chunked_attention_view(md, chunk, batch.kv_cache.shape[2], backend)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, md,
                          scale=scale, sliding_window=sliding_window, **_extras(soft_cap, sinks))
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    expected = reference_attention(batch, scale, sliding_window, soft_cap, sinks, chunk)
    got = out[: batch.num_real_tokens].double()
    assert torch.isfinite(got).all()
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # every new key/value is in the cache at its slot (padding rows in block 0)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[-2:])
    torch.testing.assert_close(flat[0][batch.metadata.slot_mapping], batch.key, atol=0, rtol=0)
    torch.testing.assert_close(flat[1][batch.metadata.slot_mapping], batch.value, atol=0, rtol=0)
    return out


@needs_interpreter
@pytest.mark.parametrize("seqs", [[(50, 1), (31, 1), (6, 1), (32, 1)], [(40, 1), (0, 37), (17, 20), (20, 12)]],
                         ids=["decode", "mixed"])
def test_chunked_attention_view(seqs):
    """Chunked local attention through the view (each sequence's queries cut at 16-position chunk boundaries, block
    tables shifted to their chunk): decodes at and past a boundary, prompts and continuations crossing one or two."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=8,
                       pad_tokens=2, seed=5)
    run_and_check(batch, chunk=16)


@needs_interpreter
def test_prefill_only_fp32():
    batch = make_batch([(0, 37), (0, 20)], num_heads=2, num_kv_heads=2, head_size=64, dtype=torch.float32)
    run_and_check(batch)


@needs_interpreter
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_only_split_kv_gqa(splits):
    batch = make_batch([(50, 1), (130, 1), (6, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                       dtype=torch.float16, pad_tokens=2, seed=1)
    assert batch.metadata.is_decode_only
    run_and_check(batch, backend=TritonAttentionBackend(decode_splits=splits))


@needs_interpreter
def test_decode_default_splits_use_the_split_path():
    backend = TritonAttentionBackend()
    batch = make_batch([(40, 1), (20, 1)], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=2)
    backend.prepare(batch.metadata)
    plan = batch.metadata.backend_data
    assert plan.decode_only and plan.max_blocks_per_seq == batch.metadata.block_tables.shape[1]
    block_n = tiles.decode_tiles(64, 4, torch.float32, True).block_n
    assert tiles.decode_splits(2, 1, plan.max_blocks_per_seq * 16, block_n, plan.num_sms) > 1
    run_and_check(batch, backend=backend)


@needs_interpreter
def test_mixed_prefill_and_decode_head_128():
    batch = make_batch([(40, 1), (0, 33), (17, 1), (20, 12)], num_heads=4, num_kv_heads=2, head_size=128,
                       dtype=torch.float16, pad_tokens=3, seed=3)
    assert not batch.metadata.is_decode_only
    run_and_check(batch)


@needs_interpreter
def test_prefix_cached_context_and_new_chunk_gqa8():
    batch = make_batch([(48, 25), (32, 5)], num_heads=8, num_kv_heads=1, head_size=64, dtype=torch.float32,
                       seed=4)
    run_and_check(batch)


@needs_interpreter
@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_smaller_and_larger_than_the_key_tile(block_size):
    batch = make_batch([(21, 19), (0, 1), (40, 1)], num_heads=3, num_kv_heads=1, head_size=64,
                       dtype=torch.float32, block_size=block_size, seed=5)
    run_and_check(batch)


@needs_interpreter
def test_sliding_window_mixed():
    batch = make_batch([(30, 20), (45, 1), (0, 9)], num_heads=4, num_kv_heads=2, head_size=64,
                       dtype=torch.float16, seed=6)
    run_and_check(batch, sliding_window=13)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 4])
def test_sliding_window_decode(splits):
    batch = make_batch([(70, 1), (9, 1)], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32,
                       seed=7)
    run_and_check(batch, sliding_window=24, backend=TritonAttentionBackend(decode_splits=splits))


def _capped_batch(seqs, seed: int, dtype=torch.float32, pad_tokens: int = 2) -> Batch:
    """A batch whose scores reach well past the cap used below (queries scaled up), so capping changes the
    output far beyond the tolerance."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype, seed=seed, pad_tokens=pad_tokens)
    batch = dataclasses.replace(batch, query=batch.query * 3)
    uncapped = reference_attention(batch, 64**-0.5, None)
    assert (reference_attention(batch, 64**-0.5, None, soft_cap=1.5) - uncapped).abs().max() > 0.1
    return batch


@needs_interpreter
@pytest.mark.parametrize("window", [None, 13])
def test_soft_cap_prefill_and_mixed(window):
    run_and_check(_capped_batch([(30, 20), (45, 1), (0, 9)], seed=21), sliding_window=window, soft_cap=1.5)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_soft_cap_decode(splits, monkeypatch):
    batch = _capped_batch([(70, 1), (9, 1), (33, 1)], seed=22, dtype=torch.float16)
    run_and_check(batch, soft_cap=1.5, backend=TritonAttentionBackend(decode_splits=splits))
    run_rotary_and_check(_capped_batch([(50, 1), (20, 1)], seed=23, pad_tokens=0), fused=True, monkeypatch=monkeypatch,
                         soft_cap=1.5, backend=TritonAttentionBackend(decode_splits=splits))


@pytest.mark.parametrize("backend_name", ["torch_sdpa", "torch_batched"])
def test_soft_cap_torch_backends(backend_name, monkeypatch):
    """torch_sdpa and torch_batched apply the cap (against the same float64 reference) on every path: mixed steps,
    decode batches on the matmul path, a long prefill in chunks, and the compiled decode step's static attention."""
    from plinth.attention_backends import torch_batched
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend
    from plinth.worker.cpu_decode_attention import StaticDecode

    def batch_of(seqs, seed: int, pad_tokens: int = 2) -> Batch:
        # these backends multiply masked-out keys' values by zero weights: unowned slots hold large finite values
        # (a stale cache) instead of NaN, which still spoil any read outside a sequence's own slots
        batch = _capped_batch(seqs, seed, pad_tokens=pad_tokens)
        garbage = torch.randn(batch.kv_cache.shape, generator=torch.Generator().manual_seed(seed)) * 100
        batch.kv_cache.copy_(torch.where(batch.kv_cache.isnan(), garbage, batch.kv_cache))
        return batch

    cls = {"torch_sdpa": TorchSDPABackend, "torch_batched": TorchBatchedBackend}[backend_name]
    run_and_check(batch_of([(30, 20), (45, 1), (0, 9)], seed=24), sliding_window=13, soft_cap=1.5, backend=cls())
    monkeypatch.setattr(torch_batched, "MATMUL_DECODE_MIN_SEQS", 2)
    monkeypatch.setattr(torch_batched, "PREFILL_CHUNK", 8)
    run_and_check(batch_of([(40, 1), (17, 1), (9, 1)], seed=25), soft_cap=1.5, backend=cls())
    run_and_check(batch_of([(5, 40)], seed=26, pad_tokens=0), sliding_window=21, soft_cap=1.5, backend=cls())
    if cls is TorchBatchedBackend:   # a compiled CPU decode step hands the backend a StaticDecode
        batch = batch_of([(40, 1), (17, 1)], seed=27, pad_tokens=0)
        md = batch.metadata
        static = StaticDecode(block_tables=md.block_tables.long(), seq_lens=md.seq_lens.long())
        md = dataclasses.replace(md, backend_data=static)
        out = cls().forward(batch.query, batch.key, batch.value, batch.kv_cache, md, scale=64**-0.5, soft_cap=1.5)
        expected = reference_attention(batch, 64**-0.5, None, soft_cap=1.5)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_soft_cap_refusals():
    """Backends without the cap refuse such models (a subclass does not inherit its parent's answer), and so
    does an attention layer built on one."""
    from plinth.attention_backends.cpu_paged import CpuPagedBackend
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend
    from plinth.model_registry.layers.attention import Attention

    spec = _spec(logit_soft_cap=50.0)
    assert TorchSDPABackend.check(spec, "cpu") and TorchBatchedBackend.check(spec, "cpu")
    answer = CpuPagedBackend.check(spec, "cpu")
    assert not answer and "soft-capping" in answer.reason
    with pytest.raises(ValueError, match="soft cap"):
        Attention(4, 64, 0.125, 2, CpuPagedBackend(), soft_cap=50.0)


def _sinks(batch: Batch, seed: int) -> torch.Tensor:
    """Sink logits for every head that move the output far beyond the tolerance (some heads' sinks take most of
    the weight, others little)."""
    num_heads = batch.query.shape[1]
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1
    plain = reference_attention(batch, batch.query.shape[-1] ** -0.5, None)
    assert (reference_attention(batch, batch.query.shape[-1] ** -0.5, None, sinks=sinks) - plain).abs().max() > 0.1
    return sinks


@needs_interpreter
@pytest.mark.parametrize("window", [None, 13])
def test_sinks_prefill_and_mixed(window):
    batch = make_batch([(30, 20), (45, 1), (0, 9)], num_heads=4, num_kv_heads=2, head_size=64,
                       dtype=torch.float32, seed=31)
    run_and_check(batch, sliding_window=window, sinks=_sinks(batch, 31))
    capped = _capped_batch([(12, 30), (0, 1)], seed=32)   # with the soft cap too
    run_and_check(capped, soft_cap=1.5, sinks=_sinks(capped, 32))


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_decode(splits, monkeypatch):
    """The first of several KV ranges holds the sink: a split with no keys (a short sequence) still counts it."""
    batch = make_batch([(70, 1), (9, 1), (33, 1)], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16,
                       seed=33, pad_tokens=2)
    run_and_check(batch, sinks=_sinks(batch, 33), backend=TritonAttentionBackend(decode_splits=splits))
    window = make_batch([(70, 1), (2, 1)], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=34)
    run_and_check(window, sliding_window=24, sinks=_sinks(window, 34), backend=TritonAttentionBackend(decode_splits=splits))
    rotary = make_batch([(50, 1), (20, 1)], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=35,
                        pad_tokens=0)
    run_rotary_and_check(rotary, fused=True, monkeypatch=monkeypatch, sinks=_sinks(rotary, 35),
                         backend=TritonAttentionBackend(decode_splits=splits))


@pytest.mark.parametrize("backend_name", ["torch_sdpa", "torch_batched"])
def test_sinks_torch_backends(backend_name, monkeypatch):
    """torch_sdpa and torch_batched count the sinks (against the float64 reference) on every path: mixed steps,
    decode batches on the matmul path (few and many KV heads), a long prefill in chunks, and the compiled decode
    step's static attention."""
    from plinth.attention_backends import torch_batched
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend
    from plinth.worker.cpu_decode_attention import StaticDecode

    def batch_of(seqs, seed: int, pad_tokens: int = 2, num_kv_heads: int = 2) -> tuple[Batch, torch.Tensor]:
        batch = make_batch(seqs, num_heads=8, num_kv_heads=num_kv_heads, head_size=64, dtype=torch.float32,
                           seed=seed, pad_tokens=pad_tokens)
        garbage = torch.randn(batch.kv_cache.shape, generator=torch.Generator().manual_seed(seed)) * 100
        batch.kv_cache.copy_(torch.where(batch.kv_cache.isnan(), garbage, batch.kv_cache))
        return batch, _sinks(batch, seed)

    cls = {"torch_sdpa": TorchSDPABackend, "torch_batched": TorchBatchedBackend}[backend_name]
    batch, sinks = batch_of([(30, 20), (45, 1), (0, 9)], seed=36)
    run_and_check(batch, sliding_window=13, sinks=sinks, backend=cls())
    monkeypatch.setattr(torch_batched, "MATMUL_DECODE_MIN_SEQS", 2)
    monkeypatch.setattr(torch_batched, "PREFILL_CHUNK", 8)
    for kv_heads in (2, 8):   # the batched matmul over all KV heads, then one matmul per KV head
        batch, sinks = batch_of([(40, 1), (17, 1), (9, 1)], seed=37, num_kv_heads=kv_heads)
        run_and_check(batch, sinks=sinks, backend=cls())
    batch, sinks = batch_of([(5, 40)], seed=38, pad_tokens=0)
    run_and_check(batch, sliding_window=21, sinks=sinks, backend=cls())
    if cls is TorchBatchedBackend:   # a compiled CPU decode step hands the backend a StaticDecode
        batch, sinks = batch_of([(40, 1), (17, 1)], seed=39, pad_tokens=0)
        md = batch.metadata
        static = StaticDecode(block_tables=md.block_tables.long(), seq_lens=md.seq_lens.long())
        md = dataclasses.replace(md, backend_data=static)
        out = cls().forward(batch.query, batch.key, batch.value, batch.kv_cache, md, scale=64**-0.5, sinks=sinks)
        expected = reference_attention(batch, 64**-0.5, None, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_sinks_refusals():
    """Backends without sinks refuse such models (a subclass does not inherit the answer), and so does an
    attention layer built on one; a layer built with sinks refuses a call without them."""
    from plinth.attention_backends.cpu_paged import CpuPagedBackend
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend
    from plinth.model_registry.layers.attention import Attention

    spec = _spec(sinks=True)
    assert TorchSDPABackend.check(spec, "cpu") and TorchBatchedBackend.check(spec, "cpu")

    class Sub(TorchSDPABackend):
        name = "sub"

    for cls in (CpuPagedBackend, Sub):
        answer = cls.check(spec, "cpu")
        assert not answer and "sinks" in answer.reason
    with pytest.raises(ValueError, match="sinks"):
        Attention(4, 64, 0.125, 2, CpuPagedBackend(), has_sinks=True)
    layer = Attention(4, 64, 0.125, 2, TorchSDPABackend(), has_sinks=True)
    layer.kv_cache = torch.zeros(2, 2, 16, 2, 64)
    batch = make_batch([(0, 3)], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, pad_tokens=0)
    with pytest.raises(ValueError, match="sinks missing"):
        layer(batch.query, batch.key, batch.value, batch.metadata)


@needs_interpreter
def test_head_size_256_tiny():
    batch = make_batch([(5, 6), (9, 1)], num_heads=2, num_kv_heads=1, head_size=256, dtype=torch.float16, seed=8)
    run_and_check(batch)


@needs_interpreter
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_size", [
    (2, 2, 80),     # padded to 128
    (16, 1, 576),   # multi-head latent attention: 16 query heads on one 576-wide KV head (padded to 1024)
    (48, 1, 288),   # 48 query heads on one wide KV head: seen as three (stride 0), 16 query heads each
])
def test_padded_head_sizes(decode, heads, kv_heads, head_size):
    seqs = [(12, 1), (30, 1)] if decode else [(12, 9), (0, 4)]
    batch = make_batch(seqs, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.float32,
                       seed=head_size)
    run_and_check(batch, backend=TritonAttentionBackend(decode_splits=2 if decode else None))


def test_latent_head_chunks():
    """How many 16-head programs the query heads of one KV head wider than 256 take."""
    from plinth.attention_backends.triton.tiles import latent_head_chunks

    assert latent_head_chunks(48, 1, 288) == 3 and latent_head_chunks(128, 1, 576) == 8
    assert latent_head_chunks(48, 1, 256) == latent_head_chunks(48, 2, 288) == latent_head_chunks(16, 1, 576) == 1
    assert latent_head_chunks(40, 1, 576) == 4   # a split that divides the heads: 4 x 10


@needs_interpreter
@pytest.mark.parametrize("decode", [False, True])
def test_one_tensor_as_keys_and_values(decode):
    """A layer whose values are its keys on a cache stored once (``shares_kv_cache``: ``kv_cache[1]`` the same
    memory as ``kv_cache[0]``, a stride-0 first dimension), latent-sized: attention and the writes are right."""
    assert TritonAttentionBackend.shares_kv_cache
    seqs = [(9, 1), (20, 1)] if decode else [(7, 5), (0, 3)]
    batch = make_batch(seqs, num_heads=16, num_kv_heads=1, head_size=48, dtype=torch.float32, seed=13)
    shared = dataclasses.replace(batch, value=batch.key, full_v=batch.full_k,
                                 kv_cache=batch.kv_cache[:1].expand(batch.kv_cache.shape))
    assert shared.kv_cache.stride(0) == 0 and shared.kv_cache[1].data_ptr() == shared.kv_cache[0].data_ptr()
    run_and_check(shared, backend=TritonAttentionBackend(decode_splits=2 if decode else None))


@needs_interpreter
def test_strided_query_views_from_a_fused_qkv():
    batch = make_batch([(10, 7), (3, 1)], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32,
                       seed=10)
    t, h, d = batch.query.shape
    kvh = batch.key.shape[1]
    qkv = torch.cat([batch.query.reshape(t, -1), batch.key.reshape(t, -1), batch.value.reshape(t, -1)], dim=1)
    batch.query = qkv[:, : h * d].view(t, h, d)
    batch.key = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    batch.value = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    assert batch.query.stride(0) == qkv.shape[1]
    run_and_check(batch)


def rotary_tables(batch: Batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rotate-half angles per token: ``cos``/``sin`` ``[T, D]`` (both halves the same)."""
    t, _, d = batch.query.shape
    angles = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(batch.query.dtype), angles.sin().to(batch.query.dtype)


def rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, H, D]`` in float64."""
    half = x.shape[-1] // 2
    x = x.double()
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.double()[:, None, :] + rotated * sin.double()[:, None, :]


def run_rotary_and_check(batch: Batch, *, fused: bool, monkeypatch, sliding_window: int | None = None,
                         backend: TritonAttentionBackend | None = None, soft_cap: float | None = None,
                         sinks: torch.Tensor | None = None) -> None:
    """``forward(rotary=...)`` on un-rotated q/k against the float64 reference on rotated ones; ``fused``:
    whether the decode kernel should have written the cache itself (no separate cache-write launch)."""
    backend = backend or TritonAttentionBackend()
    cos, sin = rotary_tables(batch, seed=batch.query.shape[0])
    md = batch.metadata
    q_rot, k_rot = rotate64(batch.query, cos, sin), rotate64(batch.key, cos, sin)
    rotated = dataclasses.replace(batch, query=q_rot.to(batch.query.dtype), full_k=list(batch.full_k))
    for s in range(md.num_seqs):   # the new keys of each sequence are its last rows
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        rotated.full_k[s] = torch.cat([batch.full_k[s][: md.seq_lens_cpu[s] - (hi - lo)], k_rot[lo:hi].to(batch.key.dtype)])
    kernels = triton_backend._load_kernels()
    writes = []
    real_write = kernels.write_kv_cache.write_kv_cache_triton
    monkeypatch.setattr(kernels.write_kv_cache, "write_kv_cache_triton",
                        lambda *a: (writes.append(1), real_write(*a))[1])
    head_size = batch.query.shape[-1]
    backend.prepare(md)
    query, key = batch.query.clone(), batch.key.clone()
    out = backend.forward(query, key, batch.value, batch.kv_cache, md, scale=head_size**-0.5,
                          sliding_window=sliding_window, rotary=(cos, sin), **_extras(soft_cap, sinks))
    assert (not writes) == fused
    if fused:   # the inputs are left as they were
        assert torch.equal(query, batch.query) and torch.equal(key, batch.key)
    expected = reference_attention(rotated, head_size**-0.5, sliding_window, soft_cap, sinks)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out[: batch.num_real_tokens].double(), expected, atol=tol, rtol=tol)
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[-2:])
    n = md.slot_mapping.shape[0]
    torch.testing.assert_close(flat[0][md.slot_mapping].double(), k_rot[:n], atol=tol, rtol=tol)
    torch.testing.assert_close(flat[1][md.slot_mapping], batch.value[:n], atol=0, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_kernel_applies_rotary_and_writes_the_cache(splits, monkeypatch):
    batch = make_batch([(50, 1), (130, 1), (6, 1), (0, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                       dtype=torch.float16, seed=11)
    run_rotary_and_check(batch, fused=True, monkeypatch=monkeypatch, backend=TritonAttentionBackend(decode_splits=splits))


@needs_interpreter
@pytest.mark.parametrize("head_size", [80, 128])
def test_decode_rotary_other_head_sizes_and_sliding_window(head_size, monkeypatch):
    batch = make_batch([(70, 1), (9, 1), (64, 1)], num_heads=4, num_kv_heads=1, head_size=head_size,
                       dtype=torch.float32, seed=12)
    run_rotary_and_check(batch, fused=True, monkeypatch=monkeypatch, sliding_window=24,
                         backend=TritonAttentionBackend(decode_splits=4))


@needs_interpreter
def test_rotary_before_the_kernels_for_prefill_and_padded_decode(monkeypatch):
    mixed = make_batch([(40, 1), (0, 33), (17, 5)], num_heads=4, num_kv_heads=2, head_size=64,
                       dtype=torch.float16, seed=13)
    run_rotary_and_check(mixed, fused=False, monkeypatch=monkeypatch)
    # decode rows beyond the sequences (padding): the separate write covers them
    padded = make_batch([(21, 1), (5, 1)], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32,
                        pad_tokens=2, seed=14)
    run_rotary_and_check(padded, fused=False, monkeypatch=monkeypatch)


@needs_interpreter
def test_rejects_bad_sliding_window():
    batch = make_batch([(0, 3)], num_heads=2, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                                         scale=0.1, sliding_window=0)


def _spec(**kw) -> AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.float16, block_size=16)
    base.update(kw)
    return AttentionSpec(**base)


def test_supports(monkeypatch):
    cls = TritonAttentionBackend
    assert cls.supports(_spec(), "cpu")  # interpreter env set by the fixture
    assert cls.supports(_spec(dtype=torch.float32, head_size=64), "cpu")
    assert not cls.supports(_spec(dtype=torch.bfloat16), "cpu")
    for device in ("cuda", "xpu"):
        for head_size in (64, 128, 256, 80):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                assert cls.supports(_spec(head_size=head_size, dtype=dtype), device)
    assert "head size 72" in cls.supports(_spec(head_size=72), "cuda").reason
    assert cls.supports(_spec(num_heads=16, num_kv_heads=1, head_size=576), "cuda")   # DeepSeek's latent head
    assert not cls.supports(_spec(head_size=592), "cuda")
    assert not cls.supports(_spec(dtype=torch.float64), "cuda")
    assert not cls.supports(_spec(num_heads=6, num_kv_heads=4), "cuda")
    assert not cls.supports(_spec(), "mps")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("PLINTH_TRITON_INTERPRET")
    answer = cls.supports(_spec(), "cpu")
    assert not answer and "PLINTH_TRITON_INTERPRET=1" in answer.reason
    assert cls.name == "triton" and cls.priority > 0


def test_supports_without_triton(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    answer = TritonAttentionBackend.supports(_spec(), "cuda")
    assert not answer and answer.reason == "triton not installed"


def test_flash_attn_backend_says_no_without_the_package():
    from plinth.attention_backends.flash_attn import FlashAttnBackend

    try:
        import flash_attn  # noqa: F401
    except ImportError:
        answer = FlashAttnBackend.supports(_spec(), "cuda")
        assert not answer and answer.reason == "flash_attn not installed"
    assert not FlashAttnBackend.supports(_spec(), "cpu")


@needs_interpreter
def test_decode_rows_of_one_sequence_see_each_others_keys(monkeypatch):
    """Speculative decoding's decode rows: a sequence's token and drafts as one-token rows at consecutive positions
    (``rows_share_sequences``): the keys are rotated and written before any row attends (no fused decode kernel),
    so each row sees the rows before it, as the same tokens do as one multi-token query."""
    batch = make_batch([(40, 4), (9, 3)], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=15)
    md = batch.metadata
    cos, sin = rotary_tables(batch, seed=3)
    q_rot, k_rot = rotate64(batch.query, cos, sin), rotate64(batch.key, cos, sin)
    full_k = []
    for s in range(md.num_seqs):
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        full_k.append(torch.cat([batch.full_k[s][: md.seq_lens_cpu[s] - (hi - lo)], k_rot[lo:hi].float()]))
    expected = reference_attention(dataclasses.replace(batch, query=q_rot.float(), full_k=full_k), 64**-0.5, None)
    seq_of_row, lens = [], []
    for s in range(md.num_seqs):
        q_len = md.query_start_loc_cpu[s + 1] - md.query_start_loc_cpu[s]
        for j in range(q_len):
            seq_of_row.append(s)
            lens.append(md.seq_lens_cpu[s] - q_len + j + 1)
    t = len(lens)
    rows = AttentionMetadata(
        num_tokens=t, num_seqs=t, max_query_len=1, max_seq_len=max(lens),
        query_start_loc=torch.arange(t + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32) - 1, slot_mapping=md.slot_mapping,
        block_tables=md.block_tables[seq_of_row], query_start_loc_cpu=list(range(t + 1)), seq_lens_cpu=lens,
        rows_share_sequences=True)
    kernels = triton_backend._load_kernels()
    writes = []
    real_write = kernels.write_kv_cache.write_kv_cache_triton
    monkeypatch.setattr(kernels.write_kv_cache, "write_kv_cache_triton",
                        lambda *a: (writes.append(1), real_write(*a))[1])
    backend = TritonAttentionBackend(decode_splits=2)
    backend.prepare(rows)
    out = backend.forward(batch.query.clone(), batch.key.clone(), batch.value, batch.kv_cache, rows, scale=64**-0.5,
                          rotary=(cos, sin))
    assert writes, "the fused decode kernel ran: a row may read keys another row has not written yet"
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_selection_checks_run_with_sinks():
    """Selection's correctness check on a model with sinks: the candidates get stand-in sinks (which change the
    output), and torch_batched agrees with the reference there."""
    from plinth.attention_backends.probe import max_error, run_steps
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend

    spec = _spec(sinks=True)
    cpu = torch.device("cpu")
    reference = run_steps(TorchSDPABackend, spec, cpu)
    without = run_steps(TorchSDPABackend, dataclasses.replace(spec, sinks=False), cpu)
    assert (reference - without).abs().max() > 0.05
    assert max_error(TorchBatchedBackend, reference, spec, cpu) < 1e-3   # float16 rounding


@needs_interpreter
def test_deepseek_engine_on_the_kernels_with_the_latent_cache_stored_once(tmp_path, monkeypatch):
    """The whole engine on the Triton kernels (interpreted) for DeepSeek-V3: one 48-wide latent head per token,
    the cache one tensor viewed as keys and values; greedy tokens equal transformers'."""
    from test_models import ARCHS, engine_matches_transformers

    import plinth

    monkeypatch.setitem(ARCHS["DeepseekV3ForCausalLM"][2], "kv_lora_rank", 40)
    engine_matches_transformers("DeepseekV3ForCausalLM", tmp_path, "cpu", attention_backend="triton",
                                selection="off")
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, attention_backend="triton", selection="off")
    cache = llm.engine.runner.kv_caches[0]
    assert cache.shape[-2:] == (1, 48) and cache.stride(0) == 0
