"""Engine-level behaviour: greedy equality across batching modes, prefix cache, preemption, aborts,
stop strings, n > 1, seeds and logprobs, against transformers running the same weights."""

from __future__ import annotations

import pytest
import torch

from plinth import LLM, SamplingParams
from plinth.config import ConfigError
from plinth.core.request import SamplingParamsError
from plinth.core.scheduler import RequestRejectedError

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is",
    "Large language models generate text one token at a time. Continuous batching keeps",
    "0123",
    "Caf\u00e9 na\u00efve",
]
MAX_TOKENS = 24


def llm_for(model_dir, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM(str(model_dir), **kw)


def greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def transformers_greedy(model_dir) -> list[list[int]]:
    """Greedy tokens of PROMPTS from transformers' own generate on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS,
                                 pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    return transformers_greedy(tiny_llama_dir)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir)


def test_batched_equals_transformers(llm, reference):
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference


def test_one_at_a_time_equals_batched(llm, reference):
    solo = [llm.generate(p, greedy(), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert solo == reference


def test_prefix_cache_hit_skips_tokens_and_keeps_output(tiny_llama_dir, reference):
    llm = llm_for(tiny_llama_dir)
    first = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    hits_before = llm.engine.block_manager.stats.hit_tokens
    second = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(first) == token_ids(second) == reference
    assert llm.engine.block_manager.stats.hit_tokens > hits_before
    assert sum(o.num_cached_tokens for o in second) > 0


def test_a_cache_salt_keeps_prefix_caches_apart(tiny_llama_dir, reference):
    """``cache_salt`` in a dict prompt (vLLM's): outputs are the same, but a prompt reuses cached blocks only from
    prompts of the same salt; beam search carries its prompt's salt; a bad salt is a clear error."""
    from plinth.core.scheduler import RequestRejectedError
    from plinth.entrypoints.beam_search import BeamSearchParams

    llm = llm_for(tiny_llama_dir)
    prompt = PROMPTS[2]   # several blocks of 4 tokens

    def run(**salt):
        out = llm.generate({"prompt": prompt, **salt}, greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[2]
        return out.num_cached_tokens

    assert run(cache_salt="a") == 0
    assert run(cache_salt="b") == 0 and run() == 0   # another salt, and none, share nothing with "a"
    hits = [run(cache_salt="a"), run(cache_salt="b"), run()]
    assert all(h > 0 for h in hits), hits
    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    out = llm.generate({"prompt_token_ids": ids, "cache_salt": "c"}, greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[1] and out.num_cached_tokens == 0
    beams = BeamSearchParams(beam_width=2, max_tokens=3)
    long_prompt = PROMPTS[2] + " and more"
    salted = llm.beam_search([{"prompt": long_prompt, "cache_salt": "d"}], beams)
    plain = llm.beam_search([long_prompt], beams)
    assert [b.token_ids for b in salted[0].sequences] == [b.token_ids for b in plain[0].sequences]
    # the search's rounds ran under the salt: the prompt is cached under "d" (and under no salt), not "e"
    again = [llm.generate({"prompt": long_prompt, "cache_salt": s}, greedy(2), use_tqdm=False)[0].num_cached_tokens
             for s in ("d", "e")]
    assert again[0] > 0 and again[1] == 0
    assert run(cache_salt=None) > 0   # null: no salt
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt.*non-empty string"):
            llm.generate({"prompt": prompt, "cache_salt": bad}, greedy(), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="cache_salt must be a non-empty string") as err:
        llm.engine.add_request("bad-salt", prompt, greedy(), cache_salt="")
    assert err.value.param == "cache_salt" and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown keys: 'salt'"):
        llm.generate({"prompt": prompt, "salt": "x"}, greedy(), use_tqdm=False)


def test_reset_prefix_cache_forgets_what_no_request_holds(tiny_llama_dir, reference):
    """``reset_prefix_cache``: afterwards no prompt reuses KV computed before (offline and through the async front);
    blocks a running request holds stay cached while it runs (the call then says ``False``)."""
    import asyncio

    from plinth.core.async_engine import AsyncLLMEngine, EngineUnavailableError

    llm = llm_for(tiny_llama_dir)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    assert llm.engine.block_manager.num_cached_blocks == 0
    again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(again) == reference and sum(o.num_cached_tokens for o in again) == 0
    # a request still running holds its blocks: they stay cached, the rest goes
    engine = llm.engine
    llm.generate(PROMPTS[1:], greedy(), use_tqdm=False)
    engine.add_request("held", PROMPTS[2], greedy(8))
    engine.step()
    held = engine.block_manager.num_cached_blocks
    assert held > 0 and llm.reset_prefix_cache() is False
    assert 0 < engine.block_manager.num_cached_blocks <= held
    while engine.has_unfinished_requests():
        engine.step()
    hit = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    miss = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and miss.num_cached_tokens == 0
    assert token_ids([hit, miss]) == [reference[2], reference[1]]

    front = AsyncLLMEngine(engine)

    async def through_the_front() -> bool:
        return await front.reset_prefix_cache()

    assert asyncio.run(through_the_front()) is True and engine.block_manager.num_cached_blocks == 0

    # a caller that gives up (a timeout, a client gone) while a request streams: the call is dropped, the request
    # and the engine go on
    step = engine.step

    def slow_step(*args, **kwargs):
        import time

        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.step = slow_step

    async def cancelled_while_streaming() -> list:
        outputs = []
        stream = front.generate("streaming", PROMPTS[0], greedy(12))
        outputs.append(await stream.__anext__())
        task = asyncio.create_task(front.reset_prefix_cache())
        await asyncio.sleep(0)
        task.cancel()
        async for out in stream:
            outputs.append(out)
        return outputs

    outputs = asyncio.run(asyncio.wait_for(cancelled_while_streaming(), 60))
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference[0][:12]
    assert front.is_healthy and asyncio.run(through_the_front()) is True
    engine.step = step
    front.shutdown()
    with pytest.raises(EngineUnavailableError):
        asyncio.run(through_the_front())
    llm.close()


def test_preemption_keeps_outputs(tiny_llama_dir, reference):
    # 23 usable blocks of 4 tokens hold the longest request (80 tokens) but not all five at once.
    llm = llm_for(tiny_llama_dir, num_blocks=24, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert token_ids(outs) == reference


def test_prefix_cache_queries_count_first_admissions_only(tiny_llama_dir, reference):
    """The prefix cache's counters (behind ``plinth_prefix_cache_hit_rate``) count each request's first admission:
    a preempted request taking back its own blocks when it resumes is no query and no hit (distinct prompts: no
    hits at all), and a prompt whose every position's logits are wanted skips the lookup and is no query."""
    llm = llm_for(tiny_llama_dir, num_blocks=24)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == reference and llm.engine.scheduler.stats().num_preemptions > 0
    s = llm.engine.block_manager.stats
    assert (s.queries, s.query_tokens, s.hit_tokens) == (len(PROMPTS), sum(len(o.prompt_token_ids) for o in outs), 0)
    assert llm.engine.stats()["prefix_cache_hit_rate"] == 0.0
    llm.generate(PROMPTS[0], greedy(2, prompt_logprobs=1), use_tqdm=False)
    assert s.queries == len(PROMPTS)

def test_priority_policy_keeps_outputs_and_fcfs_refuses_priorities(tiny_llama_dir, reference, llm):
    """With scheduling_policy="priority", priorities reorder and preempt (a small cache) but never change a
    greedy output (transformers' tokens); first come, first served refuses a priority."""
    prio = llm_for(tiny_llama_dir, num_blocks=24, enable_prefix_caching=False, scheduling_policy="priority",
                   max_num_seqs=2)
    outs = prio.generate(PROMPTS, greedy(), priority=[4, 0, 3, 1, 2], use_tqdm=False)
    assert token_ids(outs) == reference
    assert prio.engine.scheduler.stats().num_preemptions > 0
    with pytest.raises(ValueError, match="priorities"):
        prio.generate(PROMPTS[:2], greedy(), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        prio.generate(PROMPTS[:2], greedy(), priority=3, use_tqdm=False)
    import numpy as np
    again = prio.generate(PROMPTS[:2], greedy(), priority=np.array([1, 0]), use_tqdm=False)
    assert token_ids(again) == reference[:2]
    prio.close()
    with pytest.raises(RequestRejectedError, match="scheduling-policy priority") as info:
        llm.generate(PROMPTS[0], greedy(), priority=[1], use_tqdm=False)
    assert info.value.param == "priority" and not llm.engine.has_unfinished_requests()
    with pytest.raises(ConfigError, match="scheduling_policy"):
        llm_for(tiny_llama_dir, scheduling_policy="lifo")


@pytest.mark.parametrize("kw,match", [
    (dict(trust_remote_code="false"), "trust_remote_code must be true or false, got 'false'"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be true or false"),
    (dict(enforce_eager=1), "enforce_eager must be true or false"),
    (dict(async_scheduling="off"), "async_scheduling must be true or false"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be in"),
    (dict(gpu_memory_utilization=None), "gpu_memory_utilization must be in"),
    (dict(seed=None), "seed must be an integer"),
    (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),
    (dict(platform=5), "platform must be a string, got 5"),
    (dict(attention_backend=["x"]), "attention_backend must be a string"),
    (dict(tokenizer=5), "tokenizer must be a string, got 5"),
    (dict(chat_template=5), "chat_template must be a string, got 5"),
    (dict(served_model_name=5), "served_model_name must be a name or a list of names, got 5"),
    (dict(max_num_seqs=10**9), "max_num_seqs must be at most 65536, got 1000000000"),
])
def test_engine_options_of_the_wrong_type_are_config_errors(kw, match):
    """A string where a flag belongs would count as true (trust_remote_code="false" would run a checkpoint's
    code), and other wrong types failed deep in start-up: each is refused at once, naming the option."""
    from plinth.config import EngineConfig

    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(**kw)
    assert EngineConfig.from_kwargs(async_scheduling=None, normalize_embeddings=None) is not None
    from pathlib import Path

    assert EngineConfig.from_kwargs(tokenizer=Path("/tok")).model.tokenizer == "/tok"   # a path object is its text
    # vLLM's and torch's names of the dtypes
    assert [EngineConfig.from_kwargs(dtype=d).model.dtype for d in ("half", "float", torch.bfloat16, "bf16")] == [
        "float16", "float32", "bfloat16", "bfloat16"]
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, float16, bfloat16"):
        EngineConfig.from_kwargs(dtype=torch.int8)


def test_chunked_prefill_small_budget(tiny_llama_dir, reference):
    llm = llm_for(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=3)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference


def test_aborted_request_returns_the_text_held_back_for_a_stop_string(llm):
    """Text held back because it could start a stop string is returned when the request is aborted."""
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    engine.add_request("held", PROMPTS[1], greedy(stop=["\x00" * 40]))
    for _ in range(6):
        engine.step()
    engine.abort_request("held")
    out = [o for o in engine.step() if o.request_id == "held"][0].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def _failing_execute(engine, fail_on: int, exc: BaseException):
    """Make the engine's executor raise ``exc`` on its ``fail_on``-th step (counting from 1), then run normally
    (the synchronous steps' ``execute``: an engine made with ``async_scheduling=False``, the default on the CPU;
    tests/test_async_scheduling.py fails the asynchronous steps)."""
    real, calls = engine.executor.execute, [0]

    def execute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_on:
            raise exc
        return real(*args, **kwargs)

    engine.executor.execute = execute


@pytest.mark.parametrize("fail_on", [1, 4], ids=["first-chunk", "later-chunk"])
@pytest.mark.parametrize("exc", [RuntimeError("out of memory (simulated)"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_llama_dir, reference, fail_on, exc):
    """A step that raises (an error, Ctrl-C) ends its requests; the blocks registered for the tokens it was to
    compute leave the prefix cache, those of earlier steps stay, so the same prompt again is computed right (a hit
    on the unwritten blocks gave garbage tokens)."""
    # the prompt in chunks of 4: one block per step
    llm = llm_for(tiny_llama_dir, max_num_batched_tokens=4, async_scheduling=False)
    engine = llm.engine
    _failing_execute(engine, fail_on, exc)
    with pytest.raises(type(exc)):
        llm.generate(PROMPTS[2], greedy(), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    again = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference[2]
    assert again.num_cached_tokens == 4 * (fail_on - 1)   # the chunks written before the failure


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tiny_llama_dir, reference):
    """A direct LLMEngine user whose step raised: the requests of that step end (abort) instead of staying
    unfinished for good, and later requests run normally."""
    llm = llm_for(tiny_llama_dir, async_scheduling=False)
    engine = llm.engine
    _failing_execute(engine, 3, RuntimeError("transient (simulated)"))
    engine.add_request("a", PROMPTS[0], greedy())
    engine.add_request("b", PROMPTS[1], greedy())
    engine.step()
    engine.step()
    engine.abort_request("b")   # to be reported by the step that fails: reported by the next one instead
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    outs = engine.step()
    assert sorted((o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs) == [
        ("a", True, "abort"), ("b", True, "abort")]
    assert not engine.has_unfinished_requests()
    assert token_ids(llm.generate(PROMPTS[0], greedy(), use_tqdm=False)) == [reference[0]]


def test_abort_frees_all_blocks(tiny_llama_dir):
    llm = llm_for(tiny_llama_dir, enable_prefix_caching=False)
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(200))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < free0
    with pytest.raises(TypeError, match="request_ids must be a request id or a list of them, got None"):
        engine.abort_request(None)
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    assert engine.block_manager.num_free_blocks == free0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()


def test_an_aborted_id_is_free_at_once(tiny_llama_dir, reference):
    """An id aborted and added again before a step: the next step reports the aborted request's end first, then the
    new request runs as it would alone; a request id of another request's sample, or not a string, is refused
    without touching that request."""
    from plinth.core.scheduler import RequestRejectedError

    llm = llm_for(tiny_llama_dir)
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    engine.add_request("x", PROMPTS[0], greedy(200))
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", PROMPTS[1], greedy())
    outs = engine.step()
    assert outs[0].request_id == "x" and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    finals = [o for o in outs if o.finished]
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["abort", "length"]
    assert finals[1].outputs[0].token_ids == reference[1]
    # a refused re-add leaves the aborted request's end to the next step; an n=2 id taken again with n=2
    for first, again in ((1, 1), (2, 2)):
        engine.add_request("y", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, n=first))
        engine.step()
        engine.abort_request("y")
        with pytest.raises(RequestRejectedError, match="empty"):
            engine.add_request("y", [], greedy())
        assert engine.has_unfinished_requests()
        engine.add_request("y", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True, n=again))
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        assert [o.outputs[0].finish_reason for o in finals] == ["abort", "length"]
        assert [c.token_ids for c in finals[1].outputs] == [reference[1]] * again
    engine.add_request("a", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2))
    engine.step()
    with pytest.raises(RequestRejectedError, match="'a#0' is in use by a sample of request 'a'"):
        engine.add_request("a#0", PROMPTS[0], greedy())
    for rid in (7, None, ("a",)):
        with pytest.raises(RequestRejectedError, match="a request id must be a string"):
            engine.add_request(rid, PROMPTS[0], greedy())
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [[c.token_ids for c in o.outputs] for o in finals] == [[reference[2]] * 2]
    assert engine.block_manager.num_free_blocks == free0


def test_stop_string_and_eos(llm):
    full = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0]
    # pick a stop string from the middle of the greedy text
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(PROMPTS[1], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    # the token that completes the stop string is also the last one allowed: the stop string still wins
    at_limit = llm.generate(PROMPTS[1], greedy(len(cut.token_ids), stop=[stop]), use_tqdm=False)[0]
    assert at_limit.outputs[0].token_ids == cut.token_ids and at_limit.outputs[0].text == cut.text
    assert at_limit.outputs[0].finish_reason == "stop" and at_limit.outputs[0].stop_reason == stop
    kept = llm.generate(PROMPTS[1], greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    # a stop token id ends generation right there
    tid = full.token_ids[5]
    by_id = llm.generate(PROMPTS[1], greedy(stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tid


def test_the_engine_seed_seeds_requests_without_their_own(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    draws = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 7)):
        llm = llm_for(tiny_llama_dir, seed=seed)
        draws[name] = token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        llm.close()
    assert draws["a"] == draws["b"] != draws["c"]


def test_n_samples_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    a = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert len(a.outputs) == 3
    # same seed, same outputs, whatever else is in the batch
    b = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # siblings differ
    # sample 0 is the request's own seed; the others are hashed from (seed, index), so nearby seeds
    # do not share samples (seed + index would make seed 1235's first sample a's second)
    alone = llm.generate(PROMPTS[0], params.clone(n=1), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == a.outputs[0].token_ids
    nearby = llm.generate(PROMPTS[0], params.clone(seed=1235), use_tqdm=False)[0].outputs
    assert not {tuple(c.token_ids) for c in nearby} & {tuple(c.token_ids) for c in a.outputs[1:]}


def test_seed_minus_one_is_no_seed(llm):
    """vLLM's ``seed=-1`` means no seed: each call draws new samples (not the fixed samples of a seed -1)."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=-1, ignore_eos=True)
    assert params.seed is None and params.clone().seed is None
    runs = {tuple(llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_prompts_and_params_of_the_wrong_type_are_clear_errors(llm, tiny_llama_dir):
    import numpy as np

    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    as_list = llm.generate([ids], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(np.array(ids), greedy(4), use_tqdm=False)[0].outputs[0].token_ids == as_list
    assert llm.generate(torch.tensor(ids), greedy(4), use_tqdm=False)[0].outputs[0].token_ids == as_list
    for bad in ([[1.7, 2.2]], [["1", "2"]], [None], [[True, 2]]):
        with pytest.raises(RequestRejectedError, match="list of token ids"):
            llm.generate(bad, greedy(4), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="not valid Unicode"):
        llm.generate("a\ud800b", greedy(4), use_tqdm=False)
    limit = llm.engine.chars_per_token * llm.engine.max_model_len
    with pytest.raises(RequestRejectedError, match="characters"):
        llm.generate("x" * (limit + 1), greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    for kw in (dict(temperature="0.5"), dict(top_p=None), dict(n=2.0), dict(max_tokens=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    from plinth.errors import UserFacingError

    with pytest.raises(UserFacingError, match="not a valid jinja2 template"):
        llm_for(tiny_llama_dir, chat_template="{{ messages ")


def test_logprobs_match_transformers(llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = llm.generate(PROMPTS[0], greedy(6, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    ids = tok(PROMPTS[0]).input_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    n_prompt = len(out.prompt_token_ids)
    for i, pos in enumerate(out.outputs[0].logprobs):
        tok_id = out.outputs[0].token_ids[i]
        row = ref[n_prompt - 1 + i]
        assert pos[tok_id].logprob == pytest.approx(row[tok_id].item(), abs=1e-4)
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(pos)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for i in range(1, n_prompt):
        t = out.prompt_token_ids[i]
        assert out.prompt_logprobs[i][t].logprob == pytest.approx(ref[i - 1, t].item(), abs=1e-4)


def test_token_id_prompts_and_rejections(llm, tiny_llama_dir):
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    by_ids = llm.generate([ids], greedy(), use_tqdm=False)[0]
    by_text = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(RequestRejectedError, match="512"):
        llm.generate([[1] * 600], greedy(), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="out of range"):
        llm.generate([[10**6]], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # a batch with a rejected prompt after good ones leaves none of them queued
    with pytest.raises(RequestRejectedError, match="out of range"):
        llm.generate([ids, ids, [10**6]], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # min_tokens that cannot fit after the prompt; a prompt that is itself too long still says so
    with pytest.raises(RequestRejectedError, match="min_tokens is 600"):
        llm.generate([ids], SamplingParams(max_tokens=None, min_tokens=600), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="512"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=None, min_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # more sequences than the waiting queue can ever hold
    capped = llm_for(tiny_llama_dir, max_waiting_requests=2, max_num_seqs=1)
    with pytest.raises(RequestRejectedError, match=r"n is 4, more sequences than the running batch and the waiting "
                                                   r"queue hold together \(1 \+ 2\)"):
        capped.generate([ids], SamplingParams(n=4, max_tokens=2), use_tqdm=False)
    assert len(capped.generate([ids], SamplingParams(n=3, max_tokens=2), use_tqdm=False)[0].outputs) == 3
    capped.close()
    # a logit_bias token outside the vocabulary
    with pytest.raises(RequestRejectedError, match="logit_bias: token id 1000000 is out of range"):
        llm.generate([ids], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="logit_bias: token id 12345678901234567890... is too large"):
        SamplingParams(logit_bias={"1234567890123456789012345678901234567890": 1.0})
    assert SamplingParams(logit_bias={"0000000000000000000000001": 2.0}).logit_bias == {1: 2.0}   # leading zeros
    # a stop token outside the vocabulary never matches, as in vLLM (whose examples pass ids an adapter adds); with
    # min_tokens too, where stop ids are masked until then
    plain = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0), use_tqdm=False)
    for extra in ({}, {"min_tokens": 2}):
        odd = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0,
                                                 stop_token_ids=[10**6], **extra), use_tqdm=False)
        assert odd[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()


def test_a_tokens_prompt_may_carry_its_text(llm):
    """vLLM's ``TokensPrompt`` takes the ids' text as ``prompt`` (the output reports it); the ids are what runs."""
    from plinth import TokensPrompt

    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids, prompt="shown"), ids,
                         {"prompt_token_ids": ids, "prompt": None, "cache_salt": "s"}], greedy(), use_tqdm=False)
    assert [o.prompt for o in outs] == ["shown", None, None]
    assert outs[0].prompt_token_ids == ids and token_ids(outs) == [outs[1].outputs[0].token_ids] * 3
    with pytest.raises(ValueError, match="'prompt' must be text, got int"):
        llm.generate({"prompt_token_ids": ids, "prompt": 5}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate({"prompt_token_ids": ids, "prompt": "a", "prompt_embeds": None}, greedy(), use_tqdm=False)


def test_chat_uses_template(llm):
    from plinth.entrypoints.openai.tools import plain_messages

    conv = [{"role": "user", "content": "Paris is"}]
    rendered = llm.engine.render_chat(conv)
    assert rendered == "<|im_start|>user\nParis is<|im_end|>\n<|im_start|>assistant\n"
    a = llm.chat(conv, greedy(8), use_tqdm=False)[0]
    b = llm.generate(rendered, greedy(8), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == rendered and a.prompt_token_ids == b.prompt_token_ids   # as vLLM's: the rendered prompt
    # OpenAI's message shapes, read as the server reads them: text parts joined by line breaks (as vLLM joins them
    # for a template reading a string), a tool-call turn's null content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Paris"}, {"type": "text", "text": "is"}]}]
    assert llm.engine.render_chat(plain_messages(parts)) == "<|im_start|>user\nParis\nis<|im_end|>\n<|im_start|>assistant\n"
    joined = llm.chat([{"role": "user", "content": "Paris\nis"}], greedy(8), use_tqdm=False)[0]
    assert llm.chat(parts, greedy(8), use_tqdm=False)[0].outputs[0].token_ids == joined.outputs[0].token_ids
    calls = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
    out = llm.chat(calls, greedy(4), use_tqdm=False)[0]
    assert "<|im_start|>assistant\n<|im_end|>" in llm.get_tokenizer().decode(out.prompt_token_ids)
    with pytest.raises(ValueError, match=r"messages\[0\]: this model takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(2))


def test_prompt_logprobs_survive_preemption_during_the_prefill(tiny_llama_dir):
    """A request preempted in the middle of its chunked prefill computes its prompt again: its prompt
    logprobs still have one entry per position, equal to those of the request run alone."""
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine

    def engine(**kw):
        return LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off",
                                                  block_size=4, max_model_len=64, enable_prefix_caching=False, **kw))

    def finish(eng, reqs):
        for rid, prompt, params in reqs:
            eng.add_request(rid, prompt, params)
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        return done

    prompt = list(range(10, 50))
    plp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    # 11 usable blocks: "hog" decodes while "p" is prefilled 3 tokens a step, until "p" is preempted mid-prompt
    tight = engine(num_blocks=12, max_num_batched_tokens=4, max_num_seqs=2)
    got = finish(tight, [("hog", [5, 6, 7, 8], greedy(24)), ("p", prompt, plp)])["p"]
    assert tight.scheduler.num_preemptions > 0
    want = finish(engine(num_blocks=64, max_num_batched_tokens=64), [("p", prompt, plp)])["p"]
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert got.prompt_logprobs[i].keys() == want.prompt_logprobs[i].keys() and prompt[i] in got.prompt_logprobs[i]
        for t, lp in got.prompt_logprobs[i].items():
            assert lp.logprob == pytest.approx(want.prompt_logprobs[i][t].logprob, abs=1e-4)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_sample_ids_of_n_that_collide_with_a_request_id_are_a_clear_error(llm):
    engine = llm.engine
    engine.add_request("a#1", PROMPTS[0], greedy(2))
    with pytest.raises(RequestRejectedError, match="names its samples"):
        engine.add_request("a", PROMPTS[0], SamplingParams(n=2, max_tokens=2))
    engine.abort_request(["a#1"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def find_sub(seq: list[int], sub: list[int]) -> int:
    return next((i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub), -1)


def test_bad_words_ban_the_last_token_after_the_prefix(tiny_llama_dir):
    """A word the greedy output contains: with it in bad_words the output is the same up to the word's last
    token, differs there, and contains none of the word's token sequences; a one-token word never appears."""
    llm = llm_for(tiny_llama_dir)
    free = llm.generate([PROMPTS[1]], greedy(32))[0].outputs[0].token_ids
    tok = llm.engine.tokenizer
    found = None
    for i in range(len(free)):
        for n in (2, 3):
            word = tok.decode(free[i:i + n]).strip()
            seqs = llm.engine._bad_words_ids([word]) if word else []
            hits = [(find_sub(free, s), s) for s in seqs if len(s) > 1 and find_sub(free, s) >= 0]
            if hits:
                found = (word, seqs, min(hits))
                break
        if found:
            break
    assert found is not None, "no multi-token word in the greedy output"
    word, seqs, (at, seq) = found
    out = llm.generate([PROMPTS[1]], greedy(32, bad_words=[word]))[0].outputs[0].token_ids
    cut = at + len(seq) - 1
    assert out[:cut] == free[:cut] and out[cut] != free[cut]
    assert all(find_sub(out, s) < 0 for s in seqs)
    # a one-token word: the first output token whose text tokenizes back to it
    single, text = next((t, tok.decode([t]).strip()) for t in free
                        if tok.decode([t]).strip() and [t] in llm.engine._bad_words_ids([tok.decode([t]).strip()]))
    out = llm.generate([PROMPTS[1]], greedy(32, bad_words=[text]))[0].outputs[0].token_ids
    first = free.index(single)
    assert single not in out and out[:first] == free[:first]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_max_logprobs(tiny_llama_dir):
    """The engine's max_logprobs bounds logprobs and prompt_logprobs (default 20; --max-logprobs raises it)."""
    from plinth.core.scheduler import RequestRejectedError

    llm = llm_for(tiny_llama_dir)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestRejectedError, match=f"{name}: at most 20 .*--max-logprobs"):
            llm.generate([PROMPTS[0]], greedy(2, **{name: 25}))
    wide = llm_for(tiny_llama_dir, max_logprobs=40)
    out = wide.generate([PROMPTS[0]], greedy(2, logprobs=30, prompt_logprobs=30))[0]
    assert all(len(pos) >= 30 for pos in out.outputs[0].logprobs)
    assert all(len(pos) >= 30 for pos in out.prompt_logprobs[1:])
    with pytest.raises(ConfigError, match="max_logprobs"):
        llm_for(tiny_llama_dir, max_logprobs=0)
    # -1 (as vLLM's): every token of the vocabulary, where max_logprobs is -1 (no limit)
    vocab = llm.engine.vocab_size
    whole = greedy(2, logprobs=-1, prompt_logprobs=-1)
    with pytest.raises(RequestRejectedError, match=f"logprobs: at most 20 .*got -1 .the whole vocabulary: {vocab}"):
        llm.generate([PROMPTS[0]], whole, use_tqdm=False)
    unbounded = llm_for(tiny_llama_dir, max_logprobs=-1)
    out = unbounded.generate([PROMPTS[0]], whole, use_tqdm=False)[0]
    assert whole.logprobs == whole.prompt_logprobs == -1   # the caller's params as given
    for pos in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert sorted(pos) == list(range(vocab))
        # a distribution over the whole vocabulary: the probabilities add up to 1, the ranks run 1..vocab
        assert torch.logsumexp(torch.tensor([lp.logprob for lp in pos.values()], dtype=torch.float64), 0) == \
            pytest.approx(0.0, abs=1e-4)
        assert sorted(lp.rank for lp in pos.values()) == list(range(1, vocab + 1))


def test_block_tables_are_as_wide_as_the_cache_not_the_context(tmp_path):
    """A config whose context is 2**32 - 1 tokens: the block tables hold at most every block of the cache (a
    table as wide as the context would be 256 GiB), and the engine runs."""
    from conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "m", max_position_embeddings=2 ** 32 - 1)
    llm = llm_for(path, num_blocks=64)
    engine = llm.engine
    assert engine.max_model_len == 2 ** 32 - 1
    assert engine.runner.max_blocks_per_seq == 64
    out = llm.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    reference = llm_for(save_tiny_model(tmp_path / "r"), num_blocks=64).generate(PROMPTS[:2], greedy(8), use_tqdm=False)
    assert token_ids(out) == token_ids(reference)


def test_each_output_keeps_the_metrics_of_its_step(llm):
    """An output's metrics are a snapshot: an output read after later steps still has its own step's times (the
    request's own object goes on changing), so a first output read late does not widen its token gaps."""
    engine = llm.engine
    engine.add_request("metrics-snapshot", [5, 6, 7, 8],
                       params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "metrics-snapshot"]
    firsts = [o for o in outs if o.outputs[0].token_ids]
    assert len(firsts) >= 2
    assert firsts[0].metrics.last_token_time == firsts[0].metrics.first_token_time
    assert firsts[0].metrics is not firsts[-1].metrics
    assert firsts[-1].metrics.last_token_time > firsts[0].metrics.last_token_time
    assert firsts[-1].metrics.finished_time is not None and firsts[0].metrics.finished_time is None


def test_generate_from_two_threads(llm, reference):
    """Two threads sharing one LLM: each gets its own outputs (one steps the engine at a time; before, a thread
    could drop the other's finished requests and leave it waiting for ever)."""
    import threading

    results: dict[int, list[list[int]]] = {}

    def work(i: int) -> None:
        results[i] = token_ids(llm.generate(PROMPTS * 3, greedy(), use_tqdm=False))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert results == {0: reference * 3, 1: reference * 3}


def test_prompt_arrays_and_numpy_parameters(llm, reference):
    """A numpy array (or tensor) of strings is a list of prompts, one of integers a token-id prompt; numpy scalars
    are taken as SamplingParams values; a list of params holds SamplingParams only; n is bounded."""
    import numpy as np

    got = llm.generate(np.array(PROMPTS[:2]), greedy(), use_tqdm=False)
    assert token_ids(got) == reference[:2]
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    assert token_ids(llm.generate(np.array(ids), greedy(), use_tqdm=False)) == reference[:1]
    assert token_ids(llm.generate(torch.tensor(ids), greedy(), use_tqdm=False)) == reference[:1]
    params = SamplingParams(temperature=np.float32(0.0), top_p=np.float32(1.0), max_tokens=np.int64(MAX_TOKENS), logprobs=np.int64(2),
                            ignore_eos=True, stop_token_ids=np.array([6]))
    assert type(params.temperature) is float and type(params.max_tokens) is int and params.stop_token_ids == [6]
    ids_np = SamplingParams(allowed_token_ids=np.array([5, 6]), logit_bias={np.int64(5): np.float32(1.5)})
    assert ids_np.allowed_token_ids == [5, 6] and type(ids_np.allowed_token_ids[0]) is int
    assert ids_np.logit_bias == {5: 1.5} and type(next(iter(ids_np.logit_bias))) is int
    from plinth import BeamSearchParams

    beam = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(3), length_penalty=np.float32(0.5))
    assert (type(beam.beam_width), type(beam.max_tokens), type(beam.length_penalty)) == (int, int, float)
    with pytest.raises(SamplingParamsError, match="n: must be at most 1024"):
        SamplingParams(n=2 ** 62)
    with pytest.raises(SamplingParamsError, match="top_k: must be -1 or 0 .no top-k. or a positive integer, got -2"):
        SamplingParams(top_k=-2)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0
    for bad in (dict(seed=True), dict(stop_token_ids=[True])):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .or one per prompt., got None"):
        llm.generate(PROMPTS[:2], [greedy(), None], use_tqdm=False)
    # values set after construction are taken in the same forms as the constructor's
    late = greedy()
    late.temperature, late.logit_bias, late.stop = np.float32(0.0), {"5": 1.5}, "never seen"
    built = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={5: 1.5},
                           stop="never seen")
    assert token_ids(llm.generate(PROMPTS[0], late, use_tqdm=False)) == \
        token_ids(llm.generate(PROMPTS[0], built, use_tqdm=False))   # as if given to the constructor
    assert (type(late.temperature), late.logit_bias, late.stop) == (float, {5: 1.5}, ["never seen"])
    late.logit_bias = {"five": 1.0}
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        llm.generate(PROMPTS[0], late, use_tqdm=False)


def test_chat_template_kwargs_may_not_repeat_chat_arguments(llm):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conversation, greedy(2), chat_template_kwargs="enable_thinking")
    for key in ("add_generation_prompt", "tools", "tokenize"):
        with pytest.raises(ValueError, match=f"template_kwargs may not set {key}"):
            llm.chat(conversation, greedy(2), chat_template_kwargs={key: False}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_cache_of_one_block_and_a_budget_below_the_context(tiny_llama_dir, caplog):
    """``num_blocks=1`` (only the reserved block) is a ConfigError; a step budget below the context with chunked
    prefill off is said at start (longer prompts are then refused, each with a message)."""
    import logging

    with pytest.raises(ConfigError, match="num_blocks must be at least 2 .block 0 is reserved"):
        LLM(str(tiny_llama_dir), dtype="float32", selection="off", num_blocks=1)
    with caplog.at_level(logging.WARNING, logger="plinth.core.engine"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", selection="off", max_num_batched_tokens=4,
                  enable_chunked_prefill=False, max_model_len=64)
    assert "max_num_batched_tokens (4) is below max_model_len (64) with chunked prefill off" in caplog.text
    with pytest.raises(RequestRejectedError, match="more than max_num_batched_tokens .4. with chunked prefill"):
        llm.generate([[5, 6, 7, 8, 9]], greedy(2), use_tqdm=False)


def test_a_cache_beyond_memory_is_a_config_error(tiny_llama_dir, monkeypatch):
    """A ``num_blocks`` whose KV cache the memory cannot hold (numpy's allocation fails: the CPU's cache) is a
    ``ConfigError`` naming the flag, not a MemoryError traceback."""
    from plinth.worker import model_runner

    def no_memory(shape, dtype, device):
        raise MemoryError(f"Unable to allocate {shape}")

    monkeypatch.setattr(model_runner, "_zeros", no_memory)
    with pytest.raises(ConfigError, match="KV cache of 100000000000 blocks does not fit.*lower --num-blocks"):
        LLM(str(tiny_llama_dir), dtype="float32", selection="off", num_blocks=10**11, platform="cpu")


@pytest.mark.parametrize("name", ["PLINTH_CPU_NATIVE_OPS", "PLINTH_CPU_AMX", "PLINTH_FUSED_OPS",
                                  "PLINTH_CPU_PAGED_ATTENTION", "PLINTH_CPU_SDPA_PREFILL"])
def test_kernel_switches_with_bad_values_are_config_errors(tiny_llama_dir, monkeypatch, name):
    """The on/off switches kernels read where they run take 1/0, true/false, yes/no, on/off; another value is a
    ``ConfigError`` naming the variable when the engine is configured (``maybe`` had turned three of them on and
    the paged-attention kernel off, silently)."""
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ConfigError, match=f"{name}='maybe': expected 1/0"):
        LLM(str(tiny_llama_dir), dtype="float32", selection="off")
    monkeypatch.setenv(name, "off")
    from plinth.config import EngineConfig

    assert EngineConfig.from_kwargs(model=str(tiny_llama_dir)) is not None


def test_chat_templates_with_transformers_extensions_are_accepted(tiny_llama_dir):
    """``--chat-template`` text using what transformers' renderer compiles (``{% continue %}``, ``{% break %}``,
    ``{% generation %}``) is accepted and renders as transformers renders it (it was refused as invalid)."""
    from transformers import AutoTokenizer

    from plinth.worker.setup import read_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    for template in (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<{{ m.role }}>{{ m.content }}"
        "{% endfor %}",
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    ):
        assert read_chat_template(template) == template
        llm = llm_for(tiny_llama_dir, chat_template=template)
        expected = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
        assert llm.engine.render_chat(messages, add_generation_prompt=False) == expected
        llm.close()


def test_max_tokens_past_the_context_stop_at_its_end_offline(tiny_llama_dir):
    """As vLLM's offline engine: a max_tokens the context cannot hold is no refusal (one such prompt failed the whole
    batch); the output stops at max_model_len with finish reason length, and the other prompts are unaffected."""
    llm = llm_for(tiny_llama_dir, max_model_len=32)
    prompts = [list(range(5, 19)), [5, 6, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [32 - 14, 32 - 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    short = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=18, ignore_eos=True), use_tqdm=False)
    assert short[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("content_format,want", [("auto", "L[a][b]"), ("openai", "L[a][b]"), ("string", "Sa\nb")])
def test_chat_template_content_format(tiny_llama_dir, content_format, want):
    """vLLM's ``--chat-template-content-format``: ``string`` hands a template the message's text (parts joined by
    line breaks) even where it loops over content, ``openai`` the parts, ``auto`` decides by the template."""
    from plinth.config import EngineConfig
    from plinth.entrypoints.openai.tools import plain_messages

    template = ("{% for m in messages %}{% if m['content'] is string %}S{{ m['content'] }}{% else %}L"
                "{% for c in m['content'] %}[{{ c.text }}]{% endfor %}{% endif %}{% endfor %}")
    llm = llm_for(tiny_llama_dir, chat_template=template, chat_template_content_format=content_format)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert llm.engine.render_chat(plain_messages([{"role": "user", "content": parts}])) == want
    plain = "{% for m in messages %}{% if m['content'] is string %}S{{ m['content'] }}{% else %}L{% endif %}{% endfor %}"
    got = llm.engine.render_chat(plain_messages([{"role": "user", "content": "x"}]), chat_template=plain)
    assert got == ("L" if content_format == "openai" else "Sx")   # a string reaches the template as parts, or as is
    with pytest.raises(ConfigError, match="chat_template_content_format must be one of auto, string, openai"):
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), chat_template_content_format="jinja")
    from plinth.entrypoints.cli import build_parser
    from plinth.entrypoints.engine_args import engine_config_from_args

    argv = ["serve", str(tiny_llama_dir), "--chat-template-content-format", content_format]
    config = engine_config_from_args(build_parser(argv).parse_args(argv))
    assert config.model.chat_template_content_format == content_format


def test_a_template_that_loops_over_content_parts_gets_parts(tiny_llama_dir):
    """A chat template that loops over ``message['content']`` (image-and-text models' templates) reads OpenAI's
    content parts: messages reach it as text parts, whether they came as a string or as parts, and the prompt is
    transformers' for the parts (it looped over the string's characters, or lost the text)."""
    from transformers import AutoTokenizer

    from plinth.core.engine import template_iterates_content

    template = ("{% for m in messages %}<{{ m.role }}>{% for c in m['content'] %}{% if c.type == 'text' %}"
                "{{ c.text }}{% endif %}{% endfor %}{% endfor %}<A>")
    aliased = "{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}"
    assert template_iterates_content(template) and template_iterates_content(aliased)
    assert not template_iterates_content("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Translate: hello"}]}], tokenize=False,
        chat_template=template)
    assert expected == "<user>Translate: hello<A>"
    llm = llm_for(tiny_llama_dir, chat_template=template)
    from plinth.entrypoints.openai.tools import plain_messages

    two = [{"type": "text", "text": "Translate: "}, {"type": "text", "text": "hello"}]
    for content in ("Translate: hello", two):
        assert llm.engine.render_chat(plain_messages([{"role": "user", "content": content}])) == expected
    # each part stays a part (vLLM's "openai" content format), as transformers renders the same parts
    wrapping = "{% for m in messages %}{% for c in m['content'] %}[{{ c.text }}]{% endfor %}{% endfor %}"
    want = tokenizer.apply_chat_template([{"role": "user", "content": two}], tokenize=False, chat_template=wrapping)
    assert want == "[Translate: ][hello]"
    assert llm.engine.render_chat(plain_messages([{"role": "user", "content": two}]), chat_template=wrapping) == want
    # the joined text keeps its parts through copies and pickles (a user's deep-copied conversation)
    import copy
    import pickle

    from plinth.core.engine import TextParts

    text = plain_messages([{"role": "user", "content": two}])[0]["content"]
    for again in (copy.copy(text), copy.deepcopy(text), pickle.loads(pickle.dumps(text))):
        assert type(again) is TextParts and again == text == "Translate: \nhello" and again.parts == text.parts
    assert template_iterates_content.cache_info().maxsize == 16   # (the template's scan is cached)
    llm.close()


def test_text_whose_tokens_the_model_lacks_is_refused(tmp_path):
    """A tokenizer with more tokens than the model's vocabulary (an added token the embedding was never resized
    for): text that tokenizes to such an id is refused when it arrives, naming the token; it used to crash a step
    and abort every request batched with it."""
    from conftest import make_tokenizer, save_tiny_model

    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine

    tok = make_tokenizer()
    top = len(tok) - 1
    text = "hello " + tok.decode([top])
    assert top in tok(text)["input_ids"]
    path = save_tiny_model(tmp_path / "m", vocab_size=top)   # one id short
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off"))
    engine.add_request("good", "hello world", SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(RequestRejectedError, match=f"token id {top} .* outside the model's vocabulary"):
        engine.add_request("bad", text, SamplingParams(max_tokens=3))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(outs["good"].outputs[0].token_ids) == 3 and str(outs["good"].outputs[0].finish_reason) == "length"


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_an_interrupt_inside_add_request_leaves_no_orphan(tiny_llama_dir, monkeypatch, exc_type):
    """An exception or a KeyboardInterrupt (a signal handler) raised while a request's sequences are being added
    leaves nothing behind: the scheduler held a sequence the engine did not know, and every later step failed."""
    import plinth.core.engine as engine_module

    llm = LLM(str(tiny_llama_dir), dtype="float32", selection="off")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    real = engine_module.IncrementalDetokenizer
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:   # the second prompt's detokenizer
            raise exc_type("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", flaky)
    with pytest.raises(exc_type):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", real)
    assert not llm.engine.has_unfinished_requests()
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == before


def test_vllm_engine_option_names(tiny_llama_dir, caplog):
    """vLLM's ``distributed_executor_backend`` is plinth's ``distributed_executor``; ``swap_space`` and
    ``disable_log_stats`` (nothing to set here) are taken with a note; unknown names are still refused."""
    import logging

    from plinth.config import EngineConfig

    with caplog.at_level(logging.INFO, logger="plinth.config"):
        config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), distributed_executor_backend="mp", swap_space=4,
                                          disable_log_stats=True)
    assert config.parallel.distributed_executor == "mp"
    assert "swap_space=4 taken and not used" in caplog.text and "disable_log_stats=True" in caplog.text
    with pytest.raises(ConfigError, match="unknown engine option 'swap_spaces'"):
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), swap_spaces=4)


def test_truncate_prompt_tokens_offline(tiny_llama_dir):
    """vLLM's ``SamplingParams(truncate_prompt_tokens=N)``: the prompt's last N tokens only (the same output as
    giving those tokens), -1 as many as the context holds; more than the context is refused, naming the field."""
    llm = llm_for(tiny_llama_dir, max_model_len=32)
    ids = list(range(5, 45))   # longer than the context
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([ids], params.clone(truncate_prompt_tokens=6), use_tqdm=False)[0]
    tail = llm.generate([ids[-6:]], params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-6:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(RequestRejectedError, match="truncate_prompt_tokens is 33, more than max_model_len") as info:
        llm.generate([ids], params.clone(truncate_prompt_tokens=33), use_tqdm=False)
    assert info.value.param == "truncate_prompt_tokens"
    with pytest.raises(RequestRejectedError, match="leaves no room"):   # -1: the whole context, nothing after it
        llm.generate([ids], params.clone(truncate_prompt_tokens=-1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
