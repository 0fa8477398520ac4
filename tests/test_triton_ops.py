"""The fused per-layer Triton kernels and the skinny GEMMs, in Triton's CPU interpreter.

float32 and float16 against float64 math (bfloat16 is garbage in the interpreter: the GPU test file
tests/test_triton_ops_gpu.py covers it), the skinny decode paths of the W4A16 kernel with every tile
variant, the per-shape method that routes decode rows, and a whole model whose norms, activations
and rotary embeddings run through the kernels against the same model on its torch path.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available() and os.environ.get("PLINTH_TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: tests/test_triton_ops_gpu.py covers the kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from triton_interpreter import (  # noqa: E402
    import_interpreted,
    interpreter_usable,  # noqa: F401 (read by the skip conditions)
    needs,
    run_in_fresh_process,
    set_interpreter_env,
)

from plinth.kernels import ops  # noqa: E402
from plinth.model_registry.layers.rotary import apply_rotary  # noqa: E402
from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel, interleave_tile  # noqa: E402
from plinth.quantization.quantizers import random_int_weights  # noqa: E402
from plinth.quantization.selection import holder  # noqa: E402
from plinth.worker.gpu_linear import SkinnyChoice, SkinnyLinearMethod  # noqa: E402

INTERPRETED = import_interpreted(lambda: ops.jit_module().rmsnorm_kernel)
needs_interpreter = needs(INTERPRETED)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-3


def test_in_a_fresh_process():
    run_in_fresh_process(__file__, INTERPRETED)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    set_interpreter_env(monkeypatch)


@needs_interpreter
@DTYPES
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 100, generator=g).to(dtype)         # 100: not a power of two (masked lanes)
    r = torch.randn(5, 100, generator=g).to(dtype)
    w = (torch.rand(100, generator=g) + 0.5).to(dtype)
    h = (x + r) if with_residual else x
    ref = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out = ops.rms_norm(x, w, 1e-6, r if with_residual else None)
    if with_residual:
        out, new_residual = out
        assert torch.equal(new_residual, x + r)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=_tol(dtype) * 4, rtol=_tol(dtype) * 4)


@needs_interpreter
@DTYPES
def test_silu_and_mul(dtype):
    x = torch.randn(3, 2 * 200, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x).double(), F.silu(gate) * up, atol=_tol(dtype), rtol=_tol(dtype))


@needs_interpreter
@DTYPES
@pytest.mark.parametrize("heads,rot_dim", [((6, 2), 32), ((4, 4), 24)], ids=["gqa-full", "partial-rotary"])
def test_rotary_in_place(dtype, heads, rot_dim):
    hq, hk = heads
    t, d = 4, 32
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, _v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)              # views of the fused projection, as in a layer
    pos = torch.tensor([0, 3, 17, 250])
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = pos.double()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q = apply_rotary(q.double(), emb.cos(), emb.sin())
    ref_k = apply_rotary(k.double(), emb.cos(), emb.sin())
    ops.rotary_(q, k, emb.cos().to(dtype), emb.sin().to(dtype))
    tol = _tol(dtype) * 8
    torch.testing.assert_close(q.double(), ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.double(), ref_k, atol=tol, rtol=tol)


@needs_interpreter
@DTYPES
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("tiles", [None, ops.SkinnyTiles(16, 64, 2), ops.SkinnyTiles(32, 128, 1)],
                         ids=["default", "split-k", "wide"])
def test_skinny_linear(dtype, m, tiles):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, 256, generator=g).to(dtype)
    w = (torch.randn(72, 256, generator=g) * 0.1).to(dtype)   # 72 columns: a partial last tile
    bias = torch.randn(72, generator=g).to(dtype)
    ref = x.double() @ w.double().T + bias.double()
    out = ops.skinny_linear(x, w, bias, tiles=tiles)
    assert out.shape == (m, 72) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=_tol(dtype) * 20, rtol=_tol(dtype) * 4)


def test_skinny_linear_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="at most 16 rows"):
        ops.skinny_linear(torch.zeros(17, 64), torch.zeros(8, 64))
    with pytest.raises(ValueError, match="not a multiple"):
        ops.skinny_linear(torch.zeros(1, 40), torch.zeros(8, 40))


def _int4(n: int, k: int, group: int, dtype: torch.dtype):
    weights = random_int_weights(n, k, 4, group, symmetric=False, act_order=False, device=torch.device("cpu"),
                                 generator=torch.Generator().manual_seed(4))
    problem = GemmProblem("int", dtype, "cpu", bits=4, group_size=group, shapes=((n, k),))
    kernel = TritonW4A16Kernel(problem)
    return kernel, holder(kernel.prepare(weights)), weights.dequantize(torch.float64)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group,k", [(64, 256), (32, 384), (128, 1024), (1024, 1024)])
@pytest.mark.parametrize("launch", ["", "8,2,2,2", "16,1,4,4"], ids=["default", "split2", "split4"])
def test_w4a16_interleaved_paths(monkeypatch, dtype, m, group, k, launch):
    """One row (the CUDA-core GEMV), up to 16 float16 rows (the tensor-core decode kernel; float32 rows
    take the GEMM) and more rows (the tiled GEMM), all reading one layout, against float64 math on the
    dequantized weight; ``launch`` forces K splits on the two decode kernels."""
    tile = interleave_tile(k, group)
    if launch:
        bn, spans, split, warps = (int(v) for v in launch.split(","))
        if k % (tile * spans * split) or (k // group) % split:
            pytest.skip("the split does not divide this input size")
        monkeypatch.setenv("PLINTH_W4A16_GEMV", launch)
        monkeypatch.setenv("PLINTH_W4A16_MMA", f"{bn * 2},{split},{warps},2")
    kernel, layer, dense = _int4(40, k, group, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = x.double() @ dense.T
    out = kernel.apply(layer, x, None)
    scale = ref.abs().max().item()
    assert out.dtype == dtype and out.shape == (m, 40)
    assert (out.double() - ref).abs().max().item() <= (1e-5 if dtype == torch.float32 else 4e-3) * scale


def test_w4a16_launch_choices():
    """Every span lies in one group; the decode launches divide the input size they split."""
    from plinth.quantization.kernels.w4a16_triton import gemv_tiles, mma_tiles

    for k, group in ((4096, 128), (14336, 128), (384, 32), (4096, 4096), (576, 32), (1024, 1024)):
        t = interleave_tile(k, group)
        assert k % t == 0 and group % t == 0
        g = gemv_tiles(4096, k, t, 132)
        assert k % (t * g.spans * g.split_k) == 0
        mm = mma_tiles(4096, k, group)
        assert (k // group) % mm.split_k == 0
    assert interleave_tile(4096, 128) == 128 and interleave_tile(4096, 4096) == 512


@pytest.mark.parametrize("value", ["8,2", "8,x,1,4", "0,4,1,4", "12,4,1,4", "8,3,1,4", "8,4,-1,4"])
def test_w4a16_launch_override_is_checked(monkeypatch, value):
    from plinth.quantization.kernels.w4a16_triton import gemv_tiles

    monkeypatch.setenv("PLINTH_W4A16_GEMV", value)
    with pytest.raises(ValueError, match="PLINTH_W4A16_GEMV=.*expected 4 comma-separated positive integers"):
        gemv_tiles(4096, 4096, 128, 132)


def test_w4a16_launch_override_that_does_not_divide_is_reported(monkeypatch):
    from plinth.quantization.kernels.w4a16_triton import GemvTiles, gemv_tiles, mma_tiles

    monkeypatch.setenv("PLINTH_W4A16_GEMV", "8,16,4,4")        # 16 spans x 4 splits x 128 > 4096
    with pytest.warns(RuntimeWarning, match="PLINTH_W4A16_GEMV ignored"):
        assert gemv_tiles(4096, 4096, 128, 132) != GemvTiles(8, 16, 4, 4)
    monkeypatch.setenv("PLINTH_W4A16_MMA", "64,3,2,3")         # 3 does not divide 32 groups
    with pytest.warns(RuntimeWarning, match="PLINTH_W4A16_MMA ignored"):
        assert mma_tiles(4096, 4096, 128).split_k != 3


@needs_interpreter
def test_skinny_method_routes_rows(monkeypatch):
    """Decode rows take the Triton kernel only where the choice says so; results equal F.linear."""
    from plinth.model_registry.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 48)
    layer.weight.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(6))
    layer.linear_method = SkinnyLinearMethod(layer.linear_method, SkinnyChoice(one_row=True, few_rows=False))
    calls = []
    real = ops.skinny_linear
    monkeypatch.setattr(ops, "skinny_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for m in (1, 4, 20):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert calls == [1]
    # zero rows (the LM head of a prefill chunk that samples nothing) never take the kernel, whatever the choice:
    # its one-row path reads and writes row 0 unmasked (on a GPU: an illegal memory access when timing had chosen
    # the kernel for few rows)
    layer.linear_method = SkinnyLinearMethod(layer.linear_method.inner, SkinnyChoice(one_row=True, few_rows=True))
    assert layer(torch.zeros(0, 64)).shape == (0, 48)
    assert calls == [1]
    assert ops.skinny_linear(torch.zeros(0, 64), layer.weight).shape == (0, 48)


def _count_launches(monkeypatch) -> list[str]:
    """Names of the fused ops the model calls from now on (``rms_norm``, ``silu_and_mul``, ``rotary_``)."""
    launched: list[str] = []
    for name in ("rms_norm", "silu_and_mul", "rotary_"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: launched.append(_name) or _real(*a, **k))
    return launched


@needs_interpreter
def test_model_with_fused_ops_matches_torch_path(monkeypatch, tiny_llama_dir):
    """A whole Llama (float32, CPU) with its norms, SiLU and RoPE in the Triton kernels gives the
    logits and greedy tokens of the same model on the torch path."""
    from plinth import LLM, SamplingParams

    prompts = ["The quick brown fox", "0123"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")

    launched = _count_launches(monkeypatch)

    def run(fused: bool):
        monkeypatch.setattr(ops, "_TRITON_DEVICE_TYPES", ("cuda", "xpu", "cpu") if fused else ("cuda", "xpu"))
        llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, enforce_eager=True)
        try:
            return llm.generate(prompts, params)
        finally:
            del llm

    ref = run(False)
    assert not launched
    fused = run(True)
    assert {"rms_norm", "silu_and_mul"} <= set(launched), launched      # the kernels did run
    for a, b in zip(ref, fused, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


def test_split_w4a16_routes_by_rows(monkeypatch):
    """The decode/prefill pair: up to four rows go to torch's int4 matmul, more rows to the Triton kernels;
    on CPU it declines (one kernel serves both there)."""
    from plinth.quantization.kernels.w4a16_split import DECODE_MAX_ROWS, SplitW4A16Kernel

    cpu = GemmProblem("int", torch.bfloat16, "cpu", bits=4, group_size=128, shapes=((256, 256),))
    answer = SplitW4A16Kernel.supports(cpu)
    assert not answer and "CPU" in answer.reason
    kernel = SplitW4A16Kernel(GemmProblem("int", torch.bfloat16, "cuda", capability=(9, 0), bits=4,
                                          group_size=128, shapes=((256, 256),)))
    seen = []
    monkeypatch.setattr(kernel.small, "apply", lambda layer, x, bias: seen.append(("small", x.shape[0])))
    monkeypatch.setattr(kernel.large, "apply", lambda layer, x, bias: seen.append(("large", x.shape[0])))
    for rows in (1, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1, 512):
        kernel.apply(None, torch.zeros(rows, 256), None)
    assert seen == [("small", 1), ("small", 4), ("large", 5), ("large", 512)]


@needs_interpreter
@pytest.mark.parametrize("k", [100, 4100])            # one block and several blocks per row
def test_quantize_rows_matches_the_tensor_ops(k):
    """The fused per-row quantizer's scales and scaled values (float32 output in the interpreter, which
    has no float8) against the reference per-token quantizer's arithmetic."""
    from plinth.quantization.quantizers import FP8_MAX

    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(7)) * 3).to(torch.float16)
    x[2] = 0.0                                         # an all-zero row keeps a positive scale
    y, scale = ops.quantize_rows(x, torch.float32, FP8_MAX)
    xf = x.float()
    ref_scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, (xf / ref_scale).clamp(-FP8_MAX, FP8_MAX), rtol=1e-5, atol=1e-5)
    assert y.abs().max().item() <= FP8_MAX


