"""The fused per-layer kernels and the skinny GEMMs on a GPU, in bfloat16 at Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from plinth.kernels import ops  # noqa: E402
from plinth.model_registry.layers.rotary import apply_rotary  # noqa: E402
from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel  # noqa: E402
from plinth.quantization.quantizers import random_int_weights  # noqa: E402
from plinth.quantization.selection import holder  # noqa: E402
from plinth.worker.gpu_linear import choose  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def test_rms_norm_bf16():
    x, r = torch.randn(64, 4096, device=CUDA, dtype=BF16), torch.randn(64, 4096, device=CUDA, dtype=BF16)
    w = torch.rand(4096, device=CUDA, dtype=BF16) + 0.5
    y, h = ops.rms_norm(x, w, 1e-5, r)
    ref_h = x + r
    ref = w.float() * ref_h.float() * torch.rsqrt(ref_h.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=1.6e-2)


def test_silu_and_mul_bf16():
    x = torch.randn(33, 2 * 14336, device=CUDA, dtype=BF16)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x).float(), F.silu(gate) * up, atol=3e-2, rtol=1.6e-2)


def test_rows_quantized_by_the_norm_and_activation_equal_quantize_rows():
    """FP8 rows written by the RMSNorm and SiLU-and-mul kernels are bit for bit those of the separate
    quantizer on their plain outputs (what the W8A8 GEMM got before)."""
    from plinth.quantization.quantizers import FP8_MAX

    fp8 = ops.RowQuant(torch.float8_e4m3fn, FP8_MAX)
    x, r = torch.randn(300, 4096, device=CUDA, dtype=BF16) * 3, torch.randn(300, 4096, device=CUDA, dtype=BF16)
    w = torch.rand(4096, device=CUDA, dtype=BF16) + 0.5
    (q, h), (y, ref_h) = ops.rms_norm(x, w, 1e-5, r, quant=fp8), ops.rms_norm(x, w, 1e-5, r)
    ref_q, ref_s = ops.quantize_rows(y, torch.float8_e4m3fn, FP8_MAX)
    assert torch.equal(h, ref_h) and torch.equal(q.scale, ref_s)
    assert torch.equal(q.data.view(torch.uint8), ref_q.view(torch.uint8))
    q = ops.rms_norm(x, w, 1e-5, quant=fp8)                # a first layer's norm: no residual
    ref_q, ref_s = ops.quantize_rows(ops.rms_norm(x, w, 1e-5), torch.float8_e4m3fn, FP8_MAX)
    assert torch.equal(q.scale, ref_s) and torch.equal(q.data.view(torch.uint8), ref_q.view(torch.uint8))
    for rows, d in ((1, 14336), (300, 14336), (7, 28672)):   # 28672 features: the two-pass kernel
        gu = torch.randn(rows, 2 * d, device=CUDA, dtype=BF16) * 2
        q = ops.silu_and_mul(gu, quant=fp8)
        ref_q, ref_s = ops.quantize_rows(ops.silu_and_mul(gu), torch.float8_e4m3fn, FP8_MAX)
        assert torch.equal(q.scale, ref_s)
        assert torch.equal(q.data.view(torch.uint8), ref_q.view(torch.uint8))


def test_rotary_bf16_llama3_heads():
    t = 48
    qkv = torch.randn(t, (32 + 16) * 128, device=CUDA, dtype=BF16)
    q, k, _ = qkv.split([4096, 1024, 1024], dim=-1)
    q, k = q.view(t, 32, 128), k.view(t, 8, 128)
    pos = torch.randint(0, 8000, (t,), device=CUDA)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=CUDA, dtype=torch.float32) / 128))
    emb = torch.cat([pos.float()[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    ref_q, ref_k = apply_rotary(q.float(), cos.float(), sin.float()), apply_rotary(k.float(), cos.float(), sin.float())
    ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q.float(), ref_q, atol=3e-2, rtol=1.6e-2)
    torch.testing.assert_close(k.float(), ref_k, atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096), (3072, 2048)])
def test_skinny_linear_bf16(m, n, k):
    x = torch.randn(m, k, device=CUDA, dtype=BF16)
    w = torch.randn(n, k, device=CUDA, dtype=BF16) * 0.02
    ref = x.float() @ w.float().T
    out = ops.skinny_linear(x, w)
    assert (out.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 64])
@pytest.mark.parametrize("n,k,group", [(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 128), (1024, 2048, 2048),
                                       (2048, 4096, 64), (2048, 4096, 32)])
def test_w4a16_paths(m, n, k, group, dtype):
    """The GEMV (1 row), the tensor-core decode kernel (2-16 rows; groups of 32 and 64 take the GEMM there) and
    the GEMM at Llama-3-8B shapes (and per-channel scales) against float32 math on the dequantized weight."""
    weights = random_int_weights(n, k, 4, group, symmetric=False, act_order=False, device=CUDA,
                                 generator=torch.Generator(device=CUDA).manual_seed(0))
    kernel = TritonW4A16Kernel(GemmProblem("int", dtype, "cuda", capability=torch.cuda.get_device_capability(),
                                           bits=4, group_size=group, shapes=((n, k),)))
    layer = holder(kernel.prepare(weights))
    x = torch.randn(m, k, device=CUDA, dtype=dtype)
    ref = x.float() @ weights.dequantize(torch.float32).T
    out = kernel.apply(layer, x, None)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= 8e-3 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_w4a16_mma_unpacking_asm_matches_integer_ops(dtype):
    """The one-``lop3`` unpacking and the plain integer ops make the same operands: the two builds agree
    to the output's rounding (their float32 epilogues may fuse differently) and both match float32 math."""
    from plinth.quantization.kernels import w4a16_triton

    n, k = 4096, 4096
    weights = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=CUDA,
                                 generator=torch.Generator(device=CUDA).manual_seed(2))
    kernel = TritonW4A16Kernel(GemmProblem("int", dtype, "cuda", capability=torch.cuda.get_device_capability(),
                                           bits=4, group_size=128, shapes=((n, k),)))
    layer = holder(kernel.prepare(weights))
    x = torch.randn(7, k, device=CUDA, dtype=dtype)
    jit = w4a16_triton.load_jit_module()
    tile = w4a16_triton.interleave_tile(k, 128)
    fast = w4a16_triton._mma(jit, layer, x, 128, tile, asm=True).float()
    plain = w4a16_triton._mma(jit, layer, x, 128, tile, asm=False).float()
    ref = x.float() @ weights.dequantize(torch.float32).T
    scale = ref.abs().max().item()
    ulp = 2.0 ** -7 if dtype == BF16 else 2.0 ** -10
    assert (fast - plain).abs().max().item() <= ulp * scale
    assert (fast - ref).abs().max().item() <= 8e-3 * scale and (plain - ref).abs().max().item() <= 8e-3 * scale


