"""Asynchronous scheduling with worker processes (TP=2 on CPU, gloo): the driver launches step N+1 before
it reads step N's tokens; the workers feed step N's tokens (sampled on rank 0, broadcast over the TP group)
into step N+1 on their devices and answer each launch with the previous step's output.

Everything is compared with the same TP=2 layout run synchronously (the same arithmetic, so the same bits):
greedy tokens with prompt logprobs and a seeded sample, random mixes of stops, logprobs, n=2, late arrivals
and aborts under chunked prefill and preemption, and the engine's state after each run.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import drive
from test_distributed_helpers import ENGINE_KW, PROMPTS, SEEDED, greedy, run_greedy, save_family

from plinth import SamplingParams
from plinth.config import EngineConfig
from plinth.core.engine import LLMEngine
from plinth.distributed.executor_mp import MultiprocExecutor, WorkerProcesses


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("llama"))


def _engine(path, processes, async_scheduling: bool, **kw) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2, distributed_executor="mp",
                                      async_scheduling=async_scheduling, **{**ENGINE_KW, **kw})
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    assert engine.async_scheduling == async_scheduling
    return engine


def _count_launches(engine: LLMEngine) -> dict[str, int]:
    counts = {"launched": 0, "fed": 0}
    launch = engine.executor.launch

    def counting(batch, make):
        counts["launched"] += 1
        counts["fed"] += batch.feed is not None
        return launch(batch, make)

    engine.executor.launch = counting
    return counts


def test_async_tp2_equals_sync_tp2(llama, processes):
    sync = _engine(llama, processes, False)
    try:
        reference = run_greedy(sync)
    finally:
        sync.shutdown()
    engine = _engine(llama, processes, True)
    try:
        result = run_greedy(engine)   # r0's prompt logprobs make the steps synchronous while it runs
        counts = _count_launches(engine)
        plain = {f"r{i}": p for i, p in enumerate(PROMPTS)}
        for rid, prompt in plain.items():
            engine.add_request(rid, prompt, greedy())
        engine.add_request("seeded", PROMPTS[-1], SEEDED)
        overlapped = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    overlapped[out.request_id] = out.outputs[0].token_ids
        assert counts["fed"] > 0 and counts["launched"] > counts["fed"]   # steps ran with one in flight
        assert engine.executor._owed is None
    finally:
        engine.shutdown()
    assert not processes.broken
    for rid, (tokens, lps) in reference.items():
        assert result[rid][0] == tokens and overlapped[rid] == tokens, rid
        for ref_pos, got_pos in zip(lps, result[rid][1], strict=True):
            assert ref_pos == pytest.approx(got_pos, abs=1e-6)
    assert reference["r0"][0] != reference["r1"][0]


def test_async_tp2_random_mixes_equal_sync(llama, processes):
    """Random stop ids, n=2, logprobs, penalties (synchronous steps in between), lengths, late arrivals and
    aborts, with chunked prefill and preemption (few KV blocks): every request that was not aborted ends as
    in the synchronous engine, and every KV block is free afterwards."""
    config = dict(max_num_batched_tokens=6, max_num_seqs=3, num_blocks=40, enable_prefix_caching=False)
    cases = []
    for seed in range(2):
        rng = random.Random(seed)
        reqs = []
        for i in range(7):
            kw = dict(temperature=0.0, max_tokens=rng.randrange(1, 14), ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.3:
                kw["stop_token_ids"] = rng.sample(range(300), 20)
            if rng.random() < 0.2:
                kw["n"] = 2
            if rng.random() < 0.2:
                kw["logprobs"] = 1
            if rng.random() < 0.15:   # penalties make the steps synchronous while the request runs
                kw["presence_penalty"] = 0.5
            prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 12))]
            reqs.append((rng.randrange(0, 5), f"q{i}", prompt, SamplingParams(**kw)))
        aborts = {f"q{i}": rng.randrange(1, 10) for i in range(7) if rng.random() < 0.2}
        cases.append((reqs, aborts))
    assert any(params.presence_penalty for reqs, _ in cases for *_, params in reqs)   # sync steps in between
    results: dict[bool, list] = {}
    for mode in (True, False):   # one engine at a time: the two worker processes serve one executor
        engine = _engine(llama, processes, mode, **config)
        try:
            results[mode] = [_drive(engine, reqs, aborts) for reqs, aborts in cases]
        finally:
            engine.shutdown()
    assert results[True] == results[False]
    assert any(len(outs[0][0]) > 1 for case in results[True] for outs in case.values())
    assert not processes.broken


def _drive(engine: LLMEngine, reqs: list, aborts: dict[str, int]) -> dict:
    done = drive(engine, reqs, aborts, max_steps=1000)
    return {rid: [(c.token_ids, str(c.finish_reason)) for c in o.outputs] for rid, o in done.items()
            if rid not in aborts}


def test_pipeline_layouts_keep_synchronous_steps(llama, tmp_path):
    config = EngineConfig.from_kwargs(model=str(llama), pipeline_parallel_size=2, distributed_executor="mp",
                                      async_scheduling=True, **ENGINE_KW)
    engine = LLMEngine(config)
    try:
        assert not engine.async_scheduling and not engine.executor.supports_async_steps
    finally:
        engine.shutdown()


def test_the_default_follows_the_platform(llama, processes):
    """Unset, asynchronous scheduling is on for TP-only worker processes on accelerators only: off here."""
    config = EngineConfig.from_kwargs(model=str(llama), tensor_parallel_size=2, distributed_executor="mp", **ENGINE_KW)
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        assert engine.executor.supports_async_steps and not engine.async_scheduling
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_worker_processes_async_equals_sync_with_decode_graphs(tmp_path, tp):
    """GPUs, bfloat16, decode graphs, worker processes (``tp`` of them): the default (asynchronous) engine
    gives the synchronous one's greedy tokens, batched and at batch 1 (the fed tokens enter the captured
    graphs; with two ranks they are broadcast from rank 0)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    from plinth import LLM

    path = save_family("llama", tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(p) for p in PROMPTS]
    results = {}
    for mode in (None, False):
        with LLM(str(path), tensor_parallel_size=tp, distributed_executor="mp", dtype="bfloat16", block_size=16,
                 max_num_seqs=8, async_scheduling=mode) as llm:
            assert llm.engine.async_scheduling == (mode is None)
            batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            alone = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
            results[mode] = (batched, alone)
    assert results[None] == results[False]
    assert len({tuple(t) for t in results[None][0]}) > 2


def test_a_launch_that_fails_on_every_rank_fails_the_step_and_retires_shared_processes(llama):
    """A launch raises on every worker (here: rows fed before any step sampled); its error arrives with a
    later answer. The step raises, the executor shuts down, and processes shared with other executors are
    marked broken (answers were still due: their pipes are out of step), so no later engine reads stale
    answers."""
    import numpy as np

    from plinth.distributed.executor import WorkerDiedError
    from plinth.worker.batching import FlatBatch, TokenFeed

    procs = WorkerProcesses(2, timeout_s=120.0)
    try:
        engine = _engine(llama, procs, True)
        batch = FlatBatch(token_ids=np.array([5]), q_lens=np.array([1]), starts=np.array([0]),
                          block_tables=np.array([[1]], np.int32), block_counts=np.array([1]),
                          sample=np.array([True]), decode_only=True,
                          feed=TokenFeed(rows=np.array([0]), src=np.array([0])))
        step = engine.executor.launch(batch, None)
        with pytest.raises((RuntimeError, WorkerDiedError), match="sampled nothing|failed"):
            step.token_ids()
        assert procs.broken and engine.executor._closed
    finally:
        procs.stop()
