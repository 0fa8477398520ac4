"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's sampled tokens are read.

Scheduler level: the fake runner of ``test_scheduler`` (whose "model" sees a sequence only through its
KV blocks) is driven with one step in flight, its fed tokens taken from the previous step's output,
and must give the same tokens as the synchronous drive, through EOS stops, chunked prefill,
preemption and prefix-cache hits. Engine level: a tiny Llama on the CPU with asynchronous scheduling
forced on gives transformers' greedy tokens, and the synchronous engine's stop strings, stop ids,
aborts, and logprobs (which fall back to synchronous steps).
"""

from __future__ import annotations

import random

import pytest
from engine_driving import drive
from test_engine import MAX_TOKENS, PROMPTS, greedy, llm_for, token_ids, transformers_greedy
from test_scheduler import FakeRunner, make_scheduler, req
from test_scheduler import run as run_sync

from plinth import LLM, SamplingParams
from plinth.core.request import RequestStatus
from plinth.core.scheduler import Scheduler, SchedulerOutput
from plinth.worker.batching import BatchBuilder


def run_async(sched: Scheduler, requests, max_steps: int = 3000) -> tuple[dict[str, list[int]], int, int]:
    """Drive with one step in flight; returns the outputs, the number of fed tokens and of wasted rows."""
    runner = FakeRunner(sched.block_manager.block_size)
    for r in requests:
        sched.add_request(r)
    prev: tuple[SchedulerOutput, list[int | None]] | None = None
    num_fed = num_wasted = 0
    for _ in range(max_steps):
        if prev is None and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        fed = {}
        if prev is not None:
            fed = {e.request.request_id: t for e, t in zip(prev[0].scheduled, prev[1], strict=True) if t is not None}
        num_fed += sum(1 for e in out.scheduled if e.num_computed_tokens >= e.request.num_tokens)
        sampled = runner.execute(out, fed) if out.scheduled else []
        for e in out.scheduled:
            if e.sample:
                e.request.num_pending_tokens += 1
        if prev is not None:                      # read back the step in flight
            for e in prev[0].scheduled:
                if e.sample:
                    e.request.num_pending_tokens -= 1
            num_wasted += sum(1 for e in prev[0].scheduled if e.sample and e.request.is_finished)
            sched.update_from_output(*prev)
        prev = (out, sampled) if out.scheduled else None
    else:
        raise AssertionError("requests did not finish")
    return {r.request_id: r.output_token_ids for r in requests}, num_fed, num_wasted


def workload(seed: int, n: int = 12) -> list[tuple[str, list[int], int, tuple[int, ...]]]:
    rng = random.Random(seed)
    eos = tuple(rng.sample(range(1000), 40))   # about one step in 25 ends a request early
    shared = [rng.randrange(1000) for _ in range(9)]
    out = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        out.append((f"r{i}", prompt, rng.randrange(1, 40), eos))
    return out


@pytest.mark.parametrize("config", [
    dict(),
    dict(budget=8, max_seqs=4),                                   # chunked prefill mixed with decodes
    dict(num_blocks=20, budget=16, prefix_caching=False),         # preemption
    dict(num_blocks=24, budget=12, max_seqs=5),                   # preemption with prefix caching
], ids=["plain", "chunked", "preempt", "preempt-prefix"])
@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_async_equals_sync(config, seed):
    reqs_sync = [req(rid, p, m, eos) for rid, p, m, eos in workload(seed)]
    reqs_async = [req(rid, p, m, eos) for rid, p, m, eos in workload(seed)]
    sync_sched, async_sched = make_scheduler(**config), make_scheduler(**config)
    expected = run_sync(sync_sched, reqs_sync)
    got, num_fed, num_wasted = run_async(async_sched, reqs_async)
    assert got == expected
    assert num_fed > 0                                            # decodes did run ahead of the host
    assert [r.finish_reason for r in reqs_async] == [r.finish_reason for r in reqs_sync]
    assert all(r.num_pending_tokens == 0 for r in reqs_async)
    bm = async_sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks              # every block came back
    if "num_blocks" in config:
        assert async_sched.num_preemptions > 0
    if seed == 0 and not config:
        assert num_wasted > 0                                     # some EOS was found one step late


def test_pending_token_reaching_max_tokens_is_not_scheduled():
    sched = make_scheduler()
    r = req("a", [1, 2, 3], max_tokens=2)
    sched.add_request(r)
    out = sched.schedule()                                        # prefill: samples output token 1
    assert out.scheduled[0].sample
    r.num_pending_tokens = 1
    nxt = sched.schedule()                                        # decodes token 1 (not known yet), samples 2
    assert [(e.num_computed_tokens, e.num_new_tokens, e.sample) for e in nxt.scheduled] == [(3, 1, True)]
    r.num_pending_tokens = 0
    sched.update_from_output(out, [7])
    r.num_pending_tokens = 1
    assert sched.schedule().scheduled == []                       # token 2 in flight is the last one
    r.num_pending_tokens = 0
    sched.update_from_output(nxt, [8])
    assert r.output_token_ids == [7, 8] and r.status == RequestStatus.FINISHED_LENGTH


def test_pending_decodes_do_not_preempt_and_preempted_ones_wait_for_their_token():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)   # 4 usable blocks
    a, b = req("a", list(range(8)), max_tokens=8), req("b", list(range(20, 27)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()                                      # a: 2 blocks, b: 2 blocks (7 tokens)
    assert len(first.scheduled) == 2
    a.num_pending_tokens = b.num_pending_tokens = 1
    second = sched.schedule()    # a's unknown token needs a third block: a waits, nobody is preempted
    assert [e.request.request_id for e in second.scheduled] == ["b"] and not second.preempted_request_ids
    b.num_pending_tokens += 1                                     # second is launched
    a.num_pending_tokens -= 1
    b.num_pending_tokens -= 1
    sched.update_from_output(first, [5, 6])                       # first is read back
    third = sched.schedule()     # a's token is known now: a takes b's blocks (b's token still in flight)
    assert third.preempted_request_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    assert [e.request.request_id for e in third.scheduled] == ["a"]
    a.num_pending_tokens += 1
    sched.abort(["a"])                                            # room again, but b's token is in flight
    assert sched.schedule().scheduled == []
    b.num_pending_tokens -= 1
    sched.update_from_output(second, [9])
    assert b.output_token_ids == [6, 9]                           # the preempted request keeps its token
    nxt = sched.schedule()                                        # b is admitted again, with all its tokens
    assert [(e.request.request_id, e.num_computed_tokens + e.num_new_tokens, e.sample)
            for e in nxt.scheduled] == [("b", 9, True)]


def test_batch_builder_feeds_unknown_tokens():
    sched = make_scheduler()
    a, b = req("a", [1, 2, 3]), req("b", [4, 5])
    sched.add_request(a)
    sched.add_request(b)
    builder = BatchBuilder(64, 4)
    batch, sampled = builder.build(sched.schedule())
    assert batch.feed is None and sampled == [a, b]
    a.num_pending_tokens = b.num_pending_tokens = 1
    out = sched.schedule()
    with pytest.raises(ValueError, match="not known"):
        builder.build(out)
    batch, _ = builder.build(out, {"a": 0, "b": 1})
    assert batch.feed is not None
    assert batch.feed.rows.tolist() == [0, 1] and batch.feed.src.tolist() == [0, 1]
    import torch

    batch.feed.tokens = torch.tensor([11, 12])
    assert batch.feed.apply_on_host(batch.token_ids).tolist() == [11, 12]
    with pytest.raises(ValueError, match="no host token ids"):
        list(batch)


# ------------------------------------------------------------------------------------ engine level


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    return transformers_greedy(tiny_llama_dir)


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir) -> LLM:
    llm = llm_for(tiny_llama_dir, async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


def outputs_summary(outs) -> list:
    return [[(c.token_ids, c.text, str(c.finish_reason), c.stop_reason) for c in o.outputs] for o in outs]


def count_launches(llm: LLM) -> dict[str, int]:
    """Wrap the executor's launch to count launched steps and steps that were fed by the one in flight."""
    counts = {"launched": 0, "fed": 0}
    launch = llm.engine.executor.launch

    def counting(batch, make):
        counts["launched"] += 1
        counts["fed"] += batch.feed is not None
        return launch(batch, make)

    llm.engine.executor.launch = counting
    return counts