@needs_interpreter
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quantized_rows_equal_quantize_rows(with_residual):
    """The norm's per-row quantized output is bit for bit :func:`ops.quantize_rows` of its plain output
    (float32 codes in the interpreter, which has no float8)."""
    from plinth.quantization.quantizers import FP8_MAX

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 100, generator=g) * 2).to(torch.float16)
    r = torch.randn(6, 100, generator=g).to(torch.float16)
    w = (torch.rand(100, generator=g) + 0.5).to(torch.float16)
    x[4] = 0.0
    if with_residual:
        r[4] = 0.0                                      # an all-zero row keeps a positive scale
    res = r if with_residual else None
    plain = ops.rms_norm(x, w, 1e-6, res)
    quant = ops.rms_norm(x, w, 1e-6, res, quant=ops.RowQuant(torch.float32, FP8_MAX))
    if with_residual:
        (plain, h_plain), (quant, h_quant) = plain, quant
        assert torch.equal(h_plain, h_quant)
    assert isinstance(quant, ops.QuantizedRows)
    ref_y, ref_scale = ops.quantize_rows(plain, torch.float32, FP8_MAX)
    assert torch.equal(quant.scale, ref_scale) and torch.equal(quant.data, ref_y)
    assert quant.scale[4].item() > 0 and quant.data.abs().max().item() == FP8_MAX


