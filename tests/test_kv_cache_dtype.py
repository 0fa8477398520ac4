"""KV caches narrower than the model: 8-bit floats (``kv_cache_dtype="fp8"``) and bfloat16 under a float32 model
(``kv_cache_dtype="bfloat16"``). Every backend that takes one against float64 attention over the keys and values
rounded to the cache's format (as the format's specification rounds them: clamped to its range, nearest value), and
engines with such a cache: twice the blocks of a cache twice as wide, backends agreeing."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import save_tiny_model
from paged_driver import build_metadata

from plinth import LLM, SamplingParams
from plinth.attention_backends.interface import FP8_KV_DTYPES, AttentionSpec, write_kv_cache
from plinth.attention_backends.torch_batched import TorchBatchedBackend
from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ConfigError, EngineConfig
from plinth.errors import SelectionError

CUDA = torch.cuda.is_available()
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
#: the narrow caches the tests below take, and their ids
NARROW = [*FP8, torch.bfloat16]
NARROW_IDS = ["e4m3", "e5m2", "bf16"]


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache holds it, in float64: clamped to the format's largest value (8-bit floats), rounded to
    nearest."""
    limit = FP8_KV_DTYPES.get(dtype)
    return (x.double() if limit is None else x.double().clamp(-limit, limit)).to(dtype).double()


def _reference(q, k_all, v_all, ctx_len, scale, window=None):
    """float64 causal attention of one sequence: q [Q, Hq, D] at positions ctx_len.., k/v [L, Hkv, D]."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1).transpose(0, 1)            # [Hq, L, D]
    v = v_all.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("qhd,hld->hql", q.double(), k) * scale          # [Hq, Q, L]
    pos = torch.arange(ctx_len, ctx_len + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[1])[None, :]
    hidden = key_pos > pos
    if window is not None:
        hidden |= key_pos <= pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hql,hld->qhd", torch.softmax(scores, dim=-1), v)


def _backends():
    from plinth.attention_backends.cpu_paged import CpuPagedBackend

    out = [("torch_sdpa", TorchSDPABackend, "cpu"), ("torch_batched", TorchBatchedBackend, "cpu"),
           ("cpu_paged", CpuPagedBackend, "cpu")]
    if CUDA:
        from plinth.attention_backends.triton.backend import TritonAttentionBackend

        out += [("torch_sdpa-cuda", TorchSDPABackend, "cuda"), ("torch_batched-cuda", TorchBatchedBackend, "cuda"),
                ("triton", TritonAttentionBackend, "cuda")]
    return out


def _takes(name: str, backend_cls, spec: AttentionSpec, device: str) -> None:
    """Skip where a backend with its own kernels declines the cache (cpu_paged: FP8 under bfloat16 models on
    AVX512-BF16, bfloat16 under float32 ones on AVX2; Triton: FP8 only); the torch backends must take it."""
    support = backend_cls.check(spec, device)
    if not support and name in ("cpu_paged", "triton"):
        pytest.skip(f"{name}: {support.reason}")
    assert support, support.reason


@pytest.mark.parametrize("cache_dtype", NARROW, ids=NARROW_IDS)
@pytest.mark.parametrize("name, backend_cls, device", _backends(), ids=[b[0] for b in _backends()])
def test_attention_over_rounded_keys_and_values(name, backend_cls, device, cache_dtype):
    """A cached prefix, a prefill, a decode and a chunk in one step, float32 queries; some keys and values beyond
    the 8-bit formats' range (clamped, never NaN); new keys and values stored rounded."""
    g = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 4, 2, 16, 4, 48
    shapes = [(0, 7), (9, 3), (13, 1), (5, 6)]
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype, device=device)
    entries, full_k, full_v, used = [], [], [], 0
    for ctx_len, new in shapes:
        total = ctx_len + new
        blocks = perm[used:used + -(-total // block_size)].tolist()
        used += len(blocks)
        k_all = torch.randn(total, num_kv_heads, head_size, generator=g) * 3
        v_all = torch.randn(total, num_kv_heads, head_size, generator=g) * 3
        k_all[0, 0, :2] = torch.tensor([1e6, -1e6])   # beyond every 8-bit format's range
        v_all[-1, -1, -2:] = torch.tensor([-1e6, 1e6])
        if ctx_len:   # the prefix is already in the cache (written as the engine writes)
            slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx_len)])
            write_kv_cache(k_all[:ctx_len].to(device), v_all[:ctx_len].to(device), cache, slots.to(device))
        entries.append((list(range(new)), ctx_len, blocks))
        full_k.append(k_all)
        full_v.append(v_all)
    _, _, md = build_metadata(entries, block_size, device=device)
    query = torch.randn(md.num_tokens, num_heads, head_size, generator=g)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    spec = AttentionSpec(num_heads, num_kv_heads, head_size, torch.float32, block_size, kv_cache_dtype=cache_dtype)
    _takes(name, backend_cls, spec, device)
    backend = backend_cls()
    backend.prepare(md)
    scale = 1 / math.sqrt(head_size)
    out = backend.forward(query.to(device), key.to(device), value.to(device), cache, md, scale=scale).cpu()
    assert torch.isfinite(out).all()
    for s, (ctx_len, _) in enumerate(shapes):
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        ref = _reference(query[lo:hi], _rounded(full_k[s], cache_dtype), _rounded(full_v[s], cache_dtype), ctx_len,
                         scale)
        torch.testing.assert_close(out[lo:hi].double(), ref, rtol=2e-5, atol=1e-4)   # float32 math, values to 6e4
    flat = cache.view(2, -1, num_kv_heads, head_size).cpu()
    assert torch.equal(flat[0, md.slot_mapping.cpu()].double(), _rounded(key, cache_dtype))
    assert torch.equal(flat[1, md.slot_mapping.cpu()].double(), _rounded(value, cache_dtype))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("cache_dtype", NARROW, ids=NARROW_IDS)