def test_async_engine_equals_transformers(async_llm, reference):
    counts = count_launches(async_llm)
    assert token_ids(async_llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert counts["fed"] > 0 and counts["launched"] >= MAX_TOKENS
    assert async_llm.engine._in_flight is None or all(r.is_finished for r in async_llm.engine._in_flight.reqs)


def test_async_engine_chunked_prefill_and_preemption(tiny_llama_dir, reference):
    llm = llm_for(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=8, max_num_seqs=3)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    llm = llm_for(tiny_llama_dir, async_scheduling=True, num_blocks=24, enable_prefix_caching=False)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    assert llm.engine.scheduler.stats().num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_async_engine_stops_like_sync(async_llm, llm):
    full = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0]
    stop = full.text[3:6]
    tid = full.token_ids[5]
    params = [greedy(stop=[stop]), greedy(stop_token_ids=[tid]), greedy(7), greedy(1),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2, stop=[stop])]
    for p in params:
        a = async_llm.generate(PROMPTS[1:3] + PROMPTS[1:2], p, use_tqdm=False)
        s = llm.generate(PROMPTS[1:3] + PROMPTS[1:2], p, use_tqdm=False)
        assert outputs_summary(a) == outputs_summary(s)
    assert all(r.num_pending_tokens == 0 for r in async_llm.engine.scheduler.requests.values())


