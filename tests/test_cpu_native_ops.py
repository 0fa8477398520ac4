"""The native CPU kernels (``plinth/kernels/csrc/cpu_ops.cpp``) against the torch reference code of the
layers (same bfloat16 rounding steps: at most one bfloat16 ulp apart, almost always equal) and
against float64 math; the GGUF ``Q8_0`` GEMV against gguf's own dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cpu_features import needs_packed_bf16

from plinth.kernels import cpu_native, ops
from plinth.model_registry.layers.activation import SiluAndMul
from plinth.model_registry.layers.layernorm import RMSNorm
from plinth.model_registry.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu_native.load_library().library is None,
                                reason=f"native CPU ops unavailable: {cpu_native.load_library().reason}")

BF16 = torch.bfloat16


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between two bfloat16 tensors of finite values."""
    ia = a.contiguous().view(torch.int16).to(torch.int32)
    ib = b.contiguous().view(torch.int16).to(torch.int32)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)      # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.98) -> None:
    assert out.dtype == ref.dtype == BF16 and out.shape == ref.shape
    d = ulps(out, ref)
    assert int(d.max()) <= 1, f"{int(d.max())} bfloat16 ulps apart"
    assert float((d == 0).float().mean()) >= min_equal


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_fused_ops_take_cpu_bfloat16_and_float32():
    assert ops.fused_ops_enabled(torch.zeros(2, 4, dtype=BF16))
    assert ops.fused_ops_enabled(torch.zeros(2, 4, dtype=torch.float32))
    assert not ops.fused_ops_enabled(torch.zeros(2, 4, dtype=torch.float16))
    assert not cpu_native.enabled(torch.zeros(2, 4, dtype=torch.float32))   # the GEMMs stay bfloat16-only