@pytest.mark.parametrize("name, backend_cls, device", _backends(), ids=[b[0] for b in _backends()])
def test_decode_steps_over_rounded_keys_and_values(name, backend_cls, device, cache_dtype, window, model_dtype):
    """Decode-only steps (one query per sequence, the decode kernels' path; Triton with one split and with three)
    over cached contexts of 5 to 40 tokens, with and without a sliding window, float32 and bfloat16 models."""
    g = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 8, 2, 32, 4, 64
    ctx_lens = [9, 40, 5, 17]
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype, device=device)
    entries, full_k, full_v, used = [], [], [], 0
    for ctx_len in ctx_lens:
        blocks = perm[used:used + -(-(ctx_len + 1) // block_size)].tolist()
        used += len(blocks)
        k_all = (torch.randn(ctx_len + 1, num_kv_heads, head_size, generator=g) * 2).to(model_dtype)
        v_all = (torch.randn(ctx_len + 1, num_kv_heads, head_size, generator=g) * 2).to(model_dtype)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx_len)])
        write_kv_cache(k_all[:ctx_len].to(device), v_all[:ctx_len].to(device), cache, slots.to(device))
        entries.append(([0], ctx_len, blocks))
        full_k.append(k_all)
        full_v.append(v_all)
    _, _, md = build_metadata(entries, block_size, device=device)
    query = torch.randn(len(ctx_lens), num_heads, head_size, generator=g).to(model_dtype)
    key = torch.stack([k[-1] for k in full_k])
    value = torch.stack([v[-1] for v in full_v])
    scale = 1 / math.sqrt(head_size)
    _takes(name, backend_cls, AttentionSpec(num_heads, num_kv_heads, head_size, model_dtype, block_size,
                                            kv_cache_dtype=cache_dtype), device)
    backends = [backend_cls()] if name != "triton" else [backend_cls(decode_splits=1), backend_cls(decode_splits=3)]
    for backend in backends:
        layer_cache = cache.clone()
        backend.prepare(md)
        out = backend.forward(query.to(device), key.to(device), value.to(device), layer_cache, md, scale=scale,
                              sliding_window=window).cpu()
        for s, ctx_len in enumerate(ctx_lens):
            ref = _reference(query[s:s + 1], _rounded(full_k[s], cache_dtype), _rounded(full_v[s], cache_dtype),
                             ctx_len, scale, window)
            tol = 2e-5 if model_dtype == torch.float32 else 2e-2   # bfloat16 math and output
            torch.testing.assert_close(out[s:s + 1].double(), ref, rtol=tol, atol=tol * 5)


