"""The Triton FP8 weight-only GEMM (``triton_fp8``) in Triton's CPU interpreter: against float64 math with per-channel
and block scales (blocks ending inside the weight), and inside a model on a block-FP8 checkpoint. float32 and float16
are exact in the interpreter; on a machine with CUDA this module is skipped unless ``PLINTH_TRITON_INTERPRET=1``."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("PLINTH_TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the GPU test files cover the kernel", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from test_quantization_support import (  # noqa: E402
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
from plinth.quantization.kernels.fp8_triton import TritonFP8Kernel, fp8_tiles  # noqa: E402
from plinth.quantization.kernels.interface import GemmProblem  # noqa: E402
from plinth.quantization.kernels.w4a16_triton import load_jit_module  # noqa: E402
from plinth.quantization.selection import holder  # noqa: E402

INTERPRETED = import_interpreted(lambda: load_jit_module("plinth.quantization.kernels.fp8_triton_jit")
                                 .fp8_w8a16_gemm_kernel)
needs_interpreter = needs(INTERPRETED)


def test_in_a_fresh_process():
    run_in_fresh_process(__file__, INTERPRETED)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    set_interpreter_env(monkeypatch)


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
def test_block_fp8_model_on_the_triton_kernel(tiny_llama_dir, tmp_path):
    from test_quantization import _fp8_checkpoint

    path, deq = _fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "block", block=(32, 32))
    model, backend, method = load_plinth(path, gemm_kernel="triton_fp8")
    assert method.kernel.name == "triton_fp8"
    compare(model, backend, reference_model(tiny_llama_dir, deq), atol=1e-3, min_agreement=0.95)