def test_async_engine_abort_in_flight(tiny_llama_dir):
    llm = llm_for(tiny_llama_dir, async_scheduling=True, enable_prefix_caching=False)
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(200))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request([f"r{i}" for i in range(0, len(PROMPTS), 2)])
    outs = engine.step()
    aborted = {o.request_id for o in outs if o.finished}
    assert aborted == {f"r{i}" for i in range(0, len(PROMPTS), 2)}
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    engine.step()
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free0


def test_logprobs_seeds_and_min_tokens_run_async_and_match(async_llm, llm):
    p = greedy(8, logprobs=2)
    counts = count_launches(async_llm)
    a = async_llm.generate(PROMPTS[:3], p, use_tqdm=False)
    s = llm.generate(PROMPTS[:3], p, use_tqdm=False)
    assert counts["fed"] > 0                                      # logprobs do not stop the overlap
    for x, y in zip(a, s, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for pa, ps in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert pa.keys() == ps.keys()
            assert [pa[k].logprob for k in pa] == pytest.approx([ps[k].logprob for k in pa], abs=1e-5)
    full = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # seeded sampling keys on the output index (the token in flight counts); min_tokens masks stop ids
    for params in (SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=6, stop_token_ids=full[:6])):
        a = async_llm.generate(PROMPTS[:3], params, use_tqdm=False)
        s = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert outputs_summary(a) == outputs_summary(s)


def test_penalties_run_synchronously_and_match(async_llm, llm):
    """A request with penalties (its sampling counts the earlier tokens on the host) joining mid-run:
    steps go synchronous while it runs, and every output equals the synchronous engine's."""
    pen = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3)
    engine = async_llm.engine
    engine.add_request("plain", PROMPTS[0], greedy())
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.add_request("pen", PROMPTS[2], pen)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if "pen" not in done:
            assert engine._in_flight is None
    ref = llm.generate([PROMPTS[0], PROMPTS[2]], [greedy(), pen], use_tqdm=False)
    assert done["plain"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert done["pen"].outputs[0].token_ids == ref[1].outputs[0].token_ids


def test_prefix_cache_registers_the_block_a_pending_token_completes(tiny_llama_dir):
    """The last block of a finished request is cached as with synchronous steps (a follow-up turn hits it)."""
    cached = {}
    for mode in (True, False):
        llm = llm_for(tiny_llama_dir, async_scheduling=mode)
        prompt = llm.engine.tokenize(PROMPTS[2])[:5]
        out = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
        follow = llm.generate([prompt + out + [5, 6, 7]], greedy(2), use_tqdm=False)[0]
        cached[mode] = follow.num_cached_tokens
    assert cached[True] == cached[False] == 12


def test_failed_step_aborts_the_requests_in_flight(tiny_llama_dir, reference):
    llm = llm_for(tiny_llama_dir, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy())
    engine.add_request("b", PROMPTS[1], greedy())
    for _ in range(3):
        engine.step()
    launch = engine.executor.launch

    def failing(batch, make):
        raise RuntimeError("device error")

    engine.executor.launch = failing
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    engine.executor.launch = launch
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests() and engine._in_flight is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    # the engine goes on: a new request gives the reference tokens
    assert token_ids(llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)) == reference[:2]


