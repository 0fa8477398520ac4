"""Tensor parallelism with quantization on CPU (gloo, the dequantizing kernels): ``--quantization int4``,
``--quantization fp8`` and the int8 plugin package's ``--quantization int8`` under TP=2 give the greedy tokens (and, within float32 rounding of the
all-reduce, the prompt logprobs) of the single-process engine with the same quantization.

The model's shapes keep every row-parallel input split (attention 256 -> 128, MLP 512 -> 256 per rank)
a multiple of int4's group size (128 at TP=1 and at TP=2), so both layouts quantize the same groups.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed_helpers import COMMON, ENGINE_KW, FAMILIES, run_greedy, save_family

from plinth.config import EngineConfig
from plinth.core.engine import LLMEngine
from plinth.distributed.executor_mp import MultiprocExecutor
from plinth.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from plinth.quantization.fp8 import FP8Method
from plinth.quantization.interface import QuantContext
from plinth.quantization.quantizers import quantize_fp8_per_channel

SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2)
CASES = [("int4", "dequant"), ("int4", None), ("fp8", "dequant"), ("int8", "dequant")]   # (quantization, forced GEMM kernel)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setitem(FAMILIES, "llama_quant", ("LlamaConfig", "LlamaForCausalLM", SHAPES))
    return save_family("llama_quant", tmp_path_factory.mktemp("llama_quant"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _config(path, tp: int, quantization: str | None, kernel: str | None) -> EngineConfig:
    kw = dict(ENGINE_KW, quantization=quantization)
    if kernel is not None:
        kw["gemm_kernel"] = kernel
    if tp > 1:
        kw.update(tensor_parallel_size=tp, distributed_executor="mp")
    return EngineConfig.from_kwargs(model=str(path), **kw)


def _max_logprob_gap(a, b) -> float:
    """The largest difference between two runs' prompt logprobs of request r0, over the tokens both
    report at each position (the prompt's own token is always among them)."""
    gaps = []
    for pos_a, pos_b in zip(a["r0"][1], b["r0"][1], strict=True):
        gaps += [abs(lp - pos_b[tid]) for tid, lp in pos_a.items() if tid in pos_b]
    assert len(gaps) >= len(a["r0"][1])
    return max(gaps)


@pytest.mark.parametrize("quantization,kernel", CASES, ids=[f"{q}-{k or 'selected'}" for q, k in CASES])
def test_tp2_quantized_equals_tp1_quantized(checkpoint, processes, quantization, kernel):
    assert COMMON["vocab_size"] == 307   # the shared prompts are in range
    reference = run_greedy(LLMEngine(_config(checkpoint, 1, quantization, kernel)))
    engine = LLMEngine(_config(checkpoint, 2, quantization, kernel),
                       executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        assert engine.runner is None and len(engine.executor.worker_pids) == 2
        result = run_greedy(engine)
    finally:
        engine.shutdown()
    assert not processes.broken
    for rid, (tokens, _) in reference.items():
        assert result[rid][0] == tokens, f"{quantization} request {rid}"
    assert _max_logprob_gap(reference, result) < 1e-4   # measured: 4e-6 .. 1.3e-5
    # the quantization is really in effect: the float model's logprobs are far from both
    float_run = run_greedy(LLMEngine(_config(checkpoint, 1, None, None)))
    assert _max_logprob_gap(reference, float_run) > 0.1   # measured: 1.8 (fp8), 5.0 (int4), 0.48 (int8)


def _fp8_layer(cls, tp_rank: int) -> tuple[torch.nn.Module, FP8Method]:
    ctx = QuantContext(hf_config=None, dtype=torch.float32, device=torch.device("cpu"), tp_size=2)
    method = FP8Method(ctx, from_checkpoint=False)
    return cls(64, 16, tp_rank=tp_rank, tp_size=2, quant_method=method), method


def test_fp8_row_parallel_shards_use_the_full_row_scales():
    """Each rank's input-feature shard is quantized with the scales of the whole checkpoint row, so the
    shards put together are exactly the TP=1 quantization (a shard-local max would rescale each half)."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(16, 64, generator=gen)
    full[:8, 40] = 9.0    # rows whose largest value lies in rank 1's half
    full[8:, 3] = -7.0    # and rows whose largest value lies in rank 0's half
    whole = quantize_fp8_per_channel(full)
    for rank in (0, 1):
        layer, method = _fp8_layer(RowParallelLinear, rank)
        layer.weight.weight_loader(layer.weight, full)
        shard = method.convert_weights(layer)
        assert torch.equal(shard.scale, whole.scale)
        cols = slice(32 * rank, 32 * (rank + 1))
        assert torch.equal(shard.weight.view(torch.uint8), whole.weight[:, cols].view(torch.uint8))
        assert "row_absmax" not in layer.__dict__   # the kept maxima are dropped after conversion
    # column-parallel layers hold whole rows: their own maxima are the full row's
    layer, method = _fp8_layer(ColumnParallelLinear, 1)
    layer.weight.weight_loader(layer.weight, full)
    assert torch.equal(method.convert_weights(layer).scale, whole.scale[8:])