def test_engine_with_an_fp8_cache(tmp_path):
    """The cache holds FP8 and four times the blocks of a float32 cache in the same bytes; the two torch backends
    read it alike (same tokens and log-probabilities)."""
    model = save_tiny_model(tmp_path / "m")
    prompts = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    common = dict(dtype="float32", selection="off", cpu_kv_cache_bytes=1 << 22, platform="cpu")
    runs = {}
    for name, kw in {"f32": {}, "sdpa": dict(kv_cache_dtype="fp8", attention_backend="torch_sdpa"),
                     "batched": dict(kv_cache_dtype="fp8", attention_backend="torch_batched")}.items():
        llm = LLM(str(model), **common, **kw)
        runs[name] = (llm.generate(prompts, params, use_tqdm=False), llm.engine)
    f32_engine, fp8_engine = runs["f32"][1], runs["sdpa"][1]
    assert fp8_engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8_engine.block_manager.num_usable_blocks + 1 == 4 * (f32_engine.block_manager.num_usable_blocks + 1)
    for a, b in zip(runs["sdpa"][0], runs["batched"][0], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = lambda out: [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids,  # noqa: E731
                                                           strict=True)]
        assert lp(a) == pytest.approx(lp(b), abs=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_with_graphs_equals_the_reference_backend(tmp_path):
    """On a GPU: the Triton backend (decode graphs, RoPE and the cache write fused in the decode kernel) and
    the reference backend, both with an FP8 cache, generate the same tokens."""
    model = save_tiny_model(tmp_path / "m", head_dim=16, hidden_size=64)
    prompts = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123"] * 3
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch_sdpa"):
        llm = LLM(str(model), dtype="float32", selection="off", kv_cache_dtype="fp8", attention_backend=backend)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "triton":
            assert llm.engine.runner.graphs is not None
    assert outs["triton"] == outs["torch_sdpa"]


def test_backends_that_cannot_read_an_fp8_cache_say_so(tmp_path):
    from plinth.attention_backends.cpu_paged import CpuPagedBackend

    # cpu_paged reads E4M3 caches of bfloat16 models with head size 64 or 128 (its own answer: a subclass with its own
    # kernels does not inherit its parent's acceptance, cpu_paged being a torch_batched)
    spec = AttentionSpec(4, 2, 16, torch.bfloat16, 16, kv_cache_dtype=torch.float8_e4m3fn)
    assert "an FP8 KV cache unsupported for bfloat16 models of head size 16" in CpuPagedBackend.check(spec, "cpu").reason
    assert TorchBatchedBackend.check(spec, "cpu") and not CpuPagedBackend.check(spec, "cpu")
    e5m2 = AttentionSpec(4, 2, 64, torch.bfloat16, 16, kv_cache_dtype=torch.float8_e5m2)
    assert "float8_e5m2 unsupported: reads float8_e4m3fn" in CpuPagedBackend.check(e5m2, "cpu").reason
    assert "on 'npu' unsupported" in TorchSDPABackend.check(spec, "npu").reason
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8")
    model = save_tiny_model(tmp_path / "m")
    with pytest.raises(SelectionError, match="an FP8 KV cache unsupported for float32 models"):
        LLM(str(model), dtype="float32", kv_cache_dtype="fp8", attention_backend="cpu_paged", platform="cpu")
    ours = AttentionSpec(9, 3, 64, torch.bfloat16, 16, kv_cache_dtype=torch.float8_e4m3fn)
    from plinth.attention_backends import cpu_paged

    assert bool(CpuPagedBackend.check(ours, "cpu")) == (cpu_paged.load_kernel().library is not None
                                                        and cpu_paged.fp8_decode_available())


def test_selection_cache_keeps_cache_dtypes_apart(tmp_path, monkeypatch):
    """Benchmark-mode selection with its on-disk cache: a winner chosen for a float32 cache is not reused for an
    FP8 one (the native CPU backend cannot read it), and the FP8 choice is cached under its own key."""
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    model = save_tiny_model(tmp_path / "m")
    winners = []
    for kv in ("auto", "fp8", "fp8"):
        llm = LLM(str(model), dtype="float32", platform="cpu", selection="cached", kv_cache_dtype=kv)
        winners.append(llm.engine.selection.winner)
        assert llm.engine.runner.kv_caches[0].dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
    assert winners[1] in ("torch_sdpa", "torch_batched") and winners[2] == winners[1]


def _cpu_fp8_ready() -> bool:
    from plinth.attention_backends import cpu_paged

    return cpu_paged.load_kernel().library is not None and cpu_paged.fp8_decode_available()


def _cpu_bf16_ready() -> bool:
    from plinth.attention_backends import cpu_paged

    return cpu_paged.load_kernel().library is not None and cpu_paged.f32_bf16_available()


@pytest.mark.skipif(not _cpu_bf16_ready(), reason="the CPU paged-attention kernel reads no bfloat16 cache under "
                                                  "float32 queries here (AVX2 builds without AVX512)")
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
def test_cpu_paged_reads_a_bfloat16_cache(head_size, window, monkeypatch):
    """The native CPU backend over a bfloat16 cache (float32 model): decode rows and prompts and chunks (with cached
    context) through its kernels, which widen each key and value as they read it; a decode-only step as well.
    Against float64 attention over the rounded keys and values; and the same bits as the backend over a float32 cache
    holding those rounded values."""
    from plinth.attention_backends import cpu_paged
    from plinth.attention_backends.cpu_paged import CpuPagedBackend

    calls = []
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(cpu_paged, name)

        def spy(query, kv_cache, *args, _real=real, _name=name, **kw):
            calls.append((_name, kv_cache.dtype))
            return _real(query, kv_cache, *args, **kw)

        monkeypatch.setattr(cpu_paged, name, spy)
    g = torch.Generator().manual_seed(head_size + (window or 0))
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 64
    spec = AttentionSpec(num_heads, num_kv_heads, head_size, torch.float32, block_size, kv_cache_dtype=torch.bfloat16)
    assert CpuPagedBackend.check(spec, "cpu"), CpuPagedBackend.check(spec, "cpu").reason
    for shapes in ([(30, 1), (70, 1), (5, 1), (0, 40), (17, 20)], [(9, 1), (40, 1), (100, 1), (3, 1)],
                   [(30, 1), (0, 10), (5, 12)]):
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        caches = {dt: torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dt)
                  for dt in (torch.bfloat16, torch.float32)}
        entries, full_k, full_v, used = [], [], [], 0
        for ctx_len, new in shapes:
            total = ctx_len + new
            blocks = perm[used:used + -(-total // block_size)].tolist()
            used += len(blocks)
            k_all = torch.randn(total, num_kv_heads, head_size, generator=g) * 2
            v_all = torch.randn(total, num_kv_heads, head_size, generator=g) * 2
            if ctx_len:
                slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx_len)])
                write_kv_cache(k_all[:ctx_len], v_all[:ctx_len], caches[torch.bfloat16], slots)
                # the float32 cache holds the values the bfloat16 one does
                write_kv_cache(k_all[:ctx_len].bfloat16().float(), v_all[:ctx_len].bfloat16().float(),
                               caches[torch.float32], slots)
            entries.append((list(range(new)), ctx_len, blocks))
            full_k.append(k_all)
            full_v.append(v_all)
        _, _, md = build_metadata(entries, block_size)
        query = torch.randn(md.num_tokens, num_heads, head_size, generator=g)
        key = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
        value = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
        scale = 1 / math.sqrt(head_size)
        outs = {}
        for dt, cache in caches.items():
            backend = CpuPagedBackend()
            backend.prepare(md)
            k, v = (key, value) if dt == torch.bfloat16 else (key.bfloat16().float(), value.bfloat16().float())
            outs[dt] = backend.forward(query, k, v, cache, md, scale=scale, sliding_window=window)
        assert torch.equal(caches[torch.bfloat16].float(), caches[torch.float32])   # rounded as torch rounds
        out = outs[torch.bfloat16]
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert torch.equal(out, outs[torch.float32])
        for s, (ctx_len, _) in enumerate(shapes):
            lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
            ref = _reference(query[lo:hi], _rounded(full_k[s], torch.bfloat16), _rounded(full_v[s], torch.bfloat16),
                             ctx_len, scale, window)
            torch.testing.assert_close(out[lo:hi].double(), ref, rtol=2e-5, atol=1e-5)
    # the native kernels read the bfloat16 cache: decode rows, prompts and chunks
    assert ("paged_decode", torch.bfloat16) in calls and ("paged_prefill", torch.bfloat16) in calls


