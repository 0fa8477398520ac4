"""``LLM.apply_model`` (vLLM's): a function run on the model of every rank, between steps, its results in rank
order; refusals for what cannot reach worker processes, and the engine going on after a failing function."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from conftest import save_tiny_model

from plinth import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("apply") / "m", seed=0)


def tokens(llm):
    outs = llm.generate(["The quick brown fox", "0123"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def shapes(model):
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def scale_final_norm(model, factor=0.0):
    with torch.no_grad():
        model.model.norm.weight.mul_(factor)
    return float(model.model.norm.weight.abs().sum())


def fails(model):
    raise ValueError("nothing to see")


def unpicklable_result(model):
    return (p for p in model.parameters())


def first_rank_fails_the_other_is_slow(model):
    import time

    from plinth.distributed.parallel_state import get_parallel_state

    if get_parallel_state().layout.rank == 0:
        raise ValueError("rank 0 refuses")
    time.sleep(2.0)
    return "late"


@pytest.fixture(autouse=True)
def _plain_weights(monkeypatch):
    """The CPU path's plain weights (on CPUs without native bfloat16 it multiplies repacked copies of float32 ones)."""
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")


def test_a_function_sees_and_changes_the_model(model_dir):
    llm = LLM(str(model_dir), dtype="float32", selection="off")
    assert llm.llm_engine is llm.engine
    before = tokens(llm)
    [got] = llm.apply_model(shapes)
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert got["model.layers.0.self_attn.qkv_proj.weight"] == (
        (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim, cfg["hidden_size"])
    assert llm.apply_model(scale_final_norm) == [0.0]   # every hidden state normed to zero: zero logits
    llm.reset_prefix_cache()
    assert tokens(llm) == [[0] * 8] * 2   # (argmax of equal logits: the first token)
    with pytest.raises(ValueError, match="nothing to see"):
        llm.apply_model(fails)
    front_result = None

    async def main():
        nonlocal front_result
        from plinth.core.async_engine import AsyncLLMEngine

        front = AsyncLLMEngine(llm.engine)
        try:
            front_result = await front.apply_model(shapes)
        finally:
            front.shutdown()

    asyncio.run(main())
    assert front_result == [got]
    assert before != [[0] * 8] * 2


@pytest.fixture(scope="module")
def processes():
    from plinth.distributed.executor_mp import WorkerProcesses

    with pytest.MonkeyPatch.context() as env:   # (the workers' environment is fixed when they start)
        env.setenv("PLINTH_CPU_PACKED", "0")
        procs = WorkerProcesses(2, timeout_s=120.0)
    yield procs
    procs.stop()


def test_every_rank_runs_it(model_dir, processes):
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    whole = LLM(str(model_dir), dtype="float32", selection="off").apply_model(shapes)[0]
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", selection="off",
                                      distributed_executor="mp", platform="cpu", tensor_parallel_size=2)
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    llm = LLM.__new__(LLM)   # an LLM over this engine (its executor on the shared worker processes)
    llm.engine, llm._ids, llm._lock = engine, iter(range(10**6)), threading.RLock()
    try:
        before = tokens(llm)
        ranks = llm.apply_model(shapes)
        assert len(ranks) == 2 and ranks[0] == ranks[1]
        name = "model.layers.0.self_attn.qkv_proj.weight"   # each rank its half of the heads
        assert ranks[0][name][0] * 2 == whole[name][0] and ranks[0][name][1] == whole[name][1]
        with pytest.raises(TypeError, match="cannot reach the worker processes"):
            llm.apply_model(lambda model: 1)
        with pytest.raises(ValueError, match="nothing to see"):
            llm.apply_model(fails)
        with pytest.raises(TypeError, match="cannot go back to the driver"):
            llm.apply_model(unpicklable_result)
        assert tokens(llm) == before   # the workers went on
        assert llm.apply_model(scale_final_norm) == [0.0, 0.0]
        llm.reset_prefix_cache()
        assert tokens(llm) == [[0] * 8] * 2
    finally:
        engine.shutdown()


def test_a_function_failing_while_another_rank_is_still_busy_stops_the_workers(model_dir, monkeypatch):
    """A function that raises on one rank while another has not finished it in time: that rank's answer would be read
    as the next call's (here the last pipeline stage's, as the next step's tokens: wrong outputs), so the function's
    error goes to the caller, the workers stop, and the next call says why."""
    from test_distributed_helpers import wait_gone

    import plinth.distributed.executor_mp as executor_mp
    from plinth.core.async_engine import EngineDeadError

    monkeypatch.setattr(executor_mp, "DRAIN_WAIT_S", 0.2)
    with LLM(str(model_dir), dtype="float32", selection="off", distributed_executor="mp", platform="cpu",
             pipeline_parallel_size=2) as llm:
        pids = llm.engine.executor.worker_pids
        with pytest.raises(ValueError, match="rank 0 refuses"):
            llm.apply_model(first_rank_fails_the_other_is_slow)
        with pytest.raises(EngineDeadError, match="'apply_model' failed on a worker"):
            tokens(llm)
        assert wait_gone(pids, 10.0) == []
