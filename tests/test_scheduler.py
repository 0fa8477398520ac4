"""Scheduler: token budget, ordering, chunked prefill, prefix-cache hits, preemption, stop rules.

``FakeRunner`` stands in for the model runner. Its KV cache holds, in each slot, the token at that
position; the "model" sees a sequence's context ONLY through the block table (written first for the
whole batch, then read, as the attention contract says) and returns a deterministic function of it.
A wrong block table, a bad prefix-cache hit or a lost token after preemption changes the outputs,
which are compared with an unconstrained reference run.
"""

from __future__ import annotations

import itertools

import pytest

from plinth.config import SchedulerConfig
from plinth.core.block_manager import BlockManager
from plinth.core.request import FinishReason, Request, RequestStatus, SamplingParams
from plinth.core.scheduler import QueueFullError, RequestRejectedError, Scheduler, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    acc = len(context)
    for t in context:
        acc = (acc * 1_000_003 + t) % 2_147_483_647
    return acc % VOCAB


class FakeRunner:
    def __init__(self, block_size: int):
        self.bs = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, out: SchedulerOutput, fed: dict[str, int] | None = None) -> list[int | None]:
        """``fed``: the tokens of a step in flight by request id (asynchronous scheduling), for positions
        the host does not know yet (the device takes them from that step's output)."""
        for e in out.scheduled:                      # write every new token's "K/V" first
            known = e.request.all_token_ids
            for j in range(e.num_new_tokens):
                p = e.num_computed_tokens + j
                tok = known[p] if p < len(known) else fed[e.request.request_id]   # type: ignore[index]
                block = e.request.block_ids[p // self.bs]
                assert block != 0
                self.slots[(block, p % self.bs)] = tok
        sampled: list[int | None] = []
        for e in out.scheduled:                      # then "attend" over the paged context
            if not e.sample:
                sampled.append(None)
                continue
            n = e.num_computed_tokens + e.num_new_tokens
            blocks = e.request.block_ids
            sampled.append(next_token([self.slots[(blocks[p // self.bs], p % self.bs)] for p in range(n)]))
        return sampled


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_model_len=256, **kw):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=kw.pop("prefix_caching", True))
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **kw)
    return Scheduler(cfg, bm, max_model_len)


def req(rid: str, prompt: list[int], max_tokens: int = 8, eos=(), **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def run(sched: Scheduler, requests=(), on_step=None, runner=None, max_steps=2000) -> dict[str, list[int]]:
    """Drive the scheduler to completion; returns every request's output tokens."""
    runner = runner or FakeRunner(sched.block_manager.block_size)
    outputs = {}
    for r in requests:
        sched.add_request(r)
        outputs[r.request_id] = r
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if on_step is not None:
            on_step(sched, out)
        sched.update_from_output(out, runner.execute(out))
    else:
        raise AssertionError("requests did not finish")
    return {rid: r.output_token_ids for rid, r in outputs.items()}


def reference(requests: list[Request]) -> dict[str, list[int]]:
    """Outputs with no constraint: every request alone, prompt in one step, no cache."""
    out = {}
    for r in requests:
        s = make_scheduler(num_blocks=512, budget=4096, prefix_caching=False)
        clone = Request(r.request_id, r.prompt_token_ids, r.sampling_params, eos_token_ids=r.eos_token_ids)
        out.update(run(s, [clone]))
    return out


def prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = __import__("random").Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ------------------------------------------------------------------ budget and ordering

def test_budget_seq_limit_and_decodes_first():
    reqs = [req(f"r{i}", p, max_tokens=6 + i % 5) for i, p in enumerate(prompts(0, 12, 3, 40))]
    expected = reference(reqs)
    sched = make_scheduler(num_blocks=80, budget=24, max_seqs=5)
    seen_mixed = False

    def check(s: Scheduler, out: SchedulerOutput):
        nonlocal seen_mixed
        assert out.num_scheduled_tokens == sum(e.num_new_tokens for e in out.scheduled) <= 24
        assert len(out.scheduled) <= 5 and s.num_running <= 5
        flags = [e.is_decode for e in out.scheduled]
        assert flags == sorted(flags, reverse=True), "a prefill chunk was placed before a decode"
        assert sum(flags) == out.num_decodes
        for e in out.scheduled:
            if e.is_decode:
                assert e.num_new_tokens == 1 and e.sample
            assert e.sample == (e.num_computed_tokens + e.num_new_tokens == e.request.num_tokens)
        seen_mixed |= 0 < out.num_decodes < len(out.scheduled)

    assert run(sched, reqs, check) == expected
    assert seen_mixed
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_decodes():
    sched = make_scheduler(budget=16)
    short = req("short", [1, 2, 3], max_tokens=20)
    long = req("long", list(range(100, 150)), max_tokens=2)    # 50 tokens
    runner = FakeRunner(4)
    sched.add_request(short)
    sched.update_from_output(first := sched.schedule(), runner.execute(first))
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = sched.schedule()
        entries = {e.request.request_id: e for e in out.scheduled}
        assert entries["short"].is_decode and out.scheduled[0].request is short
        chunk = entries["long"]
        chunks.append((chunk.num_computed_tokens, chunk.num_new_tokens, chunk.sample))
        assert out.num_scheduled_tokens <= 16
        sched.update_from_output(out, runner.execute(out))
    assert chunks == [(0, 15, False), (15, 15, False), (30, 15, False), (45, 5, True)]
    assert long.num_output_tokens == 1 and long.output_token_ids[0] == next_token(long.prompt_token_ids)


def test_without_chunked_prefill_prompts_run_whole_and_oversized_are_rejected():
    sched = make_scheduler(budget=16, enable_chunked_prefill=False)
    with pytest.raises(RequestRejectedError, match=r"17 tokens.*\(16\)"):
        sched.add_request(req("big", list(range(17))))
    a, b = req("a", list(range(10))), req("b", list(range(20, 30)))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 10)]


# ------------------------------------------------------------------ prefix cache

def test_prefix_cache_hit_skips_cached_tokens():
    sched = make_scheduler(block_size=8)
    base = list(range(1, 41))                                   # 40 tokens = 5 blocks
    runner = FakeRunner(8)
    run(sched, [req("a", base)], runner=runner)
    b = req("b", base[:32] + [500, 501, 502])
    same = req("same", list(base))
    seen = {}

    def record(s, out):
        for e in out.scheduled:
            seen.setdefault(e.request.request_id, (e.num_computed_tokens, e.num_new_tokens))

    outputs = run(sched, [b, same], record, runner)
    assert b.num_cached_tokens == 32 and seen["b"] == (32, 3)
    assert same.num_cached_tokens == 32 and seen["same"] == (32, 8)   # the last token is always computed
    assert outputs == reference([b, same])
    assert sched.block_manager.stats.hit_tokens == 64


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    sched = make_scheduler(block_size=4)
    run(sched, [req("a", list(range(1, 13)))])
    b = req("b", list(range(1, 13)), prompt_logprobs=2)
    out = (sched.add_request(b), sched.schedule())[1]
    assert b.num_cached_tokens == 0 and out.scheduled[0].num_new_tokens == 12


def test_n_siblings_share_the_prompt_blocks():
    sched = make_scheduler(block_size=4)
    prompt = list(range(7, 40))                                  # 33 tokens
    sibs = [req(f"s{i}", prompt, max_tokens=5, seed=i) for i in range(3)]
    out_first = []
    outputs = run(sched, sibs, lambda s, out: out_first.append(out) if not out_first else None)
    first = out_first[0]
    assert [e.num_new_tokens for e in first.scheduled] == [33, 1, 1]
    assert [s.num_cached_tokens for s in sibs] == [0, 32, 32]
    assert outputs == reference(sibs)


# ------------------------------------------------------------------ preemption

def test_preemption_of_the_newest_and_unaffected_results():
    # 3 running requests of 12 + 20 tokens each need 8 blocks of 4 at the end; the cache has 16.
    # A 4th waits for a sequence slot: the preempted request must go back in FRONT of it.
    reqs = [req(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts(1, 4, 12, 12))]
    expected = reference(reqs)
    sched = make_scheduler(num_blocks=17, block_size=4, budget=64, max_seqs=3)
    events = []

    def watch(s: Scheduler, out: SchedulerOutput):
        if out.preempted_request_ids:
            events.append(("preempted", list(out.preempted_request_ids), [r.request_id for r in s.running]))
            for rid in out.preempted_request_ids:
                assert s.get_request(rid).status == RequestStatus.PREEMPTED
            assert [r.request_id for r in s.waiting][:len(out.preempted_request_ids)] == sorted(
                out.preempted_request_ids)
        for rid in out.new_request_ids:
            events.append(("resumed" if s.get_request(rid).metrics.num_preemptions else "admitted", rid))

    outputs = run(sched, reqs, watch)
    assert sched.num_preemptions >= 1
    first = next(e for e in events if e[0] == "preempted")
    assert first[1] == ["r2"], "the most recently admitted request must be preempted first"
    assert "r2" not in first[2]
    assert events.index(("resumed", "r2")) < events.index(("admitted", "r3")), "FCFS: r2 resumes before r3"
    assert reqs[2].metrics.num_preemptions >= 1
    assert outputs == expected
    assert sched.block_manager.num_free_blocks == 16


def test_preempted_request_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=9, block_size=4, budget=64, prefix_caching=True)
    a = req("a", list(range(1, 9)), max_tokens=16)       # grows to 23 tokens: 6 blocks
    b = req("b", list(range(50, 58)), max_tokens=16)
    expected = reference([a, b])
    resumed_at = []

    def watch(s, out):
        for e in out.scheduled:
            if e.request.request_id in out.new_request_ids and e.request.metrics.num_preemptions:
                resumed_at.append(e.num_computed_tokens)

    assert run(sched, [a, b], watch) == expected
    assert sched.num_preemptions >= 1 and resumed_at and resumed_at[0] > 0


# ------------------------------------------------------------------ admission control

def test_rejections_name_both_numbers():
    sched = make_scheduler(num_blocks=9, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejectedError, match=r"prompt \(64 tokens\) leaves no room .*max_model_len \(64\)"):
        sched.add_request(req("long", list(range(64)), max_tokens=8))
    with pytest.raises(RequestRejectedError, match=r"needs 10 KV blocks.*only 8; lower max_tokens"):
        sched.add_request(req("big", list(range(20)), max_tokens=20))
    # a prompt the cache cannot hold by itself: no max_tokens helps (with or without one)
    for max_tokens in (None, 1):
        with pytest.raises(RequestRejectedError, match=r"the prompt \(40 tokens\) needs 10 KV blocks.*only 8; "
                                                       "shorten it"):
            sched.add_request(req("huge", list(range(40)), max_tokens=max_tokens))
    with pytest.raises(RequestRejectedError, match="empty"):
        sched.add_request(req("empty", []))
    sched.add_request(req("ok", [1, 2, 3]))
    with pytest.raises(RequestRejectedError, match="already in use"):
        sched.add_request(req("ok", [1, 2, 3]))
    assert issubclass(RequestRejectedError, ValueError)


def test_max_tokens_past_the_context_stops_at_its_end():
    """As vLLM's engine: prompt plus max_tokens past max_model_len is no refusal; the output stops at the end of the
    context (finish reason length); a min_tokens that no longer fits is refused, naming it."""
    sched = make_scheduler(max_model_len=32)
    r = req("r", list(range(1, 29)), max_tokens=100)
    outputs = run(sched, [r])
    assert r.max_tokens == 4
    assert len(outputs["r"]) == 4 and r.finish_reason == FinishReason.LENGTH and r.num_tokens == 32
    with pytest.raises(RequestRejectedError, match=r"min_tokens \(6\) is more than the 4 tokens") as info:
        sched.add_request(req("m", list(range(1, 29)), max_tokens=100, min_tokens=6))
    assert info.value.param == "min_tokens"


def test_max_tokens_defaults_to_the_rest_of_max_model_len():
    sched = make_scheduler(max_model_len=32)
    r = Request("r", list(range(10)), SamplingParams(max_tokens=None))
    sched.add_request(r)
    assert r.max_tokens == 22
    run(sched)
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 32
    # a prompt that fills the context (or more) is refused with its real numbers, max_tokens left unset
    for n in (32, 40):
        full = Request(f"full{n}", list(range(n)), SamplingParams(max_tokens=None))
        with pytest.raises(RequestRejectedError, match=rf"prompt \({n} tokens\) leaves no room.*max_model_len \(32\)"):
            sched.add_request(full)
        assert full.max_tokens is None


def test_min_tokens_beyond_what_the_kv_cache_leaves_is_refused():
    """max_tokens unset is capped by what the KV cache holds: a min_tokens past that cap is refused (it was
    silently cut short), one within it is kept."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=256)   # 3 usable blocks: 12 slots
    r = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=None, min_tokens=20))
    with pytest.raises(RequestRejectedError, match=r"min_tokens \(20\) is more than the 9 tokens.*KV cache") as e:
        sched.add_request(r)
    assert e.value.param == "min_tokens"
    ok = Request("ok", [1, 2, 3, 4], SamplingParams(max_tokens=None, min_tokens=9, ignore_eos=True))
    sched.add_request(ok)
    run(sched)
    assert ok.num_output_tokens == 9


def test_queue_full():
    """The cap counts the requests waiting beyond the running batch's free places: a burst at an idle engine fills
    the batch and then the queue."""
    sched = make_scheduler(max_waiting_requests=2, max_seqs=2)
    for rid in "abcd":                                    # 2 free places + 2 waiting
        sched.add_request(req(rid, [1]))
    with pytest.raises(QueueFullError, match="2 requests beyond the running batch"):
        sched.add_request(req("e", [1]))
    sched.schedule()                                      # a, b run; c, d wait: the batch is full
    assert [r.request_id for r in sched.running] == ["a", "b"] and len(sched.waiting) == 2
    with pytest.raises(QueueFullError):
        sched.add_request(req("e", [1]))
    sched.abort(["a"])                                    # a place frees: one more may wait for it
    sched.add_request(req("e", [1]))
    with pytest.raises(QueueFullError):
        sched.add_request(req("f", [1]))


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=33, block_size=4, budget=8)
    runner = FakeRunner(4)
    a, b, c = req("a", list(range(20))), req("b", list(range(30, 50))), req("c", [5, 6])
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()                                # a: first chunk of 8; b, c wait
    sched.update_from_output(out, runner.execute(out))
    assert sched.block_manager.num_free_blocks < 32
    out = sched.schedule()
    sampled = runner.execute(out)                         # the step is running on the device ...
    aborted = sched.abort(["a", "c", "nope"])             # ... when a (running) and c (waiting) are aborted
    assert [r.request_id for r in aborted] == ["a", "c"]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == FinishReason.ABORT
    assert a.block_ids == [] and list(sched.waiting) == [b]
    sched.update_from_output(out, sampled)                # the in-flight step's result is dropped
    assert a.num_output_tokens == 0
    assert sched.block_manager.num_free_blocks + sum(len(r.block_ids) for r in sched.running) == 32
    nxt = sched.schedule()
    assert set(nxt.finished_request_ids) == {"a", "c"}
    sched.abort(["b"])
    assert sched.block_manager.num_free_blocks == 32 and not sched.has_unfinished_requests()


# ------------------------------------------------------------------ stop conditions

def one_request_steps(sched: Scheduler, r: Request, tokens: list[int]) -> list[Request]:
    """Feed ``tokens`` as the sampled ids, one per step, until ``r`` finishes."""
    sched.add_request(r)
    for tok in tokens:
        out = sched.schedule()
        finished = sched.update_from_output(out, [tok if e.sample else None for e in out.scheduled])
        if finished:
            return finished
    return []


@pytest.mark.parametrize("case, params, tokens, n_out, reason, stop_reason", [
    ("eos", {}, [5, 6, 2, 7], 3, FinishReason.STOP, None),
    ("ignore_eos", {"ignore_eos": True}, [2, 2, 2, 2], 4, FinishReason.LENGTH, None),
    ("stop id", {"stop_token_ids": [6]}, [5, 6, 7], 2, FinishReason.STOP, 6),
    ("min_tokens", {"min_tokens": 2, "stop_token_ids": [6]}, [2, 6, 2, 7], 3, FinishReason.STOP, None),
    ("min_tokens blocks all", {"min_tokens": 3}, [2, 2, 2, 9], 4, FinishReason.LENGTH, None),
    ("max_tokens", {}, [5, 5, 5, 5, 5], 4, FinishReason.LENGTH, None),
])
def test_stop_conditions(case, params, tokens, n_out, reason, stop_reason):
    sched = make_scheduler()
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, **params), eos_token_ids=[2])
    finished = one_request_steps(sched, r, tokens)
    assert finished == [r], case
    assert r.output_token_ids == tokens[:n_out]
    assert r.finish_reason == reason and r.stop_reason == stop_reason
    assert r.block_ids == [] and not sched.running


def test_max_model_len_stops_generation():
    sched = make_scheduler(max_model_len=8)
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    assert one_request_steps(sched, r, [9] * 5) == [r]
    assert r.num_tokens == 8 and r.finish_reason == FinishReason.LENGTH


def test_finish_request_for_a_stop_string():
    sched = make_scheduler()
    r = req("r", [1, 2, 3], max_tokens=10)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, [4])
    assert sched.finish_request("r", FinishReason.STOP, stop_reason="###") is r
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == "###"
    assert sched.finish_request("r", FinishReason.STOP) is None     # already finished
    assert sched.schedule().finished_request_ids == ["r"]


def test_sampled_tokens_must_match_the_schedule():
    sched = make_scheduler()
    sched.add_request(req("r", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="1 scheduled"):
        sched.update_from_output(out, [])
    with pytest.raises(ValueError, match="sample=True"):
        sched.update_from_output(out, [None])
    with pytest.raises(ValueError, match="2 sampled tokens for 1"):
        out.expand_sampled([4, 5])
    assert out.expand_sampled([4]) == [4]


def test_expand_sampled_skips_mid_prefill_entries():
    sched = make_scheduler(budget=10)
    sched.add_request(req("short", [1, 2]))
    sched.add_request(req("long", list(range(30))))
    out = sched.schedule()
    assert [e.sample for e in out.scheduled] == [True, False]
    assert out.expand_sampled([7]) == [7, None]
    sched.update_from_output(out, out.expand_sampled([7]))
    assert sched.get_request("short").output_token_ids == [7]


def test_long_random_workload_matches_reference():
    ps = prompts(7, 20, 1, 30)
    shared = ps[0][:16]
    reqs = [req(f"r{i}", (shared + p) if i % 3 == 0 else p, max_tokens=3 + i % 7, eos=(13,))
            for i, p in enumerate(ps)]
    expected = reference(reqs)
    sched = make_scheduler(num_blocks=30, block_size=4, budget=20, max_seqs=6)
    # arrive in waves
    runner = FakeRunner(4)
    pending = list(reqs)
    for step in itertools.count():
        if step % 3 == 0 and pending:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        assert step < 3000
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    assert sched.block_manager.num_free_blocks == 29


# ------------------------------------------------------------------ the priority policy

def test_priority_policy_admits_by_priority_then_arrival():
    reqs = [req(f"p{rank}-{i}", p, max_tokens=3) for i, (rank, p) in enumerate(zip([3, 1, 2, 1], prompts(7, 4, 5, 9),
                                                                                    strict=True))]
    for r, rank in zip(reqs, [3, 1, 2, 1], strict=True):
        r.priority = rank
    expected = reference(reqs)
    sched = make_scheduler(max_seqs=1, scheduling_policy="priority")
    admitted = []
    outputs = run(sched, reqs, lambda s, out: admitted.extend(out.new_request_ids))
    assert admitted == ["p1-1", "p1-3", "p2-2", "p3-0"]
    assert outputs == expected
    # first come, first served ignores the field
    sched = make_scheduler(max_seqs=1)
    admitted.clear()
    clones = [req(r.request_id, r.prompt_token_ids, max_tokens=3) for r in reqs]
    run(sched, clones, lambda s, out: admitted.extend(out.new_request_ids))
    assert admitted == [r.request_id for r in reqs]


@pytest.mark.parametrize("short_of", ["seqs", "blocks"])
def test_priority_policy_preempts_the_least_important_for_a_more_important_arrival(short_of):
    """Two unimportant requests run; an important one arrives: the later unimportant one is preempted at
    once (a full batch, or too few KV blocks), the important one runs, and every output is unchanged."""
    low = [req(f"low{i}", p, max_tokens=24) for i, p in enumerate(prompts(11, 2, 10, 10))]
    high = req("high", prompts(12, 1, 10, 10)[0], max_tokens=6)
    for r in low:
        r.priority = 5
    expected = reference([*low, high])
    if short_of == "seqs":
        sched = make_scheduler(num_blocks=64, block_size=4, max_seqs=2, scheduling_policy="priority")
        arrive = 4
    else:   # the two low requests hold 12 of 13 usable blocks when high arrives (3 blocks for its prompt)
        sched = make_scheduler(num_blocks=14, block_size=4, max_seqs=8, scheduling_policy="priority")
        arrive = 12
    events = []

    def watch(s: Scheduler, out: SchedulerOutput):
        if len(events) == arrive:
            s.add_request(high)
        events.append((list(out.new_request_ids), list(out.preempted_request_ids)))
        running = {r.request_id for r in s.running}
        assert {e.request.request_id for e in out.scheduled} <= running

    outputs = run(sched, low, watch)
    admitted_at = next(i for i, (new, _) in enumerate(events) if "high" in new)
    assert admitted_at == arrive + 1, events
    assert "low1" in events[admitted_at][1] and "low0" not in events[admitted_at][1]
    assert {**outputs, "high": high.output_token_ids} == expected
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_priority_policy_never_preempts_for_an_equal_or_less_important_arrival():
    low = [req(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts(13, 3, 8, 8))]
    low[2].priority = 1
    sched = make_scheduler(max_seqs=2, scheduling_policy="priority")
    preempted = []
    run(sched, low, lambda s, out: preempted.extend(out.preempted_request_ids))
    assert preempted == []


def test_priority_policy_preempts_the_least_important_when_running_requests_outgrow_the_cache():
    """Blocks run out while running requests grow: the victim is the least important running request,
    not the newest (which first come, first served would take)."""
    reqs = [req(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts(1, 3, 12, 12))]
    reqs[0].priority, reqs[1].priority, reqs[2].priority = 2, 9, 0
    expected = reference(reqs)
    sched = make_scheduler(num_blocks=17, block_size=4, budget=64, max_seqs=3, scheduling_policy="priority")
    first = []
    outputs = run(sched, reqs, lambda s, out: first.extend(out.preempted_request_ids[:1]) if not first else None)
    assert first == ["r1"]
    assert outputs == expected


@pytest.mark.parametrize("shared", [False, True])
def test_priority_arrival_never_reads_blocks_its_victim_did_not_write(shared):
    """A prompt chunk in progress is displaced by an important arrival (sharing its prefix or not): the
    blocks that chunk would have filled must not be offered from the prefix cache (FakeRunner raises on
    a slot nobody wrote)."""
    victim = req("V", list(range(100, 130)), max_tokens=4)
    victim.priority = 5
    head = req("H", list(range(100, 126)) + [7, 7] if shared else [500, 501], max_tokens=4)
    expected = reference([victim, head])
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=1, scheduling_policy="priority")
    steps = []

    def watch(s, out):
        steps.append(out)
        if len(steps) == 1:
            s.add_request(head)
        scheduled = {e.request.request_id for e in out.scheduled}
        assert not scheduled & set(out.preempted_request_ids)

    outputs = run(sched, [victim], watch)
    assert {**outputs, "H": head.output_token_ids} == expected
    assert steps[1].preempted_request_ids == ["V"] and steps[1].new_request_ids == ["H"]


def test_priority_policy_does_not_readmit_what_it_just_preempted():
    """Equal priorities and a tight cache: a request preempted by the running requests' growth waits a
    step, as under first come, first served (no preempt-and-readmit churn)."""
    reqs = [req(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts(3, 2, 32, 32))]
    totals = {}
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(num_blocks=17, block_size=4, budget=16, max_seqs=3, prefix_caching=False,
                               scheduling_policy=policy)
        computed = []
        clones = [req(r.request_id, r.prompt_token_ids, max_tokens=20) for r in reqs]

        def watch(s, out, computed=computed):
            computed.append(out.num_scheduled_tokens)
            assert not set(out.new_request_ids) & set(out.preempted_request_ids)

        assert run(sched, clones, watch) == reference(reqs)
        totals[policy] = sum(computed)
    assert totals["priority"] == totals["fcfs"]


def test_unset_max_tokens_stops_at_what_the_cache_holds():
    """A KV cache smaller than max_model_len: a request without max_tokens gets the rest of the cache (not
    a refusal); an explicit max_tokens beyond it is still refused with the numbers."""
    sched = make_scheduler(num_blocks=9, block_size=4, max_model_len=64)   # 8 usable blocks: 32 tokens
    r = req("a", [5] * 10, max_tokens=None)
    outputs = run(sched, [r])
    assert len(outputs["a"]) == 32 - 10 + 1 and r.finish_reason == FinishReason.LENGTH
    with pytest.raises(RequestRejectedError, match="needs 9 KV blocks"):
        sched.add_request(req("b", [5] * 10, max_tokens=24))
    with pytest.raises(RequestRejectedError, match="KV blocks"):   # the prompt alone does not fit
        sched.add_request(req("c", [5] * 40, max_tokens=None))


# ------------------------------------------------------------------ LoRA adapter slots


class _Adapter:
    def __init__(self, lora_id: int):
        self.lora_id = lora_id


def _with_adapter(r: Request, lora_id: int | None) -> Request:
    r.lora = _Adapter(lora_id) if lora_id is not None else None
    return r


def test_requests_pass_one_waiting_for_an_adapter_slot():
    """One slot held by adapter 1: a request of adapter 2 waits, and the base-model and adapter-1 requests behind
    it are admitted meanwhile; at most max_loras adapters ever run together, and every output is unchanged."""
    sched = make_scheduler(budget=256)
    sched.max_loras = 1
    order = [1, 2, None, 1, 2, None]
    reqs = [_with_adapter(req(f"r{i}", [i + 1] * 5, max_tokens=6), a) for i, a in enumerate(order)]
    first_step: dict[str, int] = {}
    step = itertools.count()

    def check(s: Scheduler, out: SchedulerOutput) -> None:
        n = next(step)
        adapters = {r.lora_id for r in s.running if r.lora is not None}
        assert len(adapters) <= 1
        for rid in out.new_request_ids:
            first_step.setdefault(rid, n)

    outputs = run(sched, reqs, on_step=check)
    assert outputs == reference([req(f"r{i}", [i + 1] * 5, max_tokens=6) for i in range(len(order))])
    assert first_step["r0"] == first_step["r2"] == first_step["r3"] == first_step["r5"] == 0   # passed r1
    assert first_step["r1"] > 0 and first_step["r4"] > 0


def test_a_request_waiting_for_a_slot_is_not_starved():
    """Adapter-1 requests keep arriving; a waiting adapter-2 request stops letting them pass after
    MAX_ADAPTER_WAIT_STEPS steps, so adapter 1 drains and adapter 2 gets the slot."""
    from plinth.core.scheduler import MAX_ADAPTER_WAIT_STEPS

    sched = make_scheduler(budget=256, max_seqs=64, num_blocks=4096)
    sched.max_loras = 1
    runner = FakeRunner(sched.block_manager.block_size)
    sched.add_request(_with_adapter(req("a0", [1, 2, 3], max_tokens=4), 1))
    sched.add_request(_with_adapter(req("b", [4, 5, 6], max_tokens=4), 2))
    admitted_at = None
    for n in range(10 * MAX_ADAPTER_WAIT_STEPS):
        sched.add_request(_with_adapter(req(f"a{n + 1}", [7, 8, 9], max_tokens=4), 1))   # a new one every step
        out = sched.schedule()
        if "b" in out.new_request_ids:
            admitted_at = n
            break
        sched.update_from_output(out, runner.execute(out))
    assert admitted_at is not None and MAX_ADAPTER_WAIT_STEPS <= admitted_at <= MAX_ADAPTER_WAIT_STEPS + 8


def test_priority_displacement_admits_the_arrival_in_the_same_step():
    """Victims are preempted only when the arrival is admitted in that step: the chunk room was made for is
    not recomputed larger once they are gone, and the blocks the staying decodes take next are kept for them."""
    sched = make_scheduler(num_blocks=13, block_size=1, budget=8, max_seqs=8, scheduling_policy="priority",
                           prefix_caching=False)
    a, b = req("A", list(range(10, 14)), max_tokens=8), req("B", list(range(20, 24)), max_tokens=8)
    a.priority = b.priority = 1
    head = req("H", list(range(30, 40)), max_tokens=2)
    head.priority = 0
    runner, steps = FakeRunner(1), []
    for r in (a, b):
        sched.add_request(r)
    for i in range(4):
        if i == 3:
            sched.add_request(head)
        out = sched.schedule()
        steps.append((list(out.preempted_request_ids), list(out.new_request_ids)))
        sched.update_from_output(out, runner.execute(out))
    assert steps[3][0] and steps[3][1] == ["H"], steps   # displaced for H, and H admitted at once


def test_a_prompt_chunk_without_room_waits_instead_of_preempting_itself():
    """Running decodes take the free blocks before a partly computed prompt's next chunk: the prompt takes a
    shorter chunk or waits with its blocks, instead of preempting itself and recomputing from scratch."""
    sched = make_scheduler(num_blocks=13, block_size=4, budget=16, max_seqs=8, scheduling_policy="priority",
                           prefix_caching=False)
    lows = [req(f"low{i}", list(range(100, 111)), max_tokens=20) for i in range(4)]
    for r in lows:
        r.priority = 1
    high = req("high", list(range(200, 240)), max_tokens=4)
    high.priority = 0
    expected = reference([*[req(r.request_id, r.prompt_token_ids, max_tokens=20) for r in lows],
                          req("high", high.prompt_token_ids, max_tokens=4)])
    added = []

    def watch(s: Scheduler, out: SchedulerOutput):
        if not added:
            s.add_request(high)
            added.append(True)

    outputs = run(sched, lows, watch)
    assert high.metrics.num_preemptions == 0
    assert {**outputs, "high": high.output_token_ids} == expected


def _image_prompt(rid: str, text: int, image: int, after: int, base: int = 100, max_tokens: int = 1):
    """A request of ``text`` tokens, an image of ``image`` positions, ``after`` tokens more."""
    import torch

    from plinth.multimodal.images import ImageItem

    r = req(rid, [base + i for i in range(text)] + [999] * image + [base + 50 + i for i in range(after)],
            max_tokens=max_tokens)
    r.images = [ImageItem(text, image, torch.empty(0), key=rid)]
    return r


def _run(s, runner, arrivals=None, steps: int = 400) -> dict[str, int]:
    """Run ``s`` to the end (requests of ``arrivals`` added at their steps); the step of each request's first
    token. Fails if a step schedules nothing while requests are unfinished, or a chunk ends inside an image."""
    first: dict[str, int] = {}
    for step in range(steps):
        for r in (arrivals or {}).get(step, []):
            s.add_request(r)
        if not s.has_unfinished_requests():
            return first
        out = s.schedule()
        assert out.scheduled, f"step {step}: nothing scheduled, requests unfinished"
        for e in out.scheduled:
            end = e.num_computed_tokens + e.num_new_tokens
            assert not any(item.offset < end < item.end for item in e.request.images), "a chunk ends in an image"
            if e.sample:
                first.setdefault(e.request.request_id, step)
        s.update_from_output(out, runner.execute(out))
    raise AssertionError("did not finish")


def test_whole_images_with_few_free_blocks():
    """Chunks never end inside an image (Gemma 3), and two prompts stopped before their images with fewer free blocks
    than an image needs still finish: the one that cannot fit preempts the other instead of both waiting."""
    s = make_scheduler(num_blocks=8, block_size=4, budget=16, prefix_caching=False)
    s.whole_images = 16
    first = _run(s, FakeRunner(4), {0: [_image_prompt("a", 8, 16, 4), _image_prompt("b", 8, 16, 4, base=300)]})
    assert set(first) == {"a", "b"}


def test_a_prompt_waiting_for_room_for_its_image_holds_back_no_one():
    """A prompt that waits for a step with room for its whole image beside a long decode does not keep other requests
    out (unless the engine says the budget may never leave that room: ``hold_for_images``)."""
    s = make_scheduler(num_blocks=256, block_size=4, budget=16, max_model_len=512)
    s.whole_images = 16
    first = _run(s, FakeRunner(4), {0: [req("long", [1, 2, 3], max_tokens=300)],
                                    2: [_image_prompt("image", 4, 16, 4, max_tokens=2)],
                                    3: [req("text", [7, 8, 9], max_tokens=2)]})
    assert first["text"] == 3   # at once, though the image prompt waits for the decode to end
    assert first["image"] > first["long"] + 250
