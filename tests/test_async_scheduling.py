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
from test_engine import MAX_TOKENS, PROMPTS, greedy, llm_for, token_ids, transformers_greedy
from test_scheduler import FakeRunner, make_scheduler, next_token, req
from test_scheduler import run as run_sync

from plinth import LLM, SamplingParams
from plinth.core.request import RequestStatus
from plinth.core.scheduler import Scheduler, SchedulerOutput
from plinth.worker.batching import BatchBuilder


class FedRunner(FakeRunner):
    """The fake runner, taking the tokens of a step in flight from that step's output (as the device does)."""

    def execute_fed(self, out: SchedulerOutput, fed: dict[str, int]) -> list[int | None]:
        for e in out.scheduled:
            known = e.request.all_token_ids
            for j in range(e.num_new_tokens):
                p = e.num_computed_tokens + j
                tok = known[p] if p < len(known) else fed[e.request.request_id]
                block = e.request.block_ids[p // self.bs]
                assert block != 0
                self.slots[(block, p % self.bs)] = tok
        sampled: list[int | None] = []
        for e in out.scheduled:
            if not e.sample:
                sampled.append(None)
                continue
            n = e.num_computed_tokens + e.num_new_tokens
            blocks = e.request.block_ids
            sampled.append(next_token([self.slots[(blocks[p // self.bs], p % self.bs)] for p in range(n)]))
        return sampled


def run_async(sched: Scheduler, requests, max_steps: int = 3000) -> tuple[dict[str, list[int]], int, int]:
    """Drive with one step in flight; returns the outputs, the number of fed tokens and of wasted rows."""
    runner = FedRunner(sched.block_manager.block_size)
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
        sampled = runner.execute_fed(out, fed) if out.scheduled else []
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


def test_preempted_request_with_token_in_flight_waits_for_it():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)   # 4 usable blocks
    a, b = req("a", list(range(8)), max_tokens=8), req("b", list(range(20, 27)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()                                      # a: 2 blocks, b: 2 blocks (7 tokens)
    assert len(first.scheduled) == 2
    a.num_pending_tokens = b.num_pending_tokens = 1
    second = sched.schedule()                                     # a needs a third block: b is preempted
    assert second.preempted_request_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    sched.abort(["a"])                                            # room again, but b's token is in flight
    assert sched.schedule().scheduled == []
    a.num_pending_tokens = b.num_pending_tokens = 0
    sched.update_from_output(first, [5, 6])
    assert a.output_token_ids == [] and b.output_token_ids == [6]  # the preempted request keeps its token
    third = sched.schedule()                                      # b is admitted again, with all its tokens
    assert [(e.request.request_id, e.num_computed_tokens + e.num_new_tokens, e.sample)
            for e in third.scheduled] == [("b", 8, True)]


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
        for x, y in zip(a, s, strict=True):
            assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
                   [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs]
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


def test_logprobs_requests_run_synchronously_and_match(async_llm, llm):
    p = greedy(8, logprobs=2)
    a = async_llm.generate(PROMPTS[:3], p, use_tqdm=False)
    s = llm.generate(PROMPTS[:3], p, use_tqdm=False)
    for x, y in zip(a, s, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for pa, ps in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert {k: round(v.logprob, 4) for k, v in pa.items()} == {k: round(v.logprob, 4) for k, v in ps.items()}
    # a plain request joining a logprobs request mid-run: steps go synchronous, then async again
    engine = async_llm.engine
    engine.add_request("plain", PROMPTS[0], greedy())
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.add_request("lp", PROMPTS[2], greedy(4, logprobs=1))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if "lp" not in done:
            assert engine._in_flight is None
    ref = {o.prompt: o for o in llm.generate([PROMPTS[0], PROMPTS[2]], [greedy(), greedy(4, logprobs=1)],
                                            use_tqdm=False)}
    assert done["plain"].outputs[0].token_ids == ref[PROMPTS[0]].outputs[0].token_ids
    assert done["lp"].outputs[0].token_ids == ref[PROMPTS[2]].outputs[0].token_ids


def test_async_scheduling_defaults_off_on_cpu(llm):
    assert llm.engine.async_scheduling is False


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir, async_scheduling=False)

