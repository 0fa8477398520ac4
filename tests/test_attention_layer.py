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
def test_rotary_goes_to_the_backend_only_where_it_takes_it(fuses, rot, fused_ops):
    """bfloat16 on the CPU runs the fused (native) ops, float32 the torch code (``fused_ops_enabled``)."""
    dtype = torch.bfloat16 if fused_ops else torch.float32
    if fused_ops and not cpu_native.available(dtype):
        pytest.skip("the native CPU kernels are not built here")
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
        tol = 2e-2 if fused_ops else 1e-6   # the native kernel rounds once, the torch code after each op
        torch.testing.assert_close(call["query"], apply_rotary(q, cos, sin), rtol=tol, atol=tol)
        torch.testing.assert_close(call["key"], apply_rotary(k, cos, sin), rtol=tol, atol=tol)
        assert not torch.equal(call["query"], q)