@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_layer_ops_against_float64(with_residual, gen, monkeypatch):
    """float32 models: RMSNorm, SiLU-and-mul and RoPE in one native call each (counted), within float32
    rounding of float64 math and of the torch code the layers run otherwise."""
    calls = []
    for name in ("rms_norm", "silu_and_mul", "rotary_"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    n, rows = 576, 5
    norm = RMSNorm(n, eps=1e-5)
    norm.weight.copy_(torch.randn(n, generator=gen) * 0.2 + 1)
    x = torch.randn(rows, n + 8, generator=gen)[:, 3:n + 3]                 # strided rows
    residual = torch.randn(rows, n, generator=gen) if with_residual else None
    out = norm(x, residual)
    if residual is not None:
        out, h = out
        assert torch.equal(h, x + residual)
    h64 = (x + residual).double() if residual is not None else x.double()
    exact = h64 / h64.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * norm.weight.double()
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    ref = norm._norm(x + residual if residual is not None else x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    gu = torch.randn(rows, 2 * 1536, generator=gen) * 4
    act = SiluAndMul()(gu)
    g64, u64 = gu.double().chunk(2, dim=-1)
    torch.testing.assert_close(act.double(), g64 * torch.sigmoid(g64) * u64, atol=1e-5, rtol=1e-5)

    tokens, hq, hk, d = 3, 9, 3, 64
    for rot in (64, 32):                                   # all features, and partial RoPE
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen)
        q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
        v_before = qkv[:, (hq + hk) * d:].clone()
        pos = torch.randint(0, 4096, (tokens,), generator=gen).double()
        freqs = pos[:, None] * (1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)))[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        before = [(t.double(), apply_rotary(t, cos, sin)) for t in (q, k)]
        ops.rotary_(q, k, cos, sin)
        assert torch.equal(qkv[:, (hq + hk) * d:], v_before)                 # v untouched
        for out_t, (x64, ref_t) in zip((q, k), before, strict=True):
            torch.testing.assert_close(out_t, ref_t, atol=1e-5, rtol=1e-5)
            x1, x2 = x64[..., : rot // 2], x64[..., rot // 2: rot]
            c, s = cos.double()[:, None, : rot // 2], sin.double()[:, None, : rot // 2]
            exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x64[..., rot:]), dim=-1)
            torch.testing.assert_close(out_t.double(), exact, atol=1e-5, rtol=1e-5)
    assert calls == ["rms_norm", "silu_and_mul", "rotary_", "rotary_"], calls


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 100), (64, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rows, n, with_residual, gen):
    norm = RMSNorm(n, eps=1e-5).to(BF16)
    norm.weight.copy_(torch.randn(n, generator=gen) * 0.2 + 1)
    base = torch.randn(rows, n + 8, generator=gen).to(BF16)
    x = base[:, 3:n + 3]                                  # strided rows
    residual = torch.randn(rows, n, generator=gen).to(BF16) if with_residual else None
    out = ops.rms_norm(x, norm.weight, norm.eps, residual)
    if residual is None:
        ref = norm._norm(x)
        assert_matches_reference(out, ref)
        h64 = x.double()
    else:
        h_ref = x + residual
        ref = norm._norm(h_ref)
        assert torch.equal(out[1], h_ref)
        assert_matches_reference(out[0], ref)
        out, h64 = out[0], h_ref.double()
    exact = h64 / h64.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * norm.weight.double()
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("n", [576, 37, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bits_follow_its_definition(n, with_residual, gen):
    """The native bfloat16 RMSNorm's exact bits: h = bf16(x + residual); float32 squares summed per lane of 16 in
    order (a bfloat16 square is exact in float32), the lanes folded 8, 4, 2, 1, the tail added in order; y =
    bf16(w * bf16(h / sqrt(sum / n + eps))); emulated here in float32 torch ops, compared with torch.equal."""
    rows = 6
    x = (torch.randn(rows, n, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)).to(BF16)
    # the last row tiny but for one feature: its normalized values are float32 (and bfloat16) subnormals, which
    # the rounding keeps (vcvtneps2bf16 would flush them)
    x[-1] = 4e-26 * (1 + torch.rand(n, generator=gen))
    x[-1, 0] = 1e15
    residual = torch.randn(rows, n, generator=gen).to(BF16) if with_residual else None
    if residual is not None:
        residual[-1] = 0
    weight = (torch.randn(n, generator=gen) * 0.2 + 1).to(BF16)
    out = cpu_native.rms_norm(x, weight, 1e-5, residual)
    h = (x.float() + residual.float()).to(BF16) if with_residual else x
    hf = h.float()
    full = n - n % 16
    lanes = torch.zeros(rows, 16)
    for i in range(0, full, 16):
        lanes += hf[:, i:i + 16] * hf[:, i:i + 16]
    for width in (8, 4, 2, 1):
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
    total = lanes[:, 0]
    for i in range(full, n):
        total = total + hf[:, i] * hf[:, i]
    inv = 1.0 / torch.sqrt(total / n + torch.tensor(1e-5, dtype=torch.float32))
    want = (weight.float() * (hf * inv.unsqueeze(1)).to(BF16).float()).to(BF16)
    got = out[0] if with_residual else out
    tiny = want[-1, 1:].float().abs()
    assert bool(((tiny > 0) & (tiny < 1.17e-38)).all())   # the subnormals are reached
    assert torch.equal(got, want)
    if with_residual:
        assert torch.equal(out[1], h)


@pytest.mark.parametrize("rows,d", [(1, 1536), (5, 37), (33, 256)])
def test_silu_and_mul(rows, d, gen):
    x = (torch.randn(rows, 2 * d, generator=gen) * 4).to(BF16)
    gate, up = x.chunk(2, dim=-1)
    out = ops.silu_and_mul(x)
    assert_matches_reference(out, F.silu(gate) * up)
    g64, u64 = gate.double(), up.double()
    torch.testing.assert_close(out.double(), g64 * torch.sigmoid(g64) * u64, atol=3e-2, rtol=1.6e-2)
    assert torch.equal(SiluAndMul()(x), out)   # the layer takes the native kernel


def test_silu_and_mul_at_the_extremes():
    """Gates far below the exp approximation's range give -0 (torch's sigmoid underflows there), -inf gives NaN,
    large positive gates pass through; against torch's bfloat16 SiLU-and-mul, NaN for NaN."""
    gate = torch.tensor([-3e38, -1e4, -120.0, -100.0, -float("inf"), float("inf"), 1e4, 3.0, -3.0, 0.0,
                         float("nan"), 88.0, -1e-30, 1e-30, 20.0, -20.0], dtype=BF16)
    up = torch.tensor([88.0, 3e38, 1.0, -2.0, 1.0, 1.0, 2.0, -1.0, 5.0, 7.0, 1.0, 3e38, 1.0, 1.0, 1.0, 1.0], dtype=BF16)
    out = cpu_native.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
    want = (F.silu(gate.float()) * up.float()).to(BF16)
    assert torch.equal(out.isnan(), want.isnan())
    torch.testing.assert_close(out[~want.isnan()].float(), want[~want.isnan()].float(), rtol=8e-3, atol=0)


@pytest.mark.parametrize("tokens,d", [(3, 64), (300, 64), (50, 128)])
def test_rotary_rounds_as_its_formula(tokens, d, gen):
    """bfloat16 rotary (its 16-lane path for these head sizes) is bit for bit the formula it implements: each
    product of a bfloat16 value and a cos/sin entry rounded to bfloat16, the pair's sum rounded again."""
    hq, hk = 9, 3
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d, generator=gen) * 4).to(BF16)
    qkv[0, :8] = torch.tensor([0.0, -0.0, 3e38, -3e38, 1e-30, -1e-30, 7.0, -0.5])
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
    cos = torch.randn(tokens, d, generator=gen).to(BF16)
    sin = torch.randn(tokens, d, generator=gen).to(BF16)

    def formula(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
        c1, c2 = cos[:, None, : d // 2].float(), cos[:, None, d // 2:].float()
        s1, s2 = sin[:, None, : d // 2].float(), sin[:, None, d // 2:].float()
        r = lambda v: v.to(BF16).float()   # noqa: E731
        return torch.cat(((r(x1 * c1) + r(-x2 * s1)).to(BF16), (r(x2 * c2) + r(x1 * s2)).to(BF16)), dim=-1)

    q_want, k_want = formula(q), formula(k)
    ops.rotary_(q, k, cos, sin)
    for got, want in ((q, q_want), (k, k_want)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.parametrize("tokens,hq,hk,d,rot", [(1, 9, 3, 64, 64), (6, 4, 2, 32, 16), (40, 8, 8, 128, 128)])
def test_rotary_in_place_on_fused_qkv(tokens, hq, hk, d, rot, gen):
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(BF16)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    pos = torch.randint(0, 4096, (tokens,), generator=gen).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q64, k64 = q.double(), k.double()
    ops.rotary_(q, k, cos, sin)
    assert_matches_reference(q, q_ref)
    assert_matches_reference(k, k_ref)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)           # v untouched
    for x64, out in ((q64, q), (k64, k)):
        x1, x2 = x64[..., : rot // 2], x64[..., rot // 2: rot]
        c, s = cos.double()[:, None, : rot // 2], sin.double()[:, None, : rot // 2]
        exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x64[..., rot:]), dim=-1)
        torch.testing.assert_close(out.double(), exact, atol=5e-2, rtol=1.6e-2)


@pytest.mark.parametrize("m,n,k", [(1, 300, 576), (3, 77, 64), (9, 64, 1536)])
def test_q8_0_matmul_against_gguf_dequantization(m, n, k):
    rng = np.random.default_rng(m * 1000 + n)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)           # [N, K / 32 * 34]
    w_file = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)   # the weights the file holds
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(BF16)
    out = cpu_native.q8_0_matmul(x, torch.from_numpy(blocks), n)
    exact = x.double() @ torch.from_numpy(w_file).double().T
    assert out.dtype == BF16 and out.shape == (m, n)
    # float32 accumulation, one rounding to bfloat16 at the end
    torch.testing.assert_close(out.double(), exact, atol=2e-3 * exact.abs().max().item(), rtol=8e-3)
    # float32 out: the same sums unrounded (float32 summation error only), and bfloat16 is their rounding
    out32 = cpu_native.q8_0_matmul(x, torch.from_numpy(blocks), n, torch.float32)
    assert out32.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ torch.from_numpy(w_file).double().abs().T)
    assert bool(((out32.double() - exact).abs() <= bound).all())
    assert torch.equal(out32.to(BF16), out)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cpu_native.q8_0_matmul(x, torch.from_numpy(blocks), n, torch.float16)
    # float32 inputs are used as they are (a float32 model's LM head), also rows of a wider tensor
    wide = torch.from_numpy(rng.standard_normal((m, k + 40)).astype(np.float32))
    for xf in (wide[:, :k].contiguous(), wide[:, 40:]):
        got = cpu_native.q8_0_matmul(xf, torch.from_numpy(blocks), n, torch.float32)
        exact32 = xf.double() @ torch.from_numpy(w_file).double().T
        bound = 1e-5 * (xf.double().abs() @ torch.from_numpy(w_file).double().abs().T)
        assert got.dtype == torch.float32 and bool(((got.double() - exact32).abs() <= bound).all())
    with pytest.raises(ValueError, match="inputs"):
        cpu_native.q8_0_matmul(x.half(), torch.from_numpy(blocks), n, torch.float32)


