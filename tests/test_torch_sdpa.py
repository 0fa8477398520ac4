"""The reference attention backend against a direct float64 computation on random paged inputs."""

from __future__ import annotations

import math

import pytest
import torch
from paged_driver import build_metadata

from plinth.attention_backends.interface import AttentionSpec
from plinth.attention_backends.torch_sdpa import TorchSDPABackend


def _reference(q, k_all, v_all, ctx_len, scale, window):
    """float64 attention of one sequence: q [Q, Hq, D], k/v [L, Hkv, D] (whole sequence)."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k_all.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(num_q):
        pos = ctx_len + i
        for h in range(num_heads):
            keys = range(max(0, pos - window + 1) if window else 0, pos + 1)
            scores = torch.tensor([float(q[i, h].double() @ k_all[j, h // group].double()) * scale for j in keys])
            p = torch.softmax(scores, dim=0)
            out[i, h] = sum(p[n] * v_all[j, h // group].double() for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_matches_float64_reference(num_heads, num_kv_heads, window):
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + (window or 0))
    block_size, head_size, num_blocks = 4, 8, 40
    # (tokens already cached, new tokens): prefill, prefill after a cached prefix, decode, chunk
    shapes = [(0, 7), (9, 3), (13, 1), (5, 6)]
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # any block but the scratch block 0
    next_block = 0
    entries, full_k, full_v = [], [], []
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    for ctx_len, new in shapes:
        total = ctx_len + new
        n_blocks = -(-total // block_size)
        blocks = perm[next_block:next_block + n_blocks].tolist()
        next_block += n_blocks
        k_all = torch.randn(total, num_kv_heads, head_size, generator=g)
        v_all = torch.randn(total, num_kv_heads, head_size, generator=g)
        for p in range(ctx_len):  # the prefix is already in the cache
            kv_cache[0, blocks[p // block_size], p % block_size] = k_all[p]
            kv_cache[1, blocks[p // block_size], p % block_size] = v_all[p]
        entries.append((list(range(new)), ctx_len, blocks))
        full_k.append(k_all)
        full_v.append(v_all)
    _, _, md = build_metadata(entries, block_size)
    num_tokens = md.num_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=g)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    scale = 1 / math.sqrt(head_size)
    backend = TorchSDPABackend()
    backend.prepare(md)
    out = backend.forward(query, key, value, kv_cache, md, scale=scale, sliding_window=window)
    assert out.shape == query.shape
    for s, (ctx_len, _) in enumerate(shapes):
        lo, hi = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
        ref = _reference(query[lo:hi], full_k[s], full_v[s], ctx_len, scale, window)
        assert (out[lo:hi].double() - ref).abs().max().item() < 1e-5
    # every new key/value landed at its slot
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[0, md.slot_mapping], key)
    assert torch.equal(flat[1, md.slot_mapping], value)


def test_supports_everything():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=96, dtype=dtype, block_size=16, sliding_window=64)
        for device in ("cpu", "cuda", "xpu"):
            assert TorchSDPABackend.supports(spec, device)
    assert TorchSDPABackend.name == "torch_sdpa"


def test_half_precision_close_to_float32():
    g = torch.Generator().manual_seed(3)
    _, _, md = build_metadata([(list(range(6)), 0, [2, 5])], block_size=4)
    q = torch.randn(6, 4, 16, generator=g)
    k = torch.randn(6, 2, 16, generator=g)
    v = torch.randn(6, 2, 16, generator=g)
    backend = TorchSDPABackend()
    ref = backend.forward(q, k, v, torch.zeros(2, 8, 4, 2, 16), md, scale=0.25)
    cache = torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16)
    out = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache, md, scale=0.25)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 5e-2
