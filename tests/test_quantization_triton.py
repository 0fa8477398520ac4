"""The Triton W4A16 and FP8 (``triton_fp8``) kernels in Triton's CPU interpreter: against float64 math, against the
other kernels, inside kernel selection and inside a model (an AWQ checkpoint, a block-FP8 checkpoint).

As in tests/test_triton_attention.py, the kernel module is imported with ``TRITON_INTERPRET=1`` and
every test sets the variables for its own duration only. float32 and float16 are exact in the
interpreter; bfloat16 is covered by tests/test_quantization_gpu.py. On a machine with CUDA this module
is skipped unless ``PLINTH_TRITON_INTERPRET=1`` is set.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("PLINTH_TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the GPU test file covers the kernel", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from test_quantization_awq_gptq import awq_checkpoint  # noqa: E402
from test_quantization_support import (  # noqa: E402
    PROMPTS,
    compare,
    load_plinth,
    one_thread,  # noqa: F401 (an autouse fixture)
    reference_model,
)
from triton_interpreter import (  # noqa: E402
    import_interpreted,
    interpreter_usable,  # noqa: F401 (read by the skip conditions)
    needs,
    run_in_fresh_process,
    set_interpreter_env,
)

from plinth.quantization.formats import FP8_MAX, FP8Weights  # noqa: E402
from plinth.quantization.interface import GemmWorkload, QuantContext  # noqa: E402
from plinth.quantization.kernels import w4a16_triton  # noqa: E402
from plinth.quantization.kernels.dequant import DequantIntKernel  # noqa: E402
from plinth.quantization.kernels.fp8_triton import TritonFP8Kernel, fp8_tiles  # noqa: E402
from plinth.quantization.kernels.int4pack import TorchInt4PackKernel  # noqa: E402
from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_triton import TritonW4A16Kernel, choose_tiles  # noqa: E402
from plinth.quantization.quantizers import random_int_weights  # noqa: E402
from plinth.quantization.selection import holder  # noqa: E402

CPU = torch.device("cpu")


INTERPRETED = (import_interpreted(lambda: w4a16_triton.load_jit_module().w4a16_gemm_kernel)
               and import_interpreted(lambda: w4a16_triton.load_jit_module("plinth.quantization.kernels.fp8_triton_jit")
                                      .fp8_w8a16_gemm_kernel))
needs_interpreter = needs(INTERPRETED)


def test_in_a_fresh_process():
    run_in_fresh_process(__file__, INTERPRETED)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    set_interpreter_env(monkeypatch)


def _problem(dtype, group, n, k, act_order=False) -> GemmProblem:
    return GemmProblem("int", dtype, "cpu", bits=4, group_size=group, act_order=act_order, shapes=((n, k),))


def _run(cls, problem, weights, x, bias=None) -> torch.Tensor:
    kernel = cls(problem)
    return kernel.apply(holder(kernel.prepare(weights)), x, bias)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,group,act_order", [
    (1, 96, 256, 128, False),    # decode row, split K
    (5, 80, 128, 32, True),      # N not a multiple of the tile, act order
    (24, 64, 128, 64, False),    # the mid-size tile
    (70, 48, 64, 64, False),     # the large tile, more rows than one tile
], ids=["decode", "masked-act_order", "mid", "large"])
def test_triton_w4a16_matches_float64(dtype, m, n, k, group, act_order):
    gen = torch.Generator().manual_seed(m + n)
    w = random_int_weights(n, k, 4, group, symmetric=False, act_order=act_order, device=CPU, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    problem = _problem(dtype, group, n, k, act_order)
    assert TritonW4A16Kernel.supports(problem)
    out = _run(TritonW4A16Kernel, problem, w, x, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ w.dequantize(torch.float64).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 3e-3  # relative to the largest output
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_tile_choice_splits_k_for_small_batches():
    decode = choose_tiles(1, 4096, 4096, 128, num_sms=132)
    assert decode.block_m == 16 and decode.split_k > 1 and 4096 % decode.block_k == 0
    prefill = choose_tiles(512, 4096, 4096, 128, num_sms=132)
    assert prefill.split_k == 1 and prefill.block_m == 128
    assert choose_tiles(8, 64, 96, 32, num_sms=4).block_k == 32  # a tile never straddles two groups


@needs_interpreter
def test_candidates_agree_with_each_other():
    gen = torch.Generator().manual_seed(5)
    w = random_int_weights(64, 256, 4, 64, symmetric=False, act_order=True, device=CPU, generator=gen)
    x = torch.randn(9, 256, generator=gen)
    problem = _problem(torch.float32, 64, 64, 256, act_order=True)
    outs = {cls.name: _run(cls, problem, w, x) for cls in (TritonW4A16Kernel, TorchInt4PackKernel, DequantIntKernel)}
    for name, out in outs.items():
        assert torch.allclose(out, outs["dequant"], rtol=1e-4, atol=1e-5), name


@needs_interpreter
def test_selection_times_the_triton_kernel(tmp_path):
    from plinth.platforms.selection import select_platform
    from plinth.quantization.int4 import Int4Method

    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=CPU, platform=select_platform("cpu"),
                       selection="benchmark", cache_dir=tmp_path, workload=GemmWorkload(2, 20))
    result = Int4Method(ctx, bits=4, group_size=32).select_kernel([(64, 64)])
    reports = {r.name: r for r in result.candidates}
    assert reports["triton_w4a16"].supported and reports["triton_w4a16"].max_error < 1e-5
    assert set(reports["triton_w4a16"].times_ms) == {"decode-1", "decode", "prefill"}
    timed = [r for r in reports.values() if r.times_ms]
    best = {label: min(r.times_ms[label] for r in timed) for label in ("decode-1", "decode", "prefill")}
    for r in timed:   # the geometric mean time relative to the fastest per step; the winner has the lowest
        assert r.score == pytest.approx(math.prod(r.times_ms[k] / best[k] for k in best) ** (1 / 3))
    assert min(timed, key=lambda r: r.score).name == result.winner


@needs_interpreter
def test_awq_model_on_the_triton_kernel(tiny_llama_dir, tmp_path):
    from paged_driver import PagedDriver, build_metadata

    path, deq = awq_checkpoint(tiny_llama_dir, tmp_path / "awq", group=32)
    model, backend, method = load_plinth(path, gemm_kernel="triton_w4a16")
    assert method.kernel.name == "triton_w4a16"
    ref = reference_model(tiny_llama_dir, deq)
    prompt = PROMPTS[0]
    PagedDriver(model, backend, block_size=4)  # allocates the KV caches
    ids, pos, md = build_metadata([(prompt, 0, [3, 9])], block_size=4)
    backend.prepare(md)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, pos, md))                     # [L, vocab]
        theirs = ref(torch.tensor([prompt])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3  # measured: ~1.4e-6
    generated, _ = PagedDriver(model, backend, block_size=4).generate_greedy(PROMPTS[:2], 4)
    with torch.no_grad():
        for p, got in zip(PROMPTS[:2], generated, strict=True):
            seq = list(p)
            for _ in range(4):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            assert got == seq[len(p):]


# ------------------------------------------------------------------------------ triton_fp8


def _fp8(n: int, k: int, block: tuple[int, int] | None, gen: torch.Generator) -> FP8Weights:
    w = torch.randn(n, k, generator=gen)
    if block is None:
        scale = w.abs().amax(1) / FP8_MAX
        return FP8Weights((w / scale[:, None]).to(torch.float8_e4m3fn), scale)
    bn, bk = block
    scale = torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 0.01 + 0.001
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return FP8Weights((w / full / 300).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale, block)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,block", [
    (1, 96, 256, (128, 128)),    # decode row, split K, DeepSeek's blocks
    (5, 40, 96, (32, 32)),       # rows and columns ending inside a block (DeepSeek's 576-row kv_a_proj_with_mqa)
    (24, 64, 128, None),         # per-channel scales, the mid-size tile
    (70, 48, 64, (16, 64)),      # the large tile, more rows than one tile, narrow row blocks
], ids=["decode", "partial-blocks", "channel", "large"])
def test_triton_fp8_matches_float64(dtype, m, n, k, block):
    gen = torch.Generator().manual_seed(m + n)
    w = _fp8(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    problem = GemmProblem("fp8", dtype, "cpu", block=block, shapes=((n, k),))
    assert TritonFP8Kernel.supports(problem)
    kernel = TritonFP8Kernel(problem)
    out = kernel.apply(holder(kernel.prepare(w)), x, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ w.dequantize(torch.float64).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 3e-3  # relative to the largest output
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_tiles_and_refusals():
    assert fp8_tiles(1, 4096, 4096, 128, 132)[3] > 1                 # decode splits K
    assert fp8_tiles(512, 4096, 4096, 128, 132)[3] == 1
    assert fp8_tiles(8, 64, 96, 32, 4)[2] == 32                      # a K tile never straddles two scale blocks
    assert "multiple of 16" in TritonFP8Kernel.supports(GemmProblem("fp8", torch.float32, "cpu", block=(128, 8))).reason
    assert not TritonFP8Kernel.supports(GemmProblem("int", torch.float32, "cpu", bits=4))
    ampere = TritonFP8Kernel.supports(GemmProblem("fp8", torch.bfloat16, "cuda", (8, 0), block=(128, 128)))
    assert not ampere and "8.9 and newer" in ampere.reason


@needs_interpreter
def test_selection_checks_and_times_block_fp8_kernels(tmp_path):
    """Selection over a block-FP8 problem checks and times every candidate on weights with block scales (they were
    given per-channel scales, which every block kernel failed on: no FP8 block checkpoint could start with
    selection on a GPU)."""
    from plinth.platforms.selection import select_platform
    from plinth.quantization.fp8 import FP8Method

    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=CPU, platform=select_platform("cpu"),
                       selection="benchmark", cache_dir=tmp_path, workload=GemmWorkload(4, 16))
    method = FP8Method(ctx, from_checkpoint=True, block=(32, 32))
    weights = method.random_weights(40, 96, CPU, torch.Generator().manual_seed(0))
    assert weights.block == (32, 32) and weights.scale.shape == (2, 3)
    result = method.select_kernel([(64, 96), (96, 64)])
    checked = {r.name: r for r in result.candidates}
    for name in ("dequant", "triton_fp8"):
        assert checked[name].times_ms and not checked[name].reason, (name, checked[name].reason)


@needs_interpreter
def test_block_fp8_model_on_the_triton_kernel(tiny_llama_dir, tmp_path):
    from test_quantization import _fp8_checkpoint

    path, deq = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "block", block=(32, 32))
    model, backend, method = load_plinth(path, gemm_kernel="triton_fp8")
    assert method.kernel.name == "triton_fp8"
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