def test_prompt_logprobs_with_and_without_native_ops(tiny_llama_dir, monkeypatch):
    """A bfloat16 model scores the same prompt alike with the native ops and with the torch code."""
    from plinth import LLM, SamplingParams

    prompt = [[5, 17, 99, 3, 250, 41, 7, 7, 212, 64, 33, 2]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def score() -> list[float]:
        with LLM(str(tiny_llama_dir), dtype="bfloat16", selection="off") as llm:
            out = llm.generate(prompt, params, use_tqdm=False)[0]
        return [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]

    native = score()
    cpu_native._env_enabled.cache_clear()
    monkeypatch.setenv(cpu_native.NATIVE_OPS_ENV, "0")
    try:
        reference = score()
    finally:
        monkeypatch.undo()
        cpu_native._env_enabled.cache_clear()
    assert len(native) == len(reference) == len(prompt[0]) - 1
    np.testing.assert_allclose(native, reference, atol=0.05)


@pytest.mark.parametrize("tied", [True, False])
@needs_packed_bf16
def test_q8_0_lm_head_of_a_gguf_model(tmp_path, monkeypatch, tied, tiny_llama_dir):
    """A GGUF file's Q8_0 LM head (or tied embedding) serves decode rows with the file's exact values."""
    from test_gguf import small_model, write_gguf

    from plinth import LLM

    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", tied), "llama", gguf.GGMLQuantizationType.Q8_0)
    with LLM(path, tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4, selection="off") as llm:
        head = llm.engine.runner.model.lm_head
        method = head.gemm.__self__
        # on AMX tiles the GEMV keeps one row and the regrouped blocks take the rest (no bfloat16 copy packed)
        amx = cpu_native.q8_amx_supported()
        assert method.q8_0 is not None and method.q8_0_max_rows == (1 if amx else 4)
        assert (method.q8_panels is not None) == amx and (method.packed is None or not amx)
        w_file = torch.from_numpy(gguf.quants.dequantize(method.q8_0.numpy(), gguf.GGMLQuantizationType.Q8_0))
        gen = torch.Generator().manual_seed(1)
        for m in (1, 4, 6):       # 6 rows: past the switch-over, the prepacked bfloat16 weight (or AMX tiles)
            x = torch.randn(m, 64, generator=gen).to(BF16)
            got = head(x)
            exact = x.double() @ w_file.double().T
            torch.testing.assert_close(got.double(), exact, atol=0.02 * float(exact.abs().max()), rtol=0)
            if m <= method.q8_0_max_rows:   # the logits in float32 (the kernel's sums unrounded)
                assert got.dtype == torch.float32
                assert torch.equal(got, cpu_native.q8_0_matmul(x, method.q8_0, w_file.shape[0], torch.float32))
            elif amx:
                assert got.dtype == torch.float32
                assert torch.equal(got, cpu_native.q8_panel_matmul(x, method.q8_panels))
            # the compiled path's custom op: its fake (what a traced graph expects) has the real output's dtype
            from plinth.worker.cpu_linear import _cpu_linear_fake, cpu_linear_op
            real = cpu_linear_op(x, method.handle, method.out_features)
            with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
                fake = _cpu_linear_fake(mode.from_tensor(x), method.handle, method.out_features)
            assert fake.dtype == real.dtype == got.dtype and tuple(fake.shape) == tuple(real.shape)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("tokens", [5, 700])   # 700: a prompt's rows, keys and values written by two threads
def test_kv_write_equals_index_copy(dtype, tokens, gen):
    blocks = 6 if tokens <= 24 else -(-tokens // 4) + 8
    cache = torch.randn(2, blocks, 4, 3, 8, generator=gen).to(dtype)     # [2, blocks, block_size, Hkv, D]
    qkv = torch.randn(tokens, (4 + 2 * 3) * 8, generator=gen).to(dtype)  # keys/values as views of a fused output
    key = qkv[:, 32:56].view(tokens, 3, 8)
    value = qkv[:, 56:].view(tokens, 3, 8)
    slots = torch.tensor([7, 0, 23, 12, 5]) if tokens == 5 else torch.randperm(blocks * 4, generator=gen)[:tokens]
    expected = cache.clone()
    flat = expected.view(2, -1, 3, 8)                                     # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)
    assert cpu_native.kv_write_supported(key, value, cache)
    cpu_native.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 -march values")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_portable_build_agrees_with_the_native_build(monkeypatch, gen, march):
    """``PLINTH_CPU_MARCH=x86-64-v2`` builds the kernels without AVX (the scalar paths other CPUs run),
    ``x86-64-v3`` with AVX2/FMA/F16C but no AVX512 (the 8-lane Q8_0 GEMV): the same results as this
    machine's build, up to float32 summation order."""
    flags = open("/proc/cpuinfo").read()
    if march == "x86-64-v3" and not all(f in flags for f in ("avx2", "fma", "f16c", "bmi2", "movbe")):
        pytest.skip("this CPU cannot run x86-64-v3 code")
    from plinth.attention_backends import cpu_paged_build
    from plinth.attention_backends.cpu_paged import paged_decode

    x = torch.randn(3, 576, generator=gen).to(BF16)
    w = (torch.randn(576, generator=gen) * 0.2 + 1).to(BF16)
    gu = (torch.randn(3, 2 * 200, generator=gen) * 3).to(BF16)
    rng = np.random.default_rng(5)
    blocks = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((64, 576)).astype(np.float32) * 0.05,
                                                   gguf.GGMLQuantizationType.Q8_0))
    q = torch.randn(4, 6, 64, generator=gen).to(BF16)
    cache = torch.randn(2, 9, 16, 2, 64, generator=gen).to(BF16)
    tables = torch.tensor([[1, 2], [3, 0], [4, 5], [6, 7]], dtype=torch.int32)
    lens = torch.tensor([20, 9, 32, 17], dtype=torch.int32)
    starts = torch.arange(5, dtype=torch.int32)

    from plinth.worker.cpu_int4 import decode_q4_blocks

    q4, q4_scale, q4_zero = decode_q4_blocks(gguf.quants.quantize(
        rng.standard_normal((40, 576)).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q4_1), "Q4_1")
    q4_panels = cpu_native.pack_q4_panels(q4, q4_scale, q4_zero - 8 * q4_scale)

    def outputs():
        gemv_f32 = (cpu_native.Q4GemvF32(q4_panels)(x.float()) if cpu_native.q4_gemv_f32_supported()
                    else None)   # the float32 GEMV where the build has AVX2/FMA/F16C
        return (ops.rms_norm(x, w, 1e-5), ops.silu_and_mul(gu), cpu_native.q8_0_matmul(x, blocks, 64),
                cpu_native.q8_0_matmul(x.float(), blocks, 64, torch.float32),
                paged_decode(q, cache, tables, lens, starts, 4, 0.125), gemv_f32)

    native_path = cpu_native.load_library().path
    native = outputs()
    monkeypatch.setenv("PLINTH_CPU_MARCH", march)
    cpu_native.load_library.cache_clear()
    cpu_native.q4_gemv_f32_supported.cache_clear()
    cpu_paged_build.load_kernel.cache_clear()
    try:
        build = cpu_native.load_library()
        assert build.library is not None and build.path != native_path, build.reason
        portable = outputs()
        cpu_native.vnni_supported.cache_clear()
        assert not cpu_native.vnni_supported()     # no AVX512-VNNI in this build: the 8-bit GEMM says so
    finally:
        monkeypatch.undo()
        cpu_native.load_library.cache_clear()
        cpu_native.vnni_supported.cache_clear()
        cpu_native.q4_gemv_f32_supported.cache_clear()
        cpu_paged_build.load_kernel.cache_clear()
    for a, b in zip(native[:2], portable[:2], strict=True):
        assert int(ulps(a, b).max()) <= 1
    for a, b in zip(native[2:], portable[2:], strict=True):
        if a is None or b is None:   # the float32 GEMV: only in builds with AVX2 (x86-64-v3, most native ones)
            assert b is None or a is not None
            continue
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)
    assert (portable[-1] is None) == (march == "x86-64-v2")


