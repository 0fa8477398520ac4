"""The NVRTC W4A16 decode kernel on an NVIDIA GPU, at Llama-3-8B's shapes.

Checked against :func:`~plinth.quantization.kernels.w4a16_cuda.reference_decode` (the same bfloat16 scales
and zero points in float64: the kernel's float32 sums are the only difference) and against the float32
product of the dequantized weights. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.version.hip is not None:
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_cuda import (  # noqa: E402
    CudaW4A16Kernel,
    mma_decode,
    pack_mma_codes,
    pack_mma_scales,
    pair_rows,
    reference_decode,
)
from plinth.quantization.quantizers import quantize_int_rtn  # noqa: E402
from plinth.quantization.selection import holder  # noqa: E402

CUDA = torch.device("cuda")
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CAPABILITY = torch.cuda.get_device_capability()


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module")
def layers():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    return {name: quantize_int_rtn(torch.randn(n, k, generator=gen, device=CUDA) * 0.02, 4, 128)
            for name, (n, k) in LLAMA3_8B.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_decode_kernel_matches_references(layers, layer, dtype):
    weights = layers[layer]
    n, k = weights.shape
    codes = pack_mma_codes(weights.q)
    scales = pack_mma_scales(weights.scales, weights.zeros)
    dense = weights.dequantize(torch.float32)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    for rows in (1, 3, 8, 9, 16):
        x = torch.randn(rows, k, generator=gen, device=CUDA).to(dtype)
        out = mma_decode(x, codes, scales, n)
        torch.cuda.synchronize()
        assert out.shape == (rows, n) and out.dtype == dtype
        exact = reference_decode(x.cpu(), codes.cpu(), scales.cpu(), n)
        # the output's own rounding to 16 bits, plus float32 sums
        assert _relative(out, exact) < (5e-3 if dtype == torch.bfloat16 else 1e-3), (layer, rows)
        assert _relative(out, x.float() @ dense.T) < 1e-2, (layer, rows)


@pytest.mark.parametrize("group", [64, None])
def test_other_group_sizes(group):
    n, k = 4096, 4096
    gen = torch.Generator(device=CUDA).manual_seed(2)
    weights = quantize_int_rtn(torch.randn(n, k, generator=gen, device=CUDA) * 0.02, 4, group or k)
    x = torch.randn(4, k, generator=gen, device=CUDA).to(torch.bfloat16)
    out = mma_decode(x, pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros), n)
    assert _relative(out, x.float() @ weights.dequantize(torch.float32).T) < 1e-2


@pytest.mark.parametrize("k", [192, 4160])
@pytest.mark.parametrize("rows", [1, 13])
def test_odd_chunk_counts(k, rows):
    """Warps take the 64-feature chunks in pairs: K with an odd number of chunks ends with a pair of one
    (and at K = 192 some of the four warps have no pair at all)."""
    n = 256
    gen = torch.Generator(device=CUDA).manual_seed(4)
    weights = quantize_int_rtn(torch.randn(n, k, generator=gen, device=CUDA) * 0.02, 4, 64)
    x = torch.randn(rows, k, generator=gen, device=CUDA).to(torch.bfloat16)
    out = mma_decode(x, pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros), n)
    exact = x.double() @ weights.dequantize(torch.float64).T
    assert _relative(out, exact) < 5e-3


@pytest.mark.parametrize("launch", ["1,2", "2,3", "4,8", "8,4", "8,12", "8,16"])
def test_launch_configurations_agree(layers, launch, monkeypatch):
    weights = layers["down"]
    n, k = weights.shape
    codes = pack_mma_codes(weights.q)
    scales = pack_mma_scales(weights.scales, weights.zeros)
    x = torch.randn(5, k, generator=torch.Generator(device=CUDA).manual_seed(3), device=CUDA).to(torch.bfloat16)
    base = mma_decode(x, codes, scales, n).float()
    monkeypatch.setenv("PLINTH_W4A16_CUDA", launch)
    assert torch.allclose(mma_decode(x, codes, scales, n).float(), base, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 8, 13])
def test_paired_gate_up_rows_and_the_fused_silu(layers, rows):
    """Gate/up rows packed side by side (``pair_rows``): the plain output equals the unpaired kernel's bit
    for bit (the same sums, stored back at their own channels), and ``silu=True`` gives
    ``silu(gate) * up`` of those outputs as the separate kernel computes it (to a bfloat16 step)."""
    from plinth.kernels import ops

    weights = layers["gate_up"]
    n, k = weights.shape
    order = pair_rows(n).to(CUDA)
    codes, scales = pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros)
    pcodes = pack_mma_codes(weights.q[order])
    pscales = pack_mma_scales(weights.scales[order], weights.zeros[order])
    x = torch.randn(rows, k, generator=torch.Generator(device=CUDA).manual_seed(6), device=CUDA).to(torch.bfloat16)
    plain = mma_decode(x, codes, scales, n)
    assert torch.equal(mma_decode(x, pcodes, pscales, n, paired=True), plain)
    fused = mma_decode(x, pcodes, pscales, n, paired=True, silu=True)
    separate = ops.silu_and_mul(plain)
    assert fused.shape == (rows, n // 2) and fused.dtype == torch.bfloat16
    ulp = separate.float().abs() * 2.0 ** -7 + 1e-6
    assert ((fused.float() - separate.float()).abs() <= ulp).all()
    assert (fused == separate).float().mean().item() > 0.95


def test_kernel_class_pairs_gate_up_rows_in_a_graph(layers):
    weights = layers["gate_up"]
    n, k = weights.shape
    problem = GemmProblem("int", torch.bfloat16, "cuda", CAPABILITY, bits=4, group_size=128, shapes=((n, k),))
    kernel = CudaW4A16Kernel(problem)
    paired, plain = holder(kernel.prepare(weights, silu_pairs=True)), holder(kernel.prepare(weights))
    assert paired.w4m_paired and not plain.w4m_paired
    static = torch.randn(3, k, generator=torch.Generator(device=CUDA).manual_seed(11), device=CUDA).to(torch.bfloat16)
    assert kernel.apply_silu_mul(plain, static, None) is None
    assert kernel.apply_silu_mul(paired, torch.zeros(17, k, device=CUDA, dtype=torch.bfloat16), None) is None
    assert kernel.apply_silu_mul(paired, static, torch.zeros(n, device=CUDA, dtype=torch.bfloat16)) is None
    eager = kernel.apply_silu_mul(paired, static, None)
    assert torch.equal(kernel.apply(paired, static, None), kernel.apply(plain, static, None))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.apply_silu_mul(paired, static, None)
    static.copy_(torch.randn(3, k, device=CUDA))
    graph.replay()
    assert torch.equal(captured, kernel.apply_silu_mul(paired, static, None))
    assert not torch.equal(captured, eager)


def test_kernel_class_in_a_cuda_graph_and_for_long_inputs(layers):
    weights = layers["qkv"]
    n, k = weights.shape
    problem = GemmProblem("int", torch.bfloat16, "cuda", CAPABILITY, bits=4, group_size=128, shapes=((n, k),))
    support = CudaW4A16Kernel.supports(problem)
    assert support, support.reason
    kernel = CudaW4A16Kernel(problem)
    layer = holder(kernel.prepare(weights))
    dense = weights.dequantize(torch.float32)
    gen = torch.Generator(device=CUDA).manual_seed(4)
    static = torch.randn(2, k, generator=gen, device=CUDA).to(torch.bfloat16)
    kernel.apply(layer, static, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.apply(layer, static, None)
    fresh = torch.randn(2, k, generator=gen, device=CUDA).to(torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert _relative(captured, fresh.float() @ dense.T) < 1e-2
    long = torch.randn(40, k, generator=gen, device=CUDA).to(torch.bfloat16)   # the Triton GEMM's rows
    assert _relative(kernel.apply(layer, long, None), long.float() @ dense.T) < 1e-2


def test_fractional_zero_points_take_the_triton_kernels(layers):
    weights = layers["o"]
    n, k = weights.shape
    weights = type(weights)(weights.q, weights.scales, weights.zeros + 0.25, 4, 128)
    problem = GemmProblem("int", torch.bfloat16, "cuda", CAPABILITY, bits=4, group_size=128, shapes=((n, k),))
    kernel = CudaW4A16Kernel(problem)
    layer = holder(kernel.prepare(weights))
    assert layer.w4m_exact is False
    x = torch.randn(3, k, generator=torch.Generator(device=CUDA).manual_seed(5), device=CUDA).to(torch.bfloat16)
    assert _relative(kernel.apply(layer, x, None), x.float() @ weights.dequantize(torch.float32).T) < 1e-2


def test_shrinking_and_growing_batches_reuse_the_kernels(layers):
    """8, then 5, then 8 rows again on one shape: each launch has the shared memory it needs."""
    weights = layers["down"]
    n, k = weights.shape
    codes, scales = pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros)
    dense = weights.dequantize(torch.float32)
    gen = torch.Generator(device=CUDA).manual_seed(6)
    for rows in (8, 5, 8, 16, 1, 16):
        x = torch.randn(rows, k, generator=gen, device=CUDA).to(torch.bfloat16)
        assert _relative(mma_decode(x, codes, scales, n), x.float() @ dense.T) < 1e-2, rows


def test_act_order_and_bias_through_the_kernel_class():
    n, k = 1024, 2048
    gen = torch.Generator(device=CUDA).manual_seed(7)
    weights = quantize_int_rtn(torch.randn(n, k, generator=gen, device=CUDA) * 0.02, 4, 128)
    perm = torch.randperm(k, generator=gen, device=CUDA)
    weights = type(weights)(weights.q, weights.scales, weights.zeros, 4, 128, perm=perm)
    problem = GemmProblem("int", torch.bfloat16, "cuda", CAPABILITY, bits=4, group_size=128, act_order=True,
                          shapes=((n, k),))
    kernel = CudaW4A16Kernel(problem)
    layer = holder(kernel.prepare(weights))
    bias = torch.randn(n, generator=gen, device=CUDA).to(torch.bfloat16)
    x = torch.randn(4, k, generator=gen, device=CUDA).to(torch.bfloat16)
    ref = x.float() @ weights.dequantize(torch.float32).T + bias.float()
    assert _relative(kernel.apply(layer, x, bias), ref) < 1e-2


@pytest.mark.parametrize("launch", ["8,16", "4,6", "2,12", "8,4"])
@pytest.mark.parametrize("k", [512, 1024])
def test_rings_deeper_than_a_warps_chunks(launch, k, monkeypatch):
    """K of 512 or 1024 features (8 or 16 chunks): with 8 warps some warps get one chunk or none and the
    ring's S - 1 prologue slots outnumber them, so most prologue copies are predicated off; eager and in a
    CUDA graph (dependent launches on Hopper) the result equals the float64 reference of the same codes."""
    n = 256
    gen = torch.Generator(device=CUDA).manual_seed(11)
    weights = quantize_int_rtn(torch.randn(n, k, generator=gen, device=CUDA) * 0.02, 4, 128)
    codes, scales = pack_mma_codes(weights.q), pack_mma_scales(weights.scales, weights.zeros)
    x = torch.randn(3, k, generator=gen, device=CUDA).to(torch.bfloat16)
    monkeypatch.setenv("PLINTH_W4A16_CUDA", launch)
    exact = reference_decode(x.cpu(), codes.cpu(), scales.cpu(), n)
    eager = mma_decode(x, codes, scales, n)
    assert _relative(eager, exact) < 5e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma_decode(x, codes, scales, n)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("rows", [1, 8, 13])
def test_dependent_launches_in_a_graph_match_eager_kernels(layers, rows, monkeypatch):
    """A decoder MLP chain captured in a CUDA graph, where on Hopper each GEMV starts while the Triton
    kernel before it runs (programmatic dependent launch) and reads its activations only after
    ``griddepcontrol.wait``: the replay's outputs equal the eager (ordinary launch) results bit for bit,
    with inputs changed between replays (a GEMV reading its input early would see the old values). The
    Triton kernels are launched as dependents too (as next to prepared W4A16 weights) and wait first."""
    from plinth.kernels import nvrtc, ops

    monkeypatch.setattr(nvrtc, "prefetching_kernels", nvrtc.dependent_launches)

    up, down = layers["gate_up"], layers["down"]
    packed = {name: (pack_mma_codes(w.q), pack_mma_scales(w.scales, w.zeros), w.shape[0])
              for name, w in (("up", up), ("down", down))}
    norm_w = torch.rand(4096, device=CUDA).to(torch.bfloat16) + 0.5

    def chain(x, residual):
        h, r = ops.rms_norm(x, norm_w, 1e-5, residual)
        g = mma_decode(h, *packed["up"])
        return mma_decode(ops.silu_and_mul(g), *packed["down"]), r

    gen = torch.Generator(device=CUDA).manual_seed(7)
    x = torch.randn(rows, 4096, generator=gen, device=CUDA).to(torch.bfloat16)
    residual = torch.randn(rows, 4096, generator=gen, device=CUDA).to(torch.bfloat16)
    dependent = CAPABILITY >= (9, 0) and nvrtc.dependent_launches(x.device)
    assert ops.dependent_options(x) == ({"DEPENDENT": True, "launch_pdl": True} if dependent else {})
    chain(x, residual)   # compile outside the capture
    torch.cuda.synchronize()
    seen = []
    real = nvrtc.dependent_launch
    monkeypatch.setattr(nvrtc, "dependent_launch", lambda device: seen.append(real(device)) or seen[-1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_residual = chain(x, residual)
    assert seen and all(flag == dependent for flag in seen)
    monkeypatch.setenv("PLINTH_PDL", "0")   # the references below: ordinary launches throughout
    for seed in (8, 9, 10):
        gen.manual_seed(seed)
        x.copy_(torch.randn(rows, 4096, generator=gen, device=CUDA))
        residual.copy_(torch.randn(rows, 4096, generator=gen, device=CUDA))
        graph.replay()
        expect, expect_residual = chain(x, residual)
        torch.cuda.synchronize()
        assert torch.equal(out, expect) and torch.equal(new_residual, expect_residual), seed