@needs_interpreter
@pytest.mark.parametrize("d,row_limit", [(200, None), (4100, None), (4100, 1024)],
                         ids=["short", "one-pass", "two-pass"])
def test_silu_and_mul_quantized_rows_equal_quantize_rows(monkeypatch, d, row_limit):
    from plinth.quantization.quantizers import FP8_MAX

    if row_limit is not None:                          # rows longer than this take two passes
        monkeypatch.setattr(ops, "_SILU_QUANT_ROW", row_limit)

    x = (torch.randn(4, 2 * d, generator=torch.Generator().manual_seed(5)) * 3).to(torch.float16)
    x[1] = 0.0
    quant = ops.silu_and_mul(x, quant=ops.RowQuant(torch.float32, FP8_MAX))
    ref_y, ref_scale = ops.quantize_rows(ops.silu_and_mul(x), torch.float32, FP8_MAX)
    assert isinstance(quant, ops.QuantizedRows)
    assert torch.equal(quant.scale, ref_scale) and torch.equal(quant.data, ref_y)


@needs_interpreter
def test_integer_row_quantization_is_refused():
    """The kernels' cast truncates toward zero: integer codes would be biased, so they are refused."""
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="floating point"):
        ops.rms_norm(x, torch.ones(64), 1e-6, quant=ops.RowQuant(torch.int8, 127.0))
    with pytest.raises(ValueError, match="floating point"):
        ops.silu_and_mul(x, quant=ops.RowQuant(torch.int8, 127.0))