def test_malformed_march_is_a_build_failure_with_a_reason(monkeypatch, tmp_path):
    from plinth.kernels.native_build import build_and_open

    monkeypatch.setenv("PLINTH_CPU_MARCH", "native; rm -rf /")
    build = build_and_open(cpu_native.SOURCE, "cpu_ops_test", "plinth_cpu_ops_abi", 1, "test")
    assert build.library is None and "PLINTH_CPU_MARCH" in build.reason
    # an engine's configuration refuses it first, naming the variable
    from plinth.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="PLINTH_CPU_MARCH='native; rm -rf /' is not a -march value"):
        EngineConfig.from_kwargs()
    monkeypatch.setenv("PLINTH_CPU_MARCH", "x86-64-v2")
    assert EngineConfig.from_kwargs() is not None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (2, 17, 96), (3, 17, 96), (4, 96, 576), (7, 50, 1536),
                                   (16, 33, 128)])
def test_q4_panel_gemv_f32_against_gguf_dequantization(qtype, m, n, k):
    """The float32 panel GEMV (AVX2/FMA): the file's 4-bit weights (``d q + c`` in float32, not rounded) times
    float32 rows as they are, float32 sums; column counts that are not a multiple of 16, strided rows; a row alone
    gives the bits it gets within a batch."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    if not cpu_native.q4_gemv_f32_supported():
        pytest.skip("the native kernels were not built with AVX2/FMA/F16C")
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(m * 100 + n)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    w_file = torch.from_numpy(gguf.quants.dequantize(raw, gtype)).double()
    q, scale, zero = decode_q4_blocks(raw, qtype)
    gemv = cpu_native.Q4GemvF32(cpu_native.pack_q4_panels(q, scale, zero - 8 * scale))
    wide = torch.from_numpy(rng.standard_normal((m, k + 8)).astype(np.float32))
    for x in (wide[:, :k].contiguous(), wide[:, 8:]):
        y = gemv(x)
        want = x.double() @ w_file.T
        bound = 1e-5 * (x.double().abs() @ w_file.abs().T) + 1e-7
        assert y.dtype == torch.float32 and y.shape == (m, n) and bool(((y.double() - want).abs() <= bound).all())
        for r in {0, m - 1}:
            assert torch.equal(gemv(x[r:r + 1]), y[r:r + 1])
    with pytest.raises(ValueError, match="float32 panel GEMV"):
        gemv(wide[:, :k].contiguous().bfloat16())
    with pytest.raises(ValueError, match="float32 panel GEMV"):
        gemv(torch.zeros(17, k))


def int8_rows(x: torch.Tensor, planes: int = 1) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 as the 8-bit-input kernels see it, in float64: per row and 32 features the
    codes ``q = round_half_even(t)``, ``t = x * (127 / max |x|)`` (float32 arithmetic), times the scale
    ``max |x| / 127``; with two planes (the Q8_0 head) ``q + round_half_even((t - q) * 128) / 128``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    t = blocks * inv
    codes = torch.round(t).double()                                     # torch.round: half to even
    if planes == 2:
        codes = codes + torch.round((t - torch.round(t)) * 128).double() / 128
    return (codes * (top / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (2, 17, 96), (4, 96, 576), (7, 50, 1536), (16, 33, 128),
                                   (33, 24, 64), (70, 17, 96)])
def test_q4_panel_gemm_f32_with_int8_inputs(qtype, m, n, k):
    """``Q4GemmF32Q8`` (AVX2 vpmaddubsw): the file's 4-bit weights times the rows quantized to int8 per 32
    features, i.e. exactly the product with the dequantized rows up to float32 summation, for any row count
    (blocks of 64 rows); an all-zero block stays zero; a row alone (the one-row kernel) gives the same bits as within
    a batch (the kernel of several rows); against the float32 rows the change is the 8-bit rounding of the inputs
    only."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    if not cpu_native.q4_gemv_f32_supported():
        pytest.skip("the native kernels were not built with AVX2/FMA/F16C")
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(m * 100 + n + 7)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    w_file = torch.from_numpy(gguf.quants.dequantize(raw, gtype)).double()
    q, scale, zero = decode_q4_blocks(raw, qtype)
    panels = cpu_native.pack_q4_panels(q, scale, zero - 8 * scale)
    gemv = cpu_native.Q4GemmF32Q8(panels)
    # its copy of the codes: every 32 bytes of the panels' gathered by QUAD_ORDER
    order = torch.tensor(cpu_native.QUAD_ORDER)
    assert sorted(cpu_native.QUAD_ORDER) == list(range(32))
    assert torch.equal(gemv.quad_codes, panels.codes.reshape(-1, 32)[:, order].reshape(panels.codes.shape))
    wide = torch.from_numpy(rng.standard_normal((m, k + 8)).astype(np.float32) * 3)
    wide[0, 8:40] = 0.0                                              # one all-zero block
    for x in (wide[:, :k].contiguous(), wide[:, 8:]):
        y = gemv(x)
        xd = int8_rows(x.contiguous())
        want = xd @ w_file.T
        bound = 1e-5 * (xd.abs() @ w_file.abs().T) + 1e-7
        assert y.dtype == torch.float32 and y.shape == (m, n) and bool(((y.double() - want).abs() <= bound).all())
        for r in {0, m - 1}:
            assert torch.equal(gemv(x[r:r + 1]), y[r:r + 1])
        # the 8-bit inputs do change the result, by their rounding (at most half a step per feature)
        exact = x.double() @ w_file.T
        step = (x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 127).expand(m, k // 32, 32).reshape(m, k)
        assert not torch.equal(y[:16], cpu_native.Q4GemvF32(panels)(x[:16]))
        assert bool(((y.double() - exact).abs() <= (step.double() / 2) @ w_file.abs().T + bound).all())
    with pytest.raises(ValueError, match="8-bit inputs"):
        gemv(torch.zeros(3, k, dtype=torch.bfloat16))


def test_int8_input_kernels_at_their_limits():
    """The 8-bit-input kernels at the ends of their ranges: every 4-bit code 15 against full-scale inputs (the
    int16 block sums at their bound, 8 x 2 x 15 x 127), Q8_0 codes of -128 against -127 inputs, and a NaN or an
    infinity in one block of a row: that row's outputs are NaN (as the float32 product's), the other rows'
    finite."""
    if not cpu_native.q4_gemv_f32_supported() or not cpu_native.q8_0_int8_supported():
        pytest.skip("the native kernels were not built with AVX2/FMA/F16C")
    n, k = 32, 256
    scale = torch.full((n, k // 32), 0.0625)
    panels = cpu_native.pack_q4_panels(torch.full((n, k), 15, dtype=torch.int32), scale, torch.zeros(n, k // 32))
    gemm = cpu_native.Q4GemmF32Q8(panels)
    x = torch.full((3, k), 2.5)                                             # codes 127, scale 2.5 / 127
    torch.testing.assert_close(gemm(x), torch.full((3, n), 15 * 0.0625 * 2.5 * k), rtol=1e-6, atol=0)
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = np.uint8(0x80)                                       # code -128 everywhere
    blocks = torch.from_numpy(blocks.reshape(n, -1))
    y = cpu_native.q8_0_matmul(-x[:2], blocks, n, torch.float32, int8_inputs=True)
    torch.testing.assert_close(y, torch.full((2, n), 64.0 * 2.5 * k), rtol=1e-6, atol=0)   # -128 * 0.5 * -2.5 each
    for bad in (float("nan"), float("inf"), float("-inf")):
        rows = torch.randn(3, k)
        rows[1, 40] = bad
        for out in (gemm(rows), cpu_native.q8_0_matmul(rows[:2], blocks, n, torch.float32, int8_inputs=True)):
            assert bool(out[1].isnan().all()) and bool(out[0].isfinite().all()), (bad, out)


def q8_0_file_weight(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, torch.Tensor]:
    """A random ``[n, k]`` weight as GGUF ``Q8_0`` blocks (by gguf's own quantizer), with extreme codes -128 and 127
    in its first block (the file's d stays), and the blocks' dequantized values in float64."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    codes = blocks.reshape(n, k // 32, 34)[:, :, 2:].view(np.int8)
    codes[0, 0, :4] = [-128, 127, -128, 127]
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)).double()


@pytest.mark.parametrize("m,n,k", [(1, 300, 576), (3, 77, 64), (6, 64, 1536)])
def test_q8_0_matmul_with_int8_inputs(m, n, k):
    """The Q8_0 GEMV's 8-bit-input path (AVX2: vpmaddubsw on |q| and the inputs with q's signs, in two planes:
    the codes and their rounding in 1/128 steps): the file's weights times the dequantized rows up to float32
    summation, incl. codes of -128 and 127 at full scale; ~100x closer to the float32 rows than one plane."""
    if not cpu_native.q8_0_int8_supported():
        pytest.skip("the native kernels were not built with AVX2")
    rng = np.random.default_rng(m * 10 + n)
    blocks, w_file = q8_0_file_weight(rng, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[0, :32] = torch.tensor([127.0, -127.0] * 16)                   # a block of full-scale codes
    y = cpu_native.q8_0_matmul(x, torch.from_numpy(blocks), n, torch.float32, int8_inputs=True)
    xd = int8_rows(x, planes=2)
    want = xd @ w_file.T
    bound = 1e-5 * (xd.abs() @ w_file.abs().T) + 1e-7
    assert y.dtype == torch.float32 and bool(((y.double() - want).abs() <= bound).all())
    exact = x.double() @ w_file.T
    one_plane = int8_rows(x) @ w_file.T
    assert (y.double() - exact).abs().max() * 30 < (one_plane - exact).abs().max()
    assert not torch.equal(y, cpu_native.q8_0_matmul(x, torch.from_numpy(blocks), n, torch.float32))
    with pytest.raises(ValueError, match="8-bit inputs from float32"):
        cpu_native.q8_0_matmul(x.bfloat16(), torch.from_numpy(blocks), n, torch.float32, int8_inputs=True)


@pytest.mark.parametrize("m,n,k", [(1, 300, 576), (5, 77, 64), (8, 64, 1536), (11, 9, 96), (13, 77, 576),
                                   (9, 24, 64), (40, 300, 96)])
def test_q8_0_regrouped_matmul_in_float32(m, n, k):
    """The regrouped Q8_0 blocks times float32 rows in float32 (AVX2): the file's weights d q exactly, float32
    sums, for 1-8 rows (8 per pass over a tile and a remainder) and 9-40 rows (pairs of tiles expanded to a float32
    panel, 6 rows per pass and a remainder; an odd tile count leaves a pair half empty), N not a multiple of 8 (a
    padded tile). A row alone (the tile passes) gives the same bits as within the batch."""
    if not cpu_native.q8_0_int8_supported():
        pytest.skip("the native kernels were not built with AVX2")
    rng = np.random.default_rng(m * 100 + n)
    blocks, w_file = q8_0_file_weight(rng, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    rows8 = cpu_native.pack_q8_0_rows8(torch.from_numpy(blocks))
    y = cpu_native.q8_0_rows8_matmul(x, rows8, n)
    want = x.double() @ w_file.T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - want).abs() <= 1e-5 * (x.double().abs() @ w_file.abs().T) + 1e-7).all())
    strided = torch.cat([x, x], 1)[:, :k]                              # a row stride of 2 k
    assert torch.equal(cpu_native.q8_0_rows8_matmul(strided, rows8, n), y)
    assert torch.equal(cpu_native.q8_0_rows8_matmul(x[-1:], rows8, n), y[-1:])   # a row's result whatever the batch
    bad = x.clone()
    bad[0, 3] = float("nan")
    got = cpu_native.q8_0_rows8_matmul(bad, rows8, n)
    assert bool(got[0].isnan().all()) and torch.equal(got[1:], y[1:])
    with pytest.raises(ValueError, match="float32 rows"):
        cpu_native.q8_0_rows8_matmul(x.bfloat16(), rows8, n)
    with pytest.raises(ValueError, match="regrouped Q8_0 layout"):
        cpu_native.q8_0_rows8_matmul(x, rows8[:-1].contiguous(), n)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (5, 17, 96), (8, 96, 576), (33, 50, 128), (70, 32, 64)])
def test_q4_panel_matmul_against_gguf_dequantization(qtype, m, n, k):
    """The panel GEMM multiplies the file's 4-bit weights (bf16-rounded, as the model's dequantized weights)."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(m * 100 + n)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    w_file = torch.from_numpy(gguf.quants.dequantize(raw, gtype))
    q, scale, zero = decode_q4_blocks(raw, qtype)
    panels = cpu_native.pack_q4_panels(q, scale, zero - 8 * scale)   # the int4 copies' (scale, zero) -> w = d q + c
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(BF16)
    if not cpu_native.q4_panels_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    out = cpu_native.q4_panel_matmul(x, panels)
    exact = x.double() @ w_file.to(BF16).double().T
    assert out.shape == (m, n) and out.dtype == BF16
    torch.testing.assert_close(out.double(), exact, atol=2e-3 * float(exact.abs().max()), rtol=8e-3)



@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (9, 40, 64), (16, 48, 96), (17, 17, 576), (32, 96, 128),
                                   (33, 50, 64), (100, 32, 1536), (500, 80, 64)])
def test_q4_panel_matmul_on_amx_tiles(m, n, k):
    """The AMX panel GEMM multiplies the same bfloat16-rounded weights as the AVX512-BF16 one: against a float64
    product of those weights up to float32 summation and the output's bfloat16 rounding, and within one bfloat16
    step of the AVX512 kernel (summation order only); row counts around the 16-row tiles and the 32-row chunks,
    odd tile counts, inputs with a wider row stride."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    if not cpu_native.q4_amx_supported():
        pytest.skip("this CPU has no AMX-BF16 (or the kernel refused the tile state)")
    rng = np.random.default_rng(m * 1000 + n + k)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q4_1)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).to(BF16)
    q, scale, zero = decode_q4_blocks(raw, "Q4_1")
    panels = cpu_native.pack_q4_panels(q, scale, zero - 8 * scale)
    wide = torch.from_numpy(rng.standard_normal((m, k + 32)).astype(np.float32)).to(BF16)
    x = wide[:, 16:16 + k]                       # row stride k + 32
    out = cpu_native.q4_panel_matmul(x, panels, amx=True)
    exact = x.double() @ w.double().T
    assert out.shape == (m, n) and out.dtype == BF16
    bound = 1e-5 * float((x.double().abs() @ w.double().abs().T).max())
    torch.testing.assert_close(out.double(), exact, atol=bound, rtol=2 ** -8)
    avx512 = cpu_native.q4_panel_matmul(x.contiguous(), panels, amx=False)
    torch.testing.assert_close(out.double(), avx512.double(), atol=bound, rtol=2 ** -7)


def test_panel_expansion_is_the_bfloat16_rounding_of_the_float32_weights():
    """The panel GEMMs' expanded weights, read back through an identity input, are exactly ``d q + c`` in float32
    (exact product, one rounding for the add) rounded to bfloat16: Q4_1 offsets near zero, where an offset folded
    with ``128 d`` would lose bits, Q4_0's ``-8 d``, and random float16 scales."""
    if not cpu_native.q4_panels_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(7)
    n, k = 48, 64
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    near_zero = (torch.randn(16, k // 32, generator=gen) * 1e-5).half().float()
    c = torch.cat([near_zero, -8 * d[16:32], (torch.randn(16, k // 32, generator=gen) * 0.05).half().float()])
    panels = cpu_native.pack_q4_panels(q, d, c)
    want = (q.float() * d.repeat_interleave(32, 1) + c.repeat_interleave(32, 1)).to(BF16)
    eye = torch.eye(k, dtype=BF16)
    for amx in (False, True) if cpu_native.q4_amx_supported() else (False,):
        assert torch.equal(cpu_native.q4_panel_matmul(eye, panels, amx=amx).t(), want), amx


@pytest.mark.parametrize("m,inter,k", [(1, 16, 32), (9, 48, 64), (16, 1536, 576), (17, 32, 1536), (33, 64, 128),
                                       (100, 80, 64)])
def test_fused_gate_up_activation_equals_the_gemm_then_the_activation(m, inter, k):
    """The AMX gate/up GEMM with SiLU-and-mul applied to its tiles' sums gives the bits of the panel GEMM followed by
    the native activation: gates of every sign and size (below -87 the sigmoid is 0), row counts around the 16-row
    tiles and 32-row chunks, odd tile counts per half; a weight whose halves are not whole tiles is refused."""
    if not cpu_native.q4_amx_supported():
        pytest.skip("this CPU has no AMX-BF16 (or the kernel refused the tile state)")
    gen = torch.Generator().manual_seed(m * 7 + inter + k)
    q = torch.randint(0, 16, (2 * inter, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(2 * inter, k // 32, generator=gen) * 0.05
    panels = cpu_native.pack_q4_panels(q, scale, -8 * scale + torch.randn(2 * inter, k // 32, generator=gen) * 0.02)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 2, m).unsqueeze(1)).to(BF16)
    gate_up = cpu_native.q4_panel_matmul(x, panels, amx=True)
    assert (gate_up[:, :inter].float() < -87).any() or m < 9     # the underflowing sigmoid is reached
    fused = cpu_native.q4_panel_silu_mul(x, panels)
    assert fused.shape == (m, inter) and fused.dtype == BF16
    assert torch.equal(fused, cpu_native.silu_and_mul(gate_up))
    # gates at the bottom of float32's normal range (1.2e-38 .. 1e-37), so that g sig(g) and the product fall below it
    # (subnormal): the activation keeps them as the scalar loop does. An identity-like weight: gate row i picks input
    # feature i mod (K - 1), every up row the last feature (values near 1)
    eye = torch.zeros(2 * inter, k, dtype=torch.int32)
    eye[torch.arange(inter), torch.arange(inter) % (k - 1)] = 1
    eye[inter:, k - 1] = 1
    identity = cpu_native.pack_q4_panels(eye, torch.ones(2 * inter, k // 32), torch.zeros(2 * inter, k // 32))
    rows = max(m, 9)
    tiny = torch.rand(rows, k, generator=gen) * 9e-38 + 1.2e-38
    tiny[:, k - 1] = torch.rand(rows, generator=gen) * 2 + 0.5
    tiny = tiny.to(BF16)
    want = cpu_native.silu_and_mul(cpu_native.q4_panel_matmul(tiny, identity, amx=True))
    assert (want.float().abs() < 1.17e-38).any() and (want.float() != 0).all()
    assert torch.equal(cpu_native.q4_panel_silu_mul(tiny, identity), want)
    odd = cpu_native.pack_q4_panels(torch.zeros(48, k, dtype=torch.int32), torch.ones(48, k // 32),
                                    torch.zeros(48, k // 32))   # halves of 24 columns
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_native.q4_panel_silu_mul(x, odd)


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (2, 17, 64), (5, 300, 576), (16, 48, 96), (17, 50, 128),
                                   (32, 96, 576), (33, 40, 64), (70, 112, 128)])
def test_q8_panel_matmul_on_amx_tiles(m, n, k):
    """The Q8_0 AMX GEMM (an LM head's rows past the GEMV's) multiplies the file's weights rounded to bfloat16, as
    the bfloat16 weight a GGUF loader converts them to: against a float64 product of those weights up to float32
    summation (float32 out, unrounded); row counts around the 16-row tiles and 32-row chunks, output counts that are
    not whole tiles or pairs, inputs with a wider row stride."""
    if not cpu_native.q8_amx_supported():
        pytest.skip("this CPU has no AMX-BF16 (or the kernel refused the tile state)")
    rng = np.random.default_rng(m * 1000 + n + k)
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                  gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)).to(BF16)
    panels = cpu_native.pack_q8_panels(torch.from_numpy(blocks))
    assert panels.out_features == n and panels.in_features == k
    wide = torch.from_numpy(rng.standard_normal((m, k + 32)).astype(np.float32)).to(BF16)
    x = wide[:, 16:16 + k]                       # row stride k + 32
    out = cpu_native.q8_panel_matmul(x, panels)
    exact = x.double() @ w.double().T
    assert out.shape == (m, n) and out.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert bool(((out.double() - exact).abs() <= bound).all())
    # the expanded weights, read back through an identity input: exactly the file's d q rounded to bfloat16
    assert torch.equal(cpu_native.q8_panel_matmul(torch.eye(k, dtype=BF16), panels).t().to(BF16), w)
    with pytest.raises(ValueError, match="bfloat16 inputs"):
        cpu_native.q8_panel_matmul(x.float(), panels)
    with pytest.raises(ValueError, match="bfloat16 inputs"):
        cpu_native.q8_panel_matmul(x[:, :32].contiguous() if k > 32 else wide, panels)


def test_amx_is_routed_only_where_it_runs(monkeypatch):
    """``PLINTH_CPU_AMX=0`` turns the AMX GEMM off; ``amx=True`` on a CPU without it is a clear error."""
    panels = cpu_native.pack_q4_panels(torch.zeros(16, 32, dtype=torch.int32), torch.ones(16, 1), torch.zeros(16, 1))
    monkeypatch.setenv(cpu_native.AMX_ENV, "0")
    cpu_native.q4_amx_supported.cache_clear()
    try:
        assert not cpu_native.q4_amx_supported()
        assert cpu_native.q4_gemv_max_rows() == cpu_native.Q4_GEMV_MAX_ROWS
    finally:
        monkeypatch.delenv(cpu_native.AMX_ENV)
        cpu_native.q4_amx_supported.cache_clear()
    if not cpu_native._amx_ready():
        assert not cpu_native.q4_amx_supported()
        with pytest.raises(RuntimeError, match="AMX"):
            cpu_native.q4_panel_matmul(torch.zeros(1, 32, dtype=BF16), panels, amx=True)
    else:
        assert cpu_native.q4_gemv_max_rows() == cpu_native.Q4_GEMV_AMX_MAX_ROWS


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (2, 17, 96), (3, 96, 576), (4, 50, 32), (1, 576, 1536),
                                   (7, 33, 64), (12, 64, 576)])
def test_q4_panel_gemv_against_float64(qtype, m, n, k):
    """The panel GEMV multiplies the file's exact 4-bit weights (``d q + c`` in float32, no bfloat16 rounding of
    the weights): a float64 product agrees up to the output's bfloat16 rounding and float32 summation (the
    ``128 + q`` operands cancel against the block sums, bounded here by 1e-4 of ``|x| @ |w|``); inputs with a
    row stride wider than ``K`` and outputs not a multiple of 16 included."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    if not cpu_native.q4_gemv_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(m * 1000 + n + k)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    w_file = torch.from_numpy(gguf.quants.dequantize(raw, gtype)).double()
    q, scale, zero = decode_q4_blocks(raw, qtype)
    panels = cpu_native.pack_q4_panels(q, scale, zero - 8 * scale)
    wide = torch.from_numpy(rng.standard_normal((m, k + 24)).astype(np.float32) * 3).to(BF16)
    x = wide[:, 5:5 + k]                                             # row stride k + 24, features contiguous
    out = cpu_native.Q4Gemv(panels)(x)
    exact = x.double() @ w_file.T
    bound = 2.0 ** -8 * exact.abs() + 1e-4 * (x.double().abs() @ w_file.abs().T)
    assert out.shape == (m, n) and out.dtype == BF16
    assert bool(((out.double() - exact).abs() <= bound).all()), float(((out.double() - exact).abs() - bound).max())
    # the same numbers as the panel GEMM, whose weights are rounded to bfloat16 first
    torch.testing.assert_close(out.double(), cpu_native.q4_panel_matmul(x.contiguous(), panels).double(),
                               atol=4e-3 * float(exact.abs().max()), rtol=1.6e-2)


def test_q4_panel_gemv_rejects_shapes_it_does_not_take():
    if not cpu_native.q4_gemv_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    panels = cpu_native.pack_q4_panels(torch.zeros(16, 64, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2))
    gemv = cpu_native.Q4Gemv(panels)
    for bad in (torch.zeros(cpu_native.Q4_GEMV_MAX_ROWS + 1, 64, dtype=BF16), torch.zeros(1, 32, dtype=BF16),
                torch.zeros(1, 64),
                torch.zeros(1, 128, dtype=BF16)[:, ::2]):
        with pytest.raises(ValueError, match="panel GEMV takes"):
            gemv(bad)
    assert torch.equal(gemv(torch.ones(1, 64, dtype=BF16)), torch.zeros(1, 16, dtype=BF16))


def test_int4_weight_routes_few_bf16_rows_to_the_gemv():
    """``Int4Weight.matmul``: bfloat16 inputs of up to ``Q4_GEMV_MAX_ROWS`` rows take the native GEMV
    (bit-identical to calling it), more rows torch's int4 kernel (bit-identical to calling that)."""
    from plinth.worker.cpu_linear import INT4_GROUP, Int4Weight

    if not cpu_native.q4_gemv_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.integers(0, 16, (48, 96))).to(torch.int32)
    scale = torch.from_numpy(rng.random((48, 3)).astype(np.float32)) * 0.01
    zero = torch.from_numpy(rng.standard_normal((48, 3)).astype(np.float32)) * 0.01
    weight = Int4Weight.from_blocks(q, scale, zero, BF16)
    assert weight.gemv is not None
    for rows in (1, 4, cpu_native.Q4_GEMV_MAX_ROWS, cpu_native.Q4_GEMV_MAX_ROWS + 1):
        x = torch.from_numpy(rng.standard_normal((rows, 96)).astype(np.float32)).to(BF16)
        torch_int4 = torch._weight_int4pack_mm_for_cpu(x, weight.packed, INT4_GROUP, weight.scale_zeros)
        expect = weight.gemv(x) if rows <= cpu_native.Q4_GEMV_MAX_ROWS else torch_int4
        assert torch.equal(weight.matmul(x), expect)
        torch.testing.assert_close(weight.matmul(x).float(), torch_int4.float(), atol=2e-2, rtol=2e-2)


def _int8_reference(x: torch.Tensor, w_file: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit-input product in float64: ``x`` quantized per row and 32-feature block as the kernel does
    (scale = max |x| / 127 in float32, codes rounded to nearest even), times the file's weights; and the
    magnitude ``|x| @ |w|`` that bounds its float32 summation error."""
    xf = x.float().numpy()                                                    # [M, K] (bf16 values, exact)
    m, k = xf.shape
    blocks = xf.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint((blocks * inv[..., None]).astype(np.float32))           # float32 product, round half even
    xq = (codes.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)[..., None]).reshape(m, k)
    w = w_file.astype(np.float64)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (5, 17, 96), (8, 96, 576), (33, 50, 128), (70, 33, 64)])
def test_vnni_matmul_against_int8_inputs_and_gguf_weights(qtype, m, n, k):
    """The 8-bit-input GEMM multiplies the file's exact weights (Q4: from the panel layout of the int4 copies;
    Q8_0: from the file's blocks) with the inputs quantized per 32-feature block: a float64 computation of
    that quantization agrees up to float32 summation and the final bfloat16 rounding; against the
    unquantized inputs the error is the 8-bit rounding (~1% of the largest output here)."""
    from plinth.worker.cpu_int4 import decode_q4_blocks

    if not cpu_native.vnni_supported():
        pytest.skip("this CPU has no AVX512-VNNI/BF16")
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(m * 100 + n)
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, gtype)
    w_file = gguf.quants.dequantize(raw, gtype)
    if qtype == "Q8_0":
        panels = cpu_native.vnni_from_q8_0(torch.from_numpy(raw), n)
    else:
        q, scale, zero = decode_q4_blocks(raw, qtype)
        panels = cpu_native.vnni_from_q4_panels(cpu_native.pack_q4_panels(q, scale, zero - 8 * scale))
        direct = cpu_native.pack_vnni_panels(q.to(torch.uint8), scale, zero - 8 * scale)
        assert all(torch.equal(getattr(panels, f), getattr(direct, f)) for f in ("codes", "scales", "offsets"))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(BF16)
    x[0, :32] = 0                                                  # an all-zero block: scale 0, no division
    out = cpu_native.vnni_matmul(x, panels)
    assert out.shape == (m, n) and out.dtype == BF16
    ref, magnitude = _int8_reference(x, w_file)
    err = np.abs(out.double().numpy() - ref)
    assert (err <= np.abs(ref) * 2.0 ** -8 + magnitude * 1e-5).all(), float((err - np.abs(ref) * 2.0 ** -8).max())
    exact = x.double().numpy() @ w_file.astype(np.float64).T
    assert np.abs(out.double().numpy() - exact).max() <= 0.03 * np.abs(exact).max()


def test_int8_inputs_switch_on_a_gguf_model(tmp_path, monkeypatch, tiny_llama_dir):
    """``PLINTH_CPU_INT8_ACT=1``: every layer with the file's 4-bit blocks multiplies prefill and decode-batch rows
    (more than the int4 switch-over of 4) with 8-bit inputs; the prompt's scores move by the 8-bit rounding of
    the inputs only, and rows of at most 4 (batch-1 decode) keep the int4 path."""
    from test_gguf import small_model, write_gguf

    from plinth import LLM, SamplingParams
    from plinth.config import ConfigError

    if not cpu_native.vnni_supported():
        pytest.skip("this CPU has no AVX512-VNNI/BF16")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", True), "llama", gguf.GGMLQuantizationType.Q4_1)
    prompt = [[5, 17, 99, 3, 120, 41, 7, 7, 112, 64, 33, 2, 90, 11]]   # the model's vocabulary is 128
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def score(int8: str) -> tuple[list[float], int, list[int]]:
        monkeypatch.setenv("PLINTH_CPU_INT8_ACT", int8)
        with LLM(path, tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4, selection="off") as llm:
            model = llm.engine.runner.model
            methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
            with_vnni = sum(getattr(m, "vnni", None) is not None for m in methods)
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            solo = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
        return [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]], with_vnni, solo

    on, layers_on, tokens_on = score("1")
    off, layers_off, tokens_off = score("0")
    assert layers_on == 2 * 4 and layers_off == 0                  # qkv, o, gate_up, down of both layers
    assert on != off                                               # the 8-bit path really ran
    np.testing.assert_allclose(on, off, atol=0.05)
    assert len(tokens_on) == len(tokens_off) == 6
    monkeypatch.setenv("PLINTH_CPU_INT8_ACT", "sometimes")
    with pytest.raises(ConfigError, match="PLINTH_CPU_INT8_ACT"):
        LLM(path, tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4, selection="off")


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_gguf_dequantize_bit_for_bit(qtype, monkeypatch):
    """The native GGUF expansion against the gguf package's reference, bit for bit: random blocks whose float16
    scales (and Q4_1 offsets) include subnormals, zeros of both signs, infinities and NaN, so that every rounding
    of d q + m and every special value is checked; also through dequantize_tensor with and without the kernel."""
    from plinth.model_registry.gguf_dequant import dequantize_tensor

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, size=(4096, type_size), dtype=np.uint8)
    halves = (2 if qtype == gguf.GGMLQuantizationType.Q4_1 else 1)
    special = np.array([0x0001, 0x03ff, 0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x3c00], dtype=np.uint16)
    for h in range(halves):
        field = blocks[:, 2 * h:2 * h + 2].copy().view(np.uint16)        # [n, 1]
        field[:64, 0] = np.resize(special, 64)
        blocks[:, 2 * h:2 * h + 2] = field.view(np.uint8)
    reference = gguf.quants.dequantize(blocks, qtype).reshape(-1)
    out = torch.full((4096 * block_size,), 7.0)
    assert cpu_native.gguf_dequantize_into(blocks.reshape(-1), int(qtype), out)
    got = out.numpy()
    assert np.array_equal(np.isnan(got), np.isnan(reference))
    assert np.array_equal(got.view(np.uint32)[~np.isnan(got)], reference.view(np.uint32)[~np.isnan(reference)])
    shape = (64, 4096 * block_size // 64)
    rows = blocks.reshape(shape[0], -1)
    native = dequantize_tensor(rows, qtype, shape, torch.float32)
    monkeypatch.setattr(cpu_native, "_env_enabled", lambda: False)   # the torch expansion
    assert not cpu_native.gguf_dequantize_into(blocks.reshape(-1), int(qtype), out)
    torch_path = dequantize_tensor(rows, qtype, shape, torch.float32)
    torch.testing.assert_close(native, torch_path, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(native.reshape(-1), torch.from_numpy(reference), rtol=0, atol=0, equal_nan=True)


def test_gguf_dequantize_rejects_bad_buffers():
    blocks = np.zeros(20 * 3, dtype=np.uint8)
    assert not cpu_native.gguf_dequantize_into(blocks, int(gguf.GGMLQuantizationType.Q4_K), torch.empty(96))
    with pytest.raises(ValueError, match="do not fill"):
        cpu_native.gguf_dequantize_into(blocks, int(gguf.GGMLQuantizationType.Q4_1), torch.empty(95))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.gguf_dequantize_into(blocks, int(gguf.GGMLQuantizationType.Q4_1), torch.empty(192)[::2])
