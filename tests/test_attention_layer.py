"""The attention layer hands RoPE to backends that take it (``fuses_rotary``) and rotates q/k itself for the rest."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from plinth.attention_backends.interface import AttentionBackend, AttentionMetadata, Support
from plinth.kernels import cpu_native, ops
from plinth.model_registry.layers.attention import Attention
from plinth.model_registry.layers.rotary import apply_rotary


class Recorder(AttentionBackend):
    """Records what ``forward`` receives; returns the query."""

    name: ClassVar[str] = "recorder"

    def __init__(self, fuses: bool):
        self.fuses_rotary = fuses
        self.calls: list[dict] = []

    @classmethod
    def supports(cls, spec, device_type):
        return Support.yes()

    def forward(self, query, key, value, kv_cache, metadata, *, scale, sliding_window=None, **kwargs):
        self.calls.append(dict(query=query.clone(), key=key.clone(), **kwargs))
        return query


def _inputs(rot: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rot)
    q, k, v = (torch.randn(3, h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    angles = torch.rand(3, rot // 2, generator=gen) * 6
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, v, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("fused_ops", [True, False])
@pytest.mark.parametrize("fuses", [True, False])
@pytest.mark.parametrize("rot", [16, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rotary_goes_to_the_backend_only_where_it_takes_it(fuses, rot, fused_ops, dtype, monkeypatch):
    """RoPE goes to a backend that takes it where the fused ops run for the input (``fused_ops_enabled``: the
    native CPU ops, here bfloat16 and float32), else it is applied before the backend (the native op or the
    torch code)."""
    if not cpu_native.load_library().library:
        pytest.skip("the native CPU kernels are not built here")
    if not fused_ops:
        monkeypatch.setattr(cpu_native, "layer_ops_enabled", lambda x: False)
    backend = Recorder(fuses)
    layer = Attention(4, 16, 0.25, 2, backend)
    layer.kv_cache = torch.zeros(1)
    q, k, v, cos, sin = _inputs(rot, dtype)
    assert ops.fused_ops_enabled(q) == fused_ops
    metadata = AttentionMetadata(3, 3, 1, 4, *(torch.zeros(1),) * 5, [0, 1, 2, 3], [1, 1, 1])
    layer(q.clone(), k.clone(), v, metadata, rotary=(cos, sin))
    call = backend.calls[-1]
    if fuses and rot == 16 and fused_ops:   # all features rotated, fused kernels on: the backend does it
        assert call["rotary"] is not None and torch.equal(call["rotary"][0], cos)
        assert torch.equal(call["query"], q) and torch.equal(call["key"], k)
    else:                                   # rotated before the backend (partial RoPE: the first `rot` features)
        assert "rotary" not in call
        # the bfloat16 native kernel rounds once, the torch code after each op
        tol = 2e-2 if fused_ops and dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(call["query"], apply_rotary(q, cos, sin), rtol=tol, atol=tol)
        torch.testing.assert_close(call["key"], apply_rotary(k, cos, sin), rtol=tol, atol=tol)
        assert not torch.equal(call["query"], q)