def test_randomized_async_equals_sync(tiny_llama_dir):
    """Random mixes of stop ids, stop strings, n=2, logprobs, lengths, late arrivals and aborts under
    preemption and chunked prefill: every request that was not aborted ends as in the synchronous engine."""
    import random

    configs = [dict(max_num_batched_tokens=3, max_num_seqs=3, num_blocks=26),
               dict(num_blocks=22, max_num_batched_tokens=12, max_num_seqs=5, enable_prefix_caching=False)]
    words = "the quick brown fox Paris capital France models 0123 tokens batching keeps".split()
    for ci, config in enumerate(configs):
        engines = [llm_for(tiny_llama_dir, async_scheduling=m, **config).engine for m in (True, False)]
        for seed in range(3):
            rng = random.Random(100 * ci + seed)
            reqs = []
            for i in range(8):
                kw = dict(temperature=0.0, max_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.3)
                r = rng.random()
                if r < 0.3:
                    kw["stop_token_ids"] = rng.sample(range(300), 15)
                elif r < 0.5:
                    kw["stop"] = [rng.choice(["e", "a", " t", "o"])]
                if rng.random() < 0.2:
                    kw["n"] = 2
                if rng.random() < 0.15:
                    kw["logprobs"] = 1
                prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 10)))
                reqs.append((rng.randrange(0, 6), f"q{i}", prompt, SamplingParams(**kw)))
            aborts = {f"q{i}": rng.randrange(1, 12) for i in range(8) if rng.random() < 0.15}
            results = []
            for engine in engines:
                done = drive(engine, reqs, aborts, max_steps=2000)
                results.append({rid: outputs_summary([o])[0] for rid, o in done.items() if rid not in aborts})
            assert results[0] == results[1], (ci, seed)


def test_async_front_streams_with_async_steps(tiny_llama_dir, reference):
    import asyncio

    from plinth.core.async_engine import AsyncLLMEngine

    llm = llm_for(tiny_llama_dir, async_scheduling=True, max_num_seqs=3)
    front = AsyncLLMEngine(llm.engine)

    async def one(i: int) -> list[int]:
        last: list[int] = []
        async for out in front.generate(f"s{i}", PROMPTS[i], greedy()):
            tokens = out.outputs[0].token_ids
            assert tokens[: len(last)] == last                   # streamed outputs only grow
            last = list(tokens)
        return last

    async def main() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 120)

    try:
        assert asyncio.run(main()) == reference
    finally:
        front.shutdown()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_async_scheduling_defaults_off_on_cpu(llm):
    assert llm.engine.async_scheduling is False


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir, async_scheduling=False)



def test_failed_read_back_of_a_stopped_requests_step_keeps_the_outputs(tiny_llama_dir):
    """The last step in flight holds only a stopped request's dropped token: if reading it back fails,
    the step still returns the request's final output."""
    llm = llm_for(tiny_llama_dir, async_scheduling=True)
    engine = llm.engine
    full = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = full.index(full[4])                  # the stop token's first position in the output
    engine.add_request("a", PROMPTS[1], greedy(stop_token_ids=[full[4]]))
    request = engine.scheduler.get_request("a")
    launch = engine.executor.launch
    broken = []

    def failing_read_back():
        raise RuntimeError("device error")

    def recording(batch, make):
        step = launch(batch, make)
        if len(request.output_token_ids) == stop_at:   # launched while the stop token is in flight
            step.token_ids = failing_read_back
            broken.append(step)
        return step

    engine.executor.launch = recording
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    assert broken and final.outputs[0].token_ids == full[: stop_at + 1]
    assert final.outputs[0].finish_reason == "stop"
    assert engine._in_flight is None and not engine.has_unfinished_requests()


def test_a_failed_step_in_flight_uncaches_the_blocks_of_a_request_aborted_meanwhile(tiny_llama_dir, reference):
    """A request aborted while its step is in flight, then that step fails on the device: the blocks registered for
    the step's tokens leave the prefix cache though the request holds them no more (the same prompt again found
    them: unwritten keys and values)."""
    llm = llm_for(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("a", PROMPTS[2], greedy())
    engine.step()   # its first chunk in flight, two full blocks registered
    assert engine.block_manager.num_cached_blocks == 2

    def failing_read_back():
        raise RuntimeError("device error")

    engine._in_flight.step.token_ids = failing_read_back
    engine.abort_request("a")
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_cached_blocks == 0
    again = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == reference[2]
