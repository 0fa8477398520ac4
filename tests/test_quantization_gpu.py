"""Quantized GEMM kernels on a GPU at Llama-3-8B's shapes, in bfloat16, against the dequantize reference.

Shapes (one rank, no tensor parallelism): fused QKV ``N=6144, K=4096``, output ``4096 x 4096``, fused
gate/up ``28672 x 4096``, down ``4096 x 14336``; row counts of a decode step (1, 16) and of prefill
chunks (128, 1024). Skipped without CUDA; the FP8 tests also without FP8 tensor cores (capability 8.9).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from plinth.quantization.kernels.dequant import DequantFP8Kernel, DequantIntKernel  # noqa: E402
from plinth.quantization.kernels.fp8_scaled_mm import ScaledMMFP8Kernel  # noqa: E402
from plinth.quantization.kernels.int4pack import TorchInt4PackKernel  # noqa: E402
from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel  # noqa: E402
from plinth.quantization.quantizers import (  # noqa: E402
    quantize_fp8_per_channel,
    quantize_fp8_tokens,
    quantize_int_rtn,
)
from plinth.quantization.selection import holder  # noqa: E402

CUDA = torch.device("cuda")
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 128, 1024)
CAPABILITY = torch.cuda.get_device_capability()
needs_fp8 = pytest.mark.skipif(CAPABILITY < (8, 9), reason=f"FP8 tensor cores need 8.9, this GPU has {CAPABILITY}")


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def int4_layers():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    out = {}
    for name, (n, k) in LLAMA3_8B.items():
        w = torch.randn(n, k, generator=gen, device=CUDA) * 0.02
        out[name] = quantize_int_rtn(w, 4, 128)
    return out


@pytest.mark.parametrize("kernel_cls", [TritonW4A16Kernel, TorchInt4PackKernel], ids=lambda c: c.name)
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_w4a16_kernels_match_dequant_reference(int4_layers, kernel_cls, layer):
    if kernel_cls is TritonW4A16Kernel and importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    weights = int4_layers[layer]
    n, k = weights.shape
    problem = GemmProblem("int", torch.bfloat16, "cuda", CAPABILITY, bits=4, group_size=128, shapes=((n, k),))
    support = kernel_cls.supports(problem)
    assert support, support.reason
    kernel = kernel_cls(problem)
    module = holder(kernel.prepare(weights))
    dense = weights.dequantize(torch.bfloat16).float()                          # [N, K]
    gen = torch.Generator(device=CUDA).manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
        out = kernel.apply(module, x, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        ref = x.float() @ dense.t()
        assert _relative(out, ref) < 2e-2, (layer, m)
    reference = DequantIntKernel(problem)
    ref_out = reference.apply(holder(reference.prepare(weights)), x, None)
    assert _relative(out, ref_out.float()) < 2e-2  # agrees with the candidate selection checks against


@needs_fp8
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_fp8_scaled_mm_matches_references(layer):
    n, k = LLAMA3_8B[layer]
    gen = torch.Generator(device=CUDA).manual_seed(2)
    weights = quantize_fp8_per_channel(torch.randn(n, k, generator=gen, device=CUDA) * 0.02)
    problem = GemmProblem("fp8", torch.bfloat16, "cuda", CAPABILITY, activation="fp8_token", shapes=((n, k),))
    assert ScaledMMFP8Kernel.supports(problem)
    kernel = ScaledMMFP8Kernel(problem)
    module = holder(kernel.prepare(weights))
    dense = weights.dequantize(torch.float32)                                   # [N, K]
    for m in ROWS:
        x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
        out = kernel.apply(module, x, None)
        # the same product with the activations rounded to FP8 per token, in float32: only the
        # accumulation order and the bfloat16 output differ
        xq, scale = quantize_fp8_tokens(x)
        emulated = (xq.float() * scale) @ dense.t()
        assert _relative(out, emulated) < 1e-2, (layer, m)
        # against the weight-only reference the activation rounding shows: a few percent at most
        assert _relative(out, x.float() @ dense.t()) < 8e-2, (layer, m)
    reference = DequantFP8Kernel(problem)
    assert _relative(out, reference.apply(holder(reference.prepare(weights)), x, None).float()) < 8e-2


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_triton_fp8_matches_dequant_reference(layer, block):
    """The Triton FP8 weight-only GEMM in bfloat16 with DeepSeek-style 128x128 blocks and per-channel scales."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    from plinth.quantization.formats import FP8Weights
    from plinth.quantization.kernels.fp8_triton import TritonFP8Kernel

    n, k = LLAMA3_8B[layer]
    gen = torch.Generator(device=CUDA).manual_seed(3)
    w = torch.randn(n, k, generator=gen, device=CUDA) * 0.02
    if block is None:
        weights = quantize_fp8_per_channel(w)
    else:
        blocks = w.reshape(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        weights = FP8Weights(q, scale, block)
    problem = GemmProblem("fp8", torch.bfloat16, "cuda", CAPABILITY, block=block, shapes=((n, k),))
    support = TritonFP8Kernel.supports(problem)
    assert support, support.reason
    kernel = TritonFP8Kernel(problem)
    module = holder(kernel.prepare(weights))
    dense = weights.dequantize(torch.float32)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
        out = kernel.apply(module, x, None)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert _relative(out, x.float() @ dense.t()) < 2e-2, (layer, m)


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_engine_with_cuda_graphs(quantization):
    """Decode replayed from CUDA graphs gives the eager run's greedy tokens."""
    from plinth import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    runs = []
    for eager in (True, False):
        llm = LLM("tiny-llama", load_format="dummy", quantization=quantization, dtype="bfloat16",
                  enforce_eager=eager, max_num_seqs=8, gpu_memory_utilization=0.3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        method = llm.engine.runner.model.ctx.quant_method
        assert method.kernel_selection is not None
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


@needs_fp8
def test_fp8_engine_takes_rows_quantized_by_the_norms(monkeypatch):
    """With ``fp8_scaled_mm`` the qkv, gate/up and down projections get their FP8 rows from the RMSNorm and
    SiLU-and-mul kernels (eager and in CUDA graphs), and the greedy tokens are those of the kernel quantizing
    its own input (the same bits)."""
    from plinth import LLM, SamplingParams
    from plinth.kernels import ops

    handed = []
    real = ScaledMMFP8Kernel.apply

    def counting(self, layer, x, bias):
        handed.append(isinstance(x, ops.QuantizedRows))
        return real(self, layer, x, bias)

    monkeypatch.setattr(ScaledMMFP8Kernel, "apply", counting)
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    runs = {}
    for hand_over, eager in ((True, True), (True, False), (False, False)):
        if not hand_over:
            monkeypatch.setattr(ScaledMMFP8Kernel, "input_quant", None)
        llm = LLM("tiny-llama", load_format="dummy", quantization="fp8", dtype="bfloat16", gemm_kernel="fp8_scaled_mm",
                  enforce_eager=eager, max_num_seqs=8, gpu_memory_utilization=0.3)
        handed.clear()   # (kernel selection and warm-up ran the kernel on plain inputs)
        runs[hand_over, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if eager:   # qkv, gate/up, down of every layer and step get FP8 rows; o_proj quantizes its own
            assert handed.count(True) > 0 and handed.count(True) == 3 * handed.count(False), \
                (handed.count(True), handed.count(False))
        del llm
        torch.cuda.empty_cache()
    assert runs[True, True] == runs[True, False] == runs[False, False]


def test_engine_fuses_silu_into_the_int4_gate_up_kernel(monkeypatch):
    """With ``cuda_w4a16`` the MLPs' gate/up layers return ``silu(gate) * up`` for decode rows, and the
    greedy tokens follow those of the separate activation kernel (``PLINTH_W4A16_SILU=0``; the two differ by
    a bfloat16 rounding step in a few outputs, so a near tie may part them late)."""
    from plinth import LLM, SamplingParams
    from plinth.quantization.kernels.w4a16_cuda import CudaW4A16Kernel

    fused_calls = []
    real = CudaW4A16Kernel.apply_silu_mul

    def counting(self, layer, x, bias):
        out = real(self, layer, x, bias)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(CudaW4A16Kernel, "apply_silu_mul", counting)
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("PLINTH_W4A16_SILU", fused)
        fused_calls.clear()
        llm = LLM("tiny-llama", load_format="dummy", quantization="int4", dtype="bfloat16", gemm_kernel="cuda_w4a16",
                  enforce_eager=True, max_num_seqs=8, gpu_memory_utilization=0.3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert any(fused_calls) == (fused == "1")
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(*runs, strict=True):
        assert a[:4] == b[:4]
    agree = sum(x == y for a, b in zip(*runs, strict=True) for x, y in zip(a, b, strict=True))
    assert agree >= 0.75 * sum(len(a) for a in runs[0])


def test_selection_times_decode_steps_on_the_device(tmp_path):
    """GEMM selection on a GPU times the decode steps by device time (events around launches queued behind
    a sleep kernel, so the host's launch path is not measured) and the prefill by the host clock; the
    record carries each candidate's score (mean time relative to the fastest at each step)."""
    from plinth.platforms.selection import select_platform
    from plinth.quantization.int4 import Int4Method
    from plinth.quantization.interface import GemmWorkload, QuantContext
    from plinth.quantization.selection import GemmCandidates

    ctx = QuantContext(hf_config=None, dtype=torch.bfloat16, device=CUDA, platform=select_platform("cuda"),
                       selection="benchmark", cache_dir=tmp_path, workload=GemmWorkload(8, 64))
    method = Int4Method(ctx, bits=4, group_size=128)
    result = method.select_kernel([(1024, 512), (512, 1024)])
    timed = [r for r in result.candidates if r.times_ms]
    assert len(timed) >= 2
    for report in timed:
        assert set(report.times_ms) == {"decode-1", "decode", "prefill"}
        assert report.score is not None and report.score >= 1.0
    runners = GemmCandidates(method, method.problem, ctx.platform).step_runners(result.winner_cls)
    for label in ("decode-1", "decode"):
        first, second = runners[label](), runners[label]()
        # device time of a few small GEMMs: well under the 2 ms sleep they queue behind
        assert isinstance(second, float) and 0 < second < 1.0, (label, first, second)
    assert runners["prefill"]() is None