@pytest.mark.skipif(not _cpu_fp8_ready(), reason="the CPU paged-attention kernel has no FP8 decode here (AVX512-BF16)")
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
def test_cpu_paged_reads_an_fp8_cache(head_size, window):
    """The native CPU backend over an FP8 E4M3 cache (bfloat16 model): decode rows through its FP8 decode kernel,
    prompts and chunks (with cached context) through the fused prefill over the context as the cache holds it; a
    decode-only step as well; with a sliding window, a step whose prompts pass the window through torch_batched.
    Against float64 attention over the rounded keys and values, within bfloat16's error."""
    from plinth.attention_backends.cpu_paged import CpuPagedBackend

    took = []
    real = CpuPagedBackend._forward_fp8

    def spy(self, *args):
        out = real(self, *args)
        took.append(out is not None)
        return out

    g = torch.Generator().manual_seed(head_size + (window or 0))
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 64
    spec = AttentionSpec(num_heads, num_kv_heads, head_size, torch.bfloat16, block_size,
                         kv_cache_dtype=torch.float8_e4m3fn)
    assert CpuPagedBackend.check(spec, "cpu"), CpuPagedBackend.check(spec, "cpu").reason
    for shapes in ([(30, 1), (70, 1), (5, 1), (0, 40), (17, 20)], [(9, 1), (40, 1), (100, 1), (3, 1)],
                   [(30, 1), (0, 10), (5, 12)]):
        native = not window or all(new == 1 or ctx + new <= window for ctx, new in shapes)
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float8_e4m3fn)
        entries, full_k, full_v, used = [], [], [], 0
        for ctx_len, new in shapes:
            total = ctx_len + new
            blocks = perm[used:used + -(-total // block_size)].tolist()
            used += len(blocks)
            k_all = (torch.randn(total, num_kv_heads, head_size, generator=g) * 2).to(torch.bfloat16)
            v_all = (torch.randn(total, num_kv_heads, head_size, generator=g) * 2).to(torch.bfloat16)
            k_all[0, 0, :2] = torch.tensor([1e4, -1e4])   # beyond E4M3's range: clamped to +-448
            if ctx_len:
                slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx_len)])
                write_kv_cache(k_all[:ctx_len], v_all[:ctx_len], cache, slots)
            entries.append((list(range(new)), ctx_len, blocks))
            full_k.append(k_all)
            full_v.append(v_all)
        _, _, md = build_metadata(entries, block_size)
        query = torch.randn(md.num_tokens, num_heads, head_size, generator=g).to(torch.bfloat16)
        key = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
        value = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
        backend = CpuPagedBackend()
        backend.prepare(md)
        scale = 1 / math.sqrt(head_size)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(CpuPagedBackend, "_forward_fp8", spy)
            out = backend.forward(query, key, value, cache, md, scale=scale, sliding_window=window)
        assert took.pop() == native   # the FP8 path, or (prompts past the window) torch_batched
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        for s, (ctx_len, _) in enumerate(shapes):
            lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
            ref = _reference(query[lo:hi], _rounded(full_k[s], torch.float8_e4m3fn),
                             _rounded(full_v[s], torch.float8_e4m3fn), ctx_len, scale, window)
            torch.testing.assert_close(out[lo:hi].double(), ref, rtol=2e-2, atol=2e-2)
        flat = cache.view(2, -1, num_kv_heads, head_size)
        assert torch.equal(flat[0, md.slot_mapping].double(), _rounded(key, torch.float8_e4m3fn))
        assert torch.equal(flat[1, md.slot_mapping].double(), _rounded(value, torch.float8_e4m3fn))