def test_choice_times_both_candidates():
    ws = [torch.randn(4096, 4096, device=CUDA, dtype=BF16) for _ in range(2)]
    choice, timings = choose(ws)
    assert set(timings) == {1, 8} and all(v > 0 and t > 0 for v, t in timings.values())
    assert choice.one_row == (timings[1][1] < timings[1][0])


@pytest.mark.parametrize("m", [1, 4, 5, 16, 17, 200])
def test_split_w4a16_bf16(m):
    from plinth.quantization.kernels.w4a16_split import SplitW4A16Kernel

    n, k = 4096, 4096
    weights = random_int_weights(n, k, 4, 128, symmetric=False, act_order=False, device=CUDA,
                                 generator=torch.Generator(device=CUDA).manual_seed(1))
    problem = GemmProblem("int", BF16, "cuda", capability=torch.cuda.get_device_capability(), bits=4,
                          group_size=128, shapes=((n, k),))
    assert SplitW4A16Kernel.supports(problem)
    kernel = SplitW4A16Kernel(problem)
    layer = holder(kernel.prepare(weights))
    x = torch.randn(m, k, device=CUDA, dtype=BF16)
    ref = x.float() @ weights.dequantize(torch.float32).T
    out = kernel.apply(layer, x, None)
    assert (out.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_quantize_rows_fp8_equals_tensor_ops():
    from plinth.quantization.quantizers import FP8_MAX, quantize_fp8_tokens

    x = torch.randn(300, 14336, device=CUDA, dtype=BF16) * 4
    y, scale = ops.quantize_rows(x, torch.float8_e4m3fn, FP8_MAX)
    ref_y, ref_scale = quantize_fp8_tokens(x)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    differ = (y.float() != ref_y.float()).float().mean().item()
    assert differ < 1e-3, differ                       # the same rounding, up to division ulps
    assert (y.float() - ref_y.float()).abs().max().item() <= 32.0   # at most one e4m3 step at the top


@pytest.mark.parametrize("experts,top_k", [(128, 8), (64, 6), (8, 2), (256, 8)])
def test_moe_route_and_combine_bf16(experts, top_k):
    """One-launch routing of bfloat16 router logits (many equal values) against softmax top-k in float64: the
    chosen experts' logits are the top-k logits (ties may pick either expert: the kernel takes the lower), weights
    to float32 rounding; then the weighted sum of each token's expert outputs against float64."""
    g = torch.Generator(device=CUDA).manual_seed(experts)
    logits = (torch.randn(37, experts, generator=g, device=CUDA) * 3).to(BF16)
    weights, ids = ops.moe_route(logits, top_k, True)
    want_logits, _ = torch.topk(logits.double(), top_k, dim=-1)
    assert torch.equal(logits.double().gather(1, ids), want_logits)
    assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()   # no expert twice
    probs = torch.softmax(logits.double(), dim=-1).gather(1, ids)
    torch.testing.assert_close(weights.double(), probs / probs.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)
    y = torch.randn(37 * top_k, 2048, generator=g, device=CUDA).to(BF16)
    want = (y.double().view(37, top_k, -1) * weights.double()[..., None]).sum(1)
    torch.testing.assert_close(ops.moe_combine(y, weights, BF16).double(), want, atol=3e-2, rtol=1.6e-2)