@needs_interpreter
def test_fp8_model_takes_rows_quantized_by_the_norms(monkeypatch, tiny_llama_dir):
    """A kernel asking for quantized input rows (``GemmKernel.input_quant``) gets them from the RMSNorms and
    the SiLU-and-mul before its qkv, gate/up and down projections (three per layer and step), and the model
    gives the tokens and log-probabilities of the same kernel quantizing its own plain input."""
    from plinth import LLM, SamplingParams
    from plinth.quantization.kernels.dequant import DequantFP8Kernel
    from plinth.quantization.quantizers import FP8_MAX

    real_apply = DequantFP8Kernel.apply
    seen: list[int] = []

    def apply(self, layer, x, bias):
        if isinstance(x, ops.QuantizedRows):
            seen.append(x.data.shape[0])
            return real_apply(self, layer, x.data * x.scale, bias)
        xq, scale = ops.quantize_rows(x, torch.float32, FP8_MAX)     # the same rounding, done here
        return real_apply(self, layer, xq * scale, bias)

    monkeypatch.setattr(DequantFP8Kernel, "apply", apply)
    monkeypatch.setattr(ops, "_TRITON_DEVICE_TYPES", ("cuda", "xpu", "cpu"))
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")
    prompts = ["The quick brown fox", "0123"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(hand_over: bool):
        monkeypatch.setattr(DequantFP8Kernel, "input_quant", ops.RowQuant(torch.float32, FP8_MAX) if hand_over
                            else None)
        llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, enforce_eager=True, quantization="fp8",
                  gemm_kernel="dequant")   # the kernel whose input the test watches (triton_fp8 runs interpreted too)
        try:
            return llm.generate(prompts, params)
        finally:
            del llm

    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    ref = run(False)
    assert not seen
    out = run(True)
    steps = 1 + params.max_tokens - 1                  # one prefill and three decode steps (both prompts)
    assert len(seen) >= 3 * layers * steps, (len(seen), layers)
    for a, b in zip(ref, out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


@needs_interpreter
@DTYPES
@pytest.mark.parametrize("k, r", [(1, 8), (3, 16), (2, 4)], ids=["o", "qkv", "gate_up"])
def test_lora_shrink_expand(dtype, k, r):
    """Each token's adapter product from its own slot, against float64; a token without one (-1) is untouched."""
    torch.manual_seed(0)
    t, s, n_in, out = 5, 3, 72, 40
    x = torch.randn(t, n_in, dtype=dtype)
    a = torch.randn(k, s, r, n_in, dtype=dtype) * 0.2
    b = torch.randn(out, k, s, r, dtype=dtype) * 0.2
    slots = torch.tensor([0, -1, 2, 1, 2], dtype=torch.int32)
    y = torch.randn(t, out, dtype=dtype)
    want = y.double().clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            shrink = x[i].double() @ a[:, slot].double().reshape(k * r, n_in).T
            want[i] += shrink @ b[:, :, slot].double().reshape(out, k * r).T
    before = y[1].clone()
    ops.lora_shrink_expand_(x, a, b, slots, y)
    assert torch.equal(y[1], before)
    torch.testing.assert_close(y.double(), want, atol=_tol(dtype) * 10, rtol=_tol(dtype) * 10)


@needs_interpreter
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 21])
def test_moe_gemv_equals_the_per_expert_loop(bias, tokens):
    """A few tokens' experts through the per-slot GEMV kernel (two launches, no host read of the routing) against
    the per-expert loop, with biases and gpt-oss's clamped activation; more tokens than experts over top_k take
    the loop."""
    from plinth.model_registry.layers.moe import FusedMoE

    g = torch.Generator().manual_seed(tokens)

    def act(gate, up):
        return (up.clamp(-1, 1) + 1) * gate * torch.sigmoid(gate)

    moe = FusedMoE(8, 2, 48, 200, renormalize=True, bias=bias, activation=act if bias else None)  # K % 128 != 0
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    x = torch.randn(tokens, 48, generator=g)
    logits = torch.randn(tokens, 8, generator=g)
    assert moe.uses_gemv(x) == (tokens < 5) and moe.uses_grouped_kernel(x) == (tokens >= 5)   # 2 x 5 > 8 experts
    got = moe(x, logits)
    moe.uses_gemv = moe.uses_grouped_kernel = lambda _x: False
    torch.testing.assert_close(got, moe(x, logits), atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("block", [None, (128, 128), (16, 32)])
@pytest.mark.parametrize("tokens", [1, 3, 21])
def test_moe_gemv_reads_fp8_experts(block, tokens):
    """The per-slot GEMV kernel (a few tokens) and the grouped kernel (21 tokens) on FP8 experts (per-channel
    scales, 128x128 blocks sharing one scale per tile row, 16x32 blocks read per element, 200-row experts ending
    inside a block) against the per-expert loop widening each expert."""
    from test_fp8_experts import _expert_weights, _load_fp8_experts, _moe

    moe = _moe()
    _load_fp8_experts(moe, block, _expert_weights(8, 48, 200))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 48, generator=g)
    logits = torch.randn(tokens, 8, generator=g)
    assert moe.uses_gemv(x) == (tokens < 5) and moe.uses_grouped_kernel(x) == (tokens >= 5)
    assert not moe.graph_capturable(torch.device("cpu"), torch.float32)
    got = moe(x, logits)
    if tokens >= 5:   # other tiles for the grouped kernel (blocks of 16 rows, 32x32 weight tiles): the same sums
        moe.grouped_kernel_tiles = (16, (32, 32, 2, 2))
        torch.testing.assert_close(moe(x, logits), got, atol=1e-5, rtol=1e-5)
    moe.uses_gemv = moe.uses_grouped_kernel = lambda _x: False
    torch.testing.assert_close(got, moe(x, logits), atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("bits,group,k", [(4, 128, 256), (4, 32, 96), (8, 64, 192), (8, 96, 96), (8, 99, 99)])
def test_moe_gemv_reads_integer_experts(bits, group, k):
    """The per-slot GEMV kernel on integer experts (4-bit codes two per byte, low nibble first, or 8-bit codes; one
    scale and zero point per row and group: groups of 128 shared by a tile, narrower ones read per element, a
    group as wide as the row, odd at 8 bits) against float64 ``(q - zero) * scale``."""
    g = torch.Generator().manual_seed(bits + group)
    e, n, slots = 4, 40, 5
    q = torch.randint(0, 2 ** bits, (e, n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(e, n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 2 ** bits, (e, n, k // group), generator=g).float()
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous() if bits == 4 else q
    x = torch.randn(3, k, generator=g)
    experts = torch.tensor([2, 0, 3, 2, 1], dtype=torch.int32)
    got = ops.moe_gemv(x, codes, None, experts, 2, int_codes=(bits, group, scales, zeros))
    widened = (q.double() - zeros.double().repeat_interleave(group, 2)) * scales.double().repeat_interleave(group, 2)
    want = torch.stack([x[s // 2].double() @ widened[experts[s]].T for s in range(slots)])
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("quant", ["float", "fp8", "int4", "int8"])
def test_moe_gemv_multiplies_silu_of_gate_times_up_as_it_reads(quant):
    """The down projection's GEMV reading ``[gate | up]`` rows and multiplying ``silu(gate) * up`` as it loads them
    (no activation tensor): float, FP8 (per-channel scales) and integer experts against float64."""
    from plinth.quantization.fp8_experts import ExpertScales

    g = torch.Generator().manual_seed(7)
    e, n, k, slots = 4, 40, 192, 5
    gate_up = torch.randn(slots, 2 * k, generator=g)
    experts = torch.tensor([3, 0, 2, 3, 1], dtype=torch.int32)
    kw: dict = {}
    if quant == "float":
        weight = widened = torch.randn(e, n, k, generator=g) * 0.1
    elif quant == "fp8":
        widened = torch.randn(e, n, k, generator=g) * 0.1
        scale = widened.abs().amax(-1, keepdim=True) / 448
        codes = (widened / scale).to(torch.float8_e4m3fn)
        widened = codes.to(torch.float32) * scale
        weight, kw["scales"] = codes.view(torch.uint8), ExpertScales(scale, 1, k)
    else:
        bits, group = (4, 64) if quant == "int4" else (8, 96)
        q = torch.randint(0, 2 ** bits, (e, n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(e, n, k // group, generator=g) * 0.02 + 0.001
        zeros = torch.randint(0, 2 ** bits, (e, n, k // group), generator=g).float()
        weight = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous() if bits == 4 else q
        widened = (q.float() - zeros.repeat_interleave(group, 2)) * scales.repeat_interleave(group, 2)
        kw["int_codes"] = (bits, group, scales, zeros)
    got = ops.moe_gemv(gate_up, weight, None, experts, 1, silu_mul_input=True, **kw)
    h = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    want = torch.stack([h[s] @ widened[experts[s]].double().T for s in range(slots)])
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (128, 8), (16, 16), (5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_equals_softmax_top_k(experts, top_k, renormalize):
    """One-launch routing against float64 ``topk(softmax(logits))`` (renormalised or not): the same experts in the
    same order, weights to float32 rounding; float16 logits read as they are."""
    g = torch.Generator().manual_seed(experts + top_k)
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(7, experts, generator=g) * 3).to(dtype)
        weights, ids = ops.moe_route(logits, top_k, renormalize)
        probs = torch.softmax(logits.double(), dim=-1)
        want_w, want_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (7, top_k)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-5)


@needs_interpreter
def test_moe_route_ties_take_the_lower_expert_and_nan_logits_stay_in_range():
    """Equal logits (common in bfloat16 router outputs) choose the lower expert first; a row of NaN logits never
    yields an expert id past the last (the GEMV would read outside the weights)."""
    inf = float("inf")
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0], [float("nan")] * 6, [0.0, -inf, -inf, 1.0, -inf, -inf]])
    weights, ids = ops.moe_route(logits, 3, True)
    assert ids[0].tolist() == [1, 2, 4]
    assert ids[2].tolist() == [3, 0, 1] and weights[2, 2] == 0   # past the finite logits: distinct experts
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    assert ((ids[1] >= 0) & (ids[1] < 6)).all()
    assert ops.moe_route(torch.empty(0, 6), 2, True)[1].shape == (0, 2)


@needs_interpreter
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_moe_combine_weights_and_sums_each_tokens_experts(out_dtype):
    """Each token's expert outputs (slot ``t * K + j``) weighted and summed in float32, written in the asked type,
    against float64; a strided ``y`` and ``H`` beyond one block."""
    g = torch.Generator().manual_seed(3)
    t, k, h = 3, 4, 1500
    y = torch.randn(t * k, h + 8, generator=g)[:, :h]
    weights = torch.rand(t, k, generator=g)
    got = ops.moe_combine(y, weights, out_dtype)
    want = (y.double().view(t, k, h) * weights.double()[..., None]).sum(1)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got.double(), want, atol=_tol(out_dtype), rtol=_tol(out_dtype))


def _expert_weights_in(quant: str, e: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``(stored weight, the kernels' format arguments, float64 widened weight)`` of random experts stored as
    ``quant``: float, FP8 per channel / in 128x128 or 16x32 blocks, 4-bit (groups of 64 or 32) or 8-bit codes."""
    from plinth.quantization.fp8_experts import ExpertScales

    if quant == "float":
        w = torch.randn(e, n, k, generator=g) * 0.1
        return w, {}, w.double()
    if quant.startswith("fp8"):
        rows, cols = {"fp8": (1, k), "fp8-128": (128, 128), "fp8-16x32": (16, 32)}[quant]
        w = torch.randn(e, n, k, generator=g) * 0.1
        scale = torch.rand(e, -(-n // rows), -(-k // cols), generator=g) * 0.001 + 0.0002
        full = scale.repeat_interleave(rows, 1)[:, :n].repeat_interleave(cols, 2)[:, :, :k]
        codes = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), {"scales": ExpertScales(scale, rows, cols)}, codes.double() * full.double()
    bits, group = {"int4": (4, 64), "int4-32": (4, 32), "int8": (8, 64)}[quant]
    q = torch.randint(0, 2 ** bits, (e, n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(e, n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 2 ** bits, (e, n, k // group), generator=g).float()
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous() if bits == 4 else q
    widened = (q.double() - zeros.double().repeat_interleave(group, 2)) * scales.double().repeat_interleave(group, 2)
    return codes, {"int_codes": (bits, group, scales, zeros)}, widened


@needs_interpreter
@pytest.mark.parametrize("quant, sized", [("float", False), ("fp8", False), ("fp8-128", False), ("fp8-16x32", False),
                                          ("int4", False), ("int4-32", False), ("int8", False), ("fp8-128", True),
                                          ("int4", True)])
def test_moe_grouped_gemm_multiplies_each_experts_block_of_slots(quant, sized):
    """The prefill kernel of mixture-of-experts layers, against float64: the slots sorted by expert on the device
    (an expert with more slots than one block, experts with none), the token rows gathered (gate/up projection,
    outputs in sorted order), then ``silu(gate) * up`` read from sorted rows and the outputs scattered back to slot
    order (down projection), with biases; float and every stored format; ``sized``: with the tiles
    :func:`~plinth.kernels.ops.moe_grouped_tiles` picks by the step's size (16-row blocks, 128 x 64 tiles)."""
    g = torch.Generator().manual_seed(11)
    e, top_k, t, inter = 6, 2, 23, 128                    # 46 slots: expert 0 takes more than 32
    hidden = 192 if quant.startswith("int") else 200      # (float and FP8: a row ending inside a 64-wide tile)
    ids = torch.stack([torch.zeros(t, dtype=torch.int64), torch.randint(1, 5, (t,), generator=g)], 1)  # 5 unused
    x = torch.randn(t, hidden, generator=g)
    w13, kw13, w13_ref = _expert_weights_in(quant, e, 2 * inter, hidden, g)
    w2, kw2, w2_ref = _expert_weights_in(quant if quant != "fp8-128" else "fp8", e, hidden, inter, g)
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    block_m, tiles = ops.moe_grouped_tiles(ids.numel(), e, quant.startswith("int")) if sized else (
        ops.MOE_GROUPED_BLOCK_M, ops.MOE_GROUPED_TILES)
    assert not sized or (block_m, tiles) == (16, (128, 64, 4, 3))   # 46 slots over 6 experts: 16-row blocks
    blocks = ops.moe_sorted_blocks(ids, e, block_m)
    order = blocks[0]
    kw13, kw2 = {**kw13, "tiles": tiles}, {**kw2, "tiles": tiles}
    gate_up = ops.moe_grouped_gemm(x, w13, b13, blocks, gather_div=top_k, scatter_out=False, **kw13)
    flat = ids.reshape(-1)
    want_gu = torch.stack([x[int(s) // top_k].double() @ w13_ref[flat[s]].T + b13[flat[s]].double()
                           for s in order.tolist()])                                   # sorted order
    torch.testing.assert_close(gate_up.double(), want_gu, atol=1e-3, rtol=1e-3)
    y = ops.moe_grouped_gemm(gate_up, w2, b2, blocks, gather_div=None, scatter_out=True, silu_mul_input=True, **kw2)
    h = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    want_y = torch.empty(t * top_k, hidden, dtype=torch.float64)
    for m, s in enumerate(order.tolist()):
        want_y[s] = h[m] @ w2_ref[flat[s]].T + b2[flat[s]].double()
    torch.testing.assert_close(y.double(), want_y, atol=1e-3, rtol=1e-3)


def test_moe_grouped_tiles_follow_the_rows_per_expert():
    """16-row blocks while experts get fewer than 64 rows on average; 64-row blocks from there, except for 4-bit
    weights; 128 x 64 tiles over 4 warps in 3 stages, except for float32 weights (the former tiles)."""
    assert ops.moe_grouped_tiles(32 * 8, 128, False) == (16, (128, 64, 4, 3))
    assert ops.moe_grouped_tiles(2048 * 8, 128, False) == (64, (128, 64, 4, 3))
    assert ops.moe_grouped_tiles(2048 * 8, 128, True) == (16, (128, 64, 4, 3))
    assert ops.moe_grouped_tiles(64 * 128 - 1, 128, False)[0] == 16
    assert ops.moe_grouped_tiles(2048 * 8, 128, False, float32_weights=True) == (32, (64, 64, 4, 2))


@needs_interpreter
@pytest.mark.parametrize("bits,desc_act", [(4, False), (8, False), (4, True)])
def test_moe_gemv_takes_gptq_experts(tmp_path, bits, desc_act):
    """GPTQ experts of a Qwen3-MoE checkpoint take the GEMV kernel for a decode step and the grouped kernel for a
    prefill-sized one (act order, a permutation per expert, keeps the per-expert loop): the same output as the loop
    widening each expert."""
    from test_models import save_with_tokenizer
    from test_quantization_awq_gptq import gptq_checkpoint
    from test_quantization_support import load_plinth

    save_with_tokenizer("Qwen3MoeForCausalLM", tmp_path / "float")
    path, _ = gptq_checkpoint(tmp_path / "float", tmp_path / "gptq", bits, 32, desc_act, False, "gptq")
    moe = load_plinth(path)[0].model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(bits)
    for tokens in (2, 2 * moe.num_experts):
        x = torch.randn(tokens, moe.hidden_size, generator=g)
        logits = torch.randn(tokens, moe.num_experts, generator=g)
        assert (moe.uses_gemv(x) or moe.uses_grouped_kernel(x)) != desc_act
        got = moe(x, logits)
        moe.uses_gemv = moe.uses_grouped_kernel = lambda _x: False
        torch.testing.assert_close(got, moe(x, logits), atol=1e-5, rtol=1e-5)
        del moe.uses_gemv, moe.uses_grouped_kernel


@needs_interpreter
@pytest.mark.parametrize("kd,vd", [(16, 8), (128, 128), (24, 40)])
def test_gated_delta_step_updates_the_rows_in_place(kd, vd):
    """The one-launch gated DeltaNet decode step against the float64 rule: outputs, the states of the step's rows
    (not in order, not a span) updated in place, every other row untouched; head sizes that are not powers of two
    (masked lanes) and value heads wider than one program's block."""
    g = torch.Generator().manual_seed(kd + vd)
    rows, heads = torch.tensor([4, 1, 2]), 3
    ssm = torch.randn(6, heads, kd, vd, generator=g)
    before = ssm.clone()
    q, k = (torch.nn.functional.normalize(torch.randn(3, heads, kd, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(3, heads, vd, generator=g)
    decay, beta = -torch.rand(3, heads, generator=g), torch.rand(3, heads, generator=g)
    out = ops.gated_delta_step(ssm, rows, q, k, v, decay, beta)
    s = before[rows].double() * torch.exp(decay.double())[..., None, None]
    write = (v.double() - torch.einsum("bhkv,bhk->bhv", s, k.double())) * beta.double()[..., None]
    s = s + k.double()[..., None] * write[:, :, None, :]
    torch.testing.assert_close(out.double(), torch.einsum("bhkv,bhk->bhv", s, q.double()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm[rows].double(), s, atol=1e-5, rtol=1e-5)
    assert torch.equal(ssm[[0, 3, 5]], before[[0, 3, 5]])