@pytest.mark.skipif(not _cpu_fp8_ready(), reason="the CPU paged-attention kernel has no FP8 decode here (AVX512-BF16)")
def test_cpu_fp8_decode_widens_every_code_exactly():
    """Every one of the 256 E4M3 codes read by the FP8 decode kernel: one cached token per sequence, so each output
    row is that token's values (one probability of 1) and must equal torch's conversion of the bytes, NaNs as NaN."""
    from plinth.attention_backends.cpu_paged import paged_decode

    num_heads = num_kv_heads = 2
    head_size, block_size = 64, 16
    codes = torch.arange(256, dtype=torch.uint8).view(2, num_kv_heads, head_size)   # sequence s: codes 128 s ..
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_size, dtype=torch.uint8)
    for s in range(2):
        cache[0, s + 1, 0] = 56                         # keys: 1.0 (any finite key works for one token)
        cache[1, s + 1, 0] = codes[s]
    cache = cache.view(torch.float8_e4m3fn)
    query = torch.randn(2, num_heads, head_size).to(torch.bfloat16)
    out = paged_decode(query, cache, torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                       torch.tensor([0, 1, 2], dtype=torch.int32), 2, 0.125)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(out.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    # (values compared as numbers: -0 times a probability of 1 plus the zero padding of the key pair is +0)
    assert torch.equal(out[~want.isnan()].double(), want[~want.isnan()].double())


@pytest.mark.skipif(not _cpu_fp8_ready(), reason="the CPU paged-attention kernel has no FP8 decode here (AVX512-BF16)")
def test_engine_on_cpu_paged_with_an_fp8_cache(tmp_path):
    """A bfloat16 model with an FP8 cache on the native CPU backend: selection takes cpu_paged (head size 64), the
    CPU decode plan runs the decode steps over the FP8 cache, and the tokens match the
    torch_batched backend's over the same 8-bit cache."""
    model = save_tiny_model(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123" * 9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(dtype="bfloat16", kv_cache_dtype="fp8", cpu_kv_cache_bytes=1 << 22, platform="cpu")
    native = LLM(str(model), **common)
    assert native.engine.selection.winner == "cpu_paged"
    assert native.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    from plinth.worker.cpu_decode_plan import CpuDecodePlan

    assert isinstance(native.engine.runner.graphs, CpuDecodePlan)   # decode steps in the native plan, FP8 and all
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    ref_llm = LLM(str(model), **common, attention_backend="torch_batched", selection="off")
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"tokens agreeing with torch_batched: {agree} of {sum(len(w) for w in want)}")
    assert agree >= 0.9 * sum(len(w) for w in want), (got, want)


def test_native_fp8_cache_write_rounds_as_torch():
    """Every bfloat16 bit pattern written into an FP8 E4M3 cache by the native write (16-lane and scalar tails)
    becomes the byte torch's path makes of it (``to_cache_dtype``: the clamp to +-448, then the conversion; every NaN
    comes out of it as 0xFF, which the native write writes too)."""
    from plinth.attention_backends.interface import to_cache_dtype
    from plinth.kernels import cpu_native

    if cpu_native.load_library().library is None:
        pytest.skip("no native CPU library")
    rows = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(-1, 1, 4)
    key, value = rows[:, :, :4].contiguous(), rows.flip(0).contiguous()   # 4 values per token: scalar path only
    wide_k = rows.view(-1, 1, 64)                                           # 64 per token: the 16-lane path
    for k, v in ((key, value), (wide_k, wide_k.flip(0).contiguous())):
        cache = torch.zeros(2, k.shape[0], 1, 1, k.shape[2], dtype=torch.float8_e4m3fn)
        if not cpu_native.kv_write_supported(k, v, cache):
            pytest.skip("the native CPU ops are off")
        slots = torch.randperm(k.shape[0])
        cpu_native.write_kv(k, v, cache, slots)
        flat = cache.view(2, -1, k.shape[2]).view(torch.uint8)
        assert torch.equal(flat[0, slots], to_cache_dtype(k[:, 0], torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(flat[1, slots], to_cache_dtype(v[:, 0], torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.skipif(not _cpu_fp8_ready(), reason="the CPU paged-attention kernel has no FP8 decode here (AVX512-BF16)")
def test_native_fp8_gather_equals_torch():
    """A sequence's keys and values gathered from an FP8 cache and widened by the native kernel (every one of the 256
    codes, NaNs included): torch's gather and conversion."""
    from plinth.attention_backends import cpu_paged

    g = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (2, 20, 16, 3, 64), generator=g, dtype=torch.uint8)
    cache.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    cache = cache.view(torch.float8_e4m3fn)
    table = torch.tensor([0, 7, 2, 19, 11, 4], dtype=torch.int32)
    lib = cpu_paged.load_kernel().library
    for seq_len in (1, 16, 37, 96):
        for half in range(2):
            out = torch.empty(seq_len, 3, 64, dtype=torch.bfloat16)
            assert lib.plinth_cpu_gather_e4m3(cache[half].data_ptr(), table.data_ptr(), seq_len, 16, 3 * 64,
                                              out.data_ptr(), 2) == 0
            want = cache[half, table[: -(-seq_len // 16)].long()].flatten(0, 1)[:seq_len].to(torch.bfloat16)
            assert torch.equal(out.isnan(), want.isnan())
            assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0))
        k, v = cpu_paged.gather_e4m3(cache, table, seq_len)   # the wrapper: the same values
        assert torch.equal(k.nan_to_num(0.0), cache[0, table[: -(-seq_len // 16)].long()].flatten(0, 1)[:seq_len]
                           .to(torch.bfloat16).nan_to_num(0.0))
    with pytest.raises(ValueError, match="do not fit a block table"):
        cpu_paged.gather_e4m3(cache, table, 97)


@pytest.mark.skipif(not _cpu_bf16_ready(), reason="the CPU paged-attention kernel reads no bfloat16 cache under "
                                                  "float32 queries here (AVX2 builds without AVX512)")
def test_engine_on_cpu_paged_with_a_bfloat16_cache(tmp_path):
    """A float32 model with ``kv_cache_dtype="bfloat16"``: twice the blocks of its float32 cache in the same bytes,
    selection takes cpu_paged, the CPU decode plan runs the decode steps, and the greedy tokens and log-probabilities
    match the torch_batched backend's over the same bfloat16 cache; against the float32 cache the log-probabilities
    move by bfloat16's rounding of the keys and values only."""
    from plinth.worker.cpu_decode_plan import CpuDecodePlan

    model = save_tiny_model(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123" * 9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    common = dict(dtype="float32", cpu_kv_cache_bytes=1 << 22, platform="cpu")
    native = LLM(str(model), **common, kv_cache_dtype="bfloat16")
    assert native.engine.selection.winner == "cpu_paged"
    assert native.engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert isinstance(native.engine.runner.graphs, CpuDecodePlan)
    wide = LLM(str(model), **common, attention_backend="cpu_paged", selection="off")
    assert native.engine.block_manager.num_usable_blocks + 1 == 2 * (wide.engine.block_manager.num_usable_blocks + 1)
    ref = LLM(str(model), **common, kv_cache_dtype="bfloat16", attention_backend="torch_batched", selection="off")

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                 for o in outs])

    got, got_lp = run(native)
    want, want_lp = run(ref)
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    f32, f32_lp = run(wide)
    moved = [abs(a - b) for g, w, gl, wl in zip(got, f32, got_lp, f32_lp, strict=True)
             for i, (a, b) in enumerate(zip(gl, wl, strict=True)) if g[:i + 1] == w[:i + 1]]
    print(f"greedy tokens equal to the float32 cache's: {sum(g == w for g, w in zip(got, f32, strict=True))} of "
          f"{len(got)} sequences; log-probabilities moved by at most {max(moved):.2e}")
    assert max(moved) < 0.05
