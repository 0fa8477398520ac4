"""Speculative decoding (n-gram prompt lookup): drafts verified in one step change no token a request gets.

The reference is the same engine without speculation: greedy requests, seeded random requests (each position's
noise is keyed by its output index), penalties, logprobs, stop strings and tokens, ``n > 1``, LoRA adapters,
preemption, the prefix cache and tensor/pipeline parallelism all give identical tokens, while the statistics
show that drafts were accepted (so the checks are not vacuous)."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from plinth import LLM, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.core.speculative import NgramProposer, accepted_tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# repetitive prompts (their continuations repeat too, so prompt lookup finds drafts), and a plain one
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "0123456789 0123456789 0123456789 01",
    "Paris is the capital of France, and Berlin is",
    "Large language models generate text one token at a time. Large language models generate",
]


# ------------------------------------------------------------------------------------ the proposer


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix n-gram (max_n .. min_n) and the <= k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposer_against_brute_force():
    rng = random.Random(0)
    for case in range(2000):
        tokens = [rng.randrange(rng.choice((2, 3, 5, 50))) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k, limit = rng.randint(1, 6), rng.randint(0, 7)
        got = NgramProposer(k, min_n, max_n).propose(tokens, limit)
        assert got == _brute_force(tokens, min(k, limit), min_n, max_n), (case, tokens, min_n, max_n, k, limit)


def test_ngram_proposer_follows_a_growing_sequence():
    """The per-request buffer mirrors the tokens as they grow (and is rebuilt when they shrink)."""
    from plinth.core.request import Request

    rng = random.Random(1)
    proposer = NgramProposer(4, 1, 3)
    req = Request("r", [rng.randrange(4) for _ in range(5)], SamplingParams())
    for step in range(300):
        if step == 150:
            req.truncate_output(10)
        for _ in range(rng.randint(1, 5)):
            req.append_output_token(rng.randrange(4))
        assert proposer.propose_for(req, 4) == _brute_force(req.all_token_ids, 4, 1, 3)


def test_ngram_proposer_cases():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2]      # 3-gram "1 2 3" seen at the start
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]          # the limit caps it
    assert p.propose([7, 8, 9, 7, 5, 9, 7], 10) == [5, 9, 7]      # "9 7" at 2..3: the latest 2-gram wins over "7"
    assert p.propose([1, 2, 3], 10) == []                         # nothing repeats
    assert NgramProposer(3, 2, 3).propose([5, 1, 6, 1], 10) == []   # only a 1-gram repeats, below min_n
    assert p.propose([4, 4], 10) == [4]                           # the continuation stops at the end


def test_accepted_tokens():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]   # every draft, then the bonus sample
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]         # the first differing sample replaces a draft
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accepted_tokens([], [3]) == [3]


# ------------------------------------------------------------------------------------ configuration


def test_speculative_config_parsing_and_errors():
    spec = EngineConfig.from_kwargs(speculative_config=NGRAM).speculative
    assert (spec.speculative_method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 4, 2, 4)
    text = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                                       '"prompt_lookup_max": 1}').speculative
    assert (text.num_speculative_tokens, text.prompt_lookup_min, text.prompt_lookup_max) == (2, 1, 1)
    assert not EngineConfig.from_kwargs(speculative_config=None).speculative.enabled
    for value, message in [
        ("{not json", "not valid JSON"),
        ([1], "must be a JSON object"),
        ({"num_speculative_tokens": 3}, "needs a method"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "must be one of ngram"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 100}, "at most 64"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(speculative_config=value)
    with pytest.raises(ConfigError, match="embedding model"):
        EngineConfig.from_kwargs(task="embed", speculative_config=NGRAM)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from plinth.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "generate")
    args = parser.parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config_from_args(args).speculative.num_speculative_tokens == 3
    with pytest.raises(ConfigError, match="unknown speculative_config key"):
        engine_config_from_args(parser.parse_args(["m", "--speculative-config", '{"method": "ngram", "k": 1}']))


# ------------------------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec-llama"))


def _llm(model_dir, spec, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("selection", "off")
    return LLM(str(model_dir), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def base(model_dir):
    return _llm(model_dir, None)


@pytest.fixture(scope="module", params=["rows", "query"])
def pair(request, model_dir, base):
    """The engine without speculation, and one with: its drafts as one-token rows of a decode batch (the CPU's
    way), or as a query of several tokens sampled at each position (the way of GPU backends whose decode kernel
    writes each row's keys itself)."""
    spec = _llm(model_dir, NGRAM)
    spec.engine._batch_builder.drafts_as_rows = request.param == "rows"
    return base, spec


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _accepted(llm) -> int:
    return llm.engine.stats()["speculative"]["num_accepted_tokens"]


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.1, seed=11),
    dict(temperature=0.15, top_p=0.9, top_k=20, min_p=0.02, seed=3),
    dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.05, presence_penalty=0.02),
    dict(temperature=0.1, seed=5, presence_penalty=0.05, logit_bias={17: 2.0}),
    dict(temperature=0.0, bad_words=["fox"]),
], ids=["greedy", "seeded", "seeded-top-p-k-min-p", "penalties", "seeded-penalty-bias", "bad-words"])
def test_same_tokens_as_without_speculation(pair, params):
    base, spec = pair
    sp = SamplingParams(max_tokens=48, ignore_eos=True, **params)
    before = _accepted(spec)
    assert _run(spec, PROMPTS, sp) == _run(base, PROMPTS, sp)
    assert _accepted(spec) > before, "no draft was accepted: the comparison did not exercise verification"


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_accepted_drafts_counted_up_to_a_stop_among_them(model_dir, base, stop_at):
    """Drafts that all verify, with a stop token among them: the accepted count is the drafts kept (up to and with
    the stop token), not one fewer as if the last token kept were the step's own sample."""
    refs = [o.outputs[0].token_ids for o in base.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                    ignore_eos=True), use_tqdm=False)]
    prompt, ref = next((p, r) for p, r in zip(PROMPTS, refs, strict=True) if len(set(r[:4])) == 4)
    spec = _llm(model_dir, {"method": "ngram", "num_speculative_tokens": 3})
    sched = spec.engine.scheduler
    sched.proposer = lambda req, limit: list(ref[req.num_output_tokens:req.num_output_tokens + min(limit, 3)])
    out = spec.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[ref[stop_at]]), use_tqdm=False)[0].outputs[0]
    assert ref[stop_at] not in ref[:stop_at], "the stop token must first appear where it is put"
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
    stats = spec.engine.stats()["speculative"]
    # the prompt's step samples the first token; the next step verifies 3 drafts and keeps them up to the stop
    assert (stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (3, stop_at)
    spec.close()

def test_stop_conditions_inside_a_verified_step(pair, monkeypatch):
    """Stop strings, stop tokens, min_tokens and max_tokens that fall among a step's accepted tokens end the output
    exactly where they end it without speculation (text, tokens, finish and stop reasons)."""
    from plinth.core.request import Request

    base, spec = pair
    cuts = []
    truncate = Request.truncate_output
    monkeypatch.setattr(Request, "truncate_output", lambda self, n: (cuts.append(n), truncate(self, n)))
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    # a stop string met first in the output can fall inside a step's accepted tokens when the drafts are copied
    # from the prompt
    prompts = _looped(base, PROMPTS)
    cases, at_limit = [], []
    for prompt, outs in zip(prompts, _run(base, prompts, SamplingParams(**greedy)), strict=True):
        ids, text = outs[0][0], outs[0][1]
        # (the random model's text is mostly partial UTF-8 bytes: stop strings from its printable pairs)
        for stop in sorted({text[k:k + 2] for k in range(len(text) - 1) if text[k:k + 2].isprintable()
                            and "\ufffd" not in text[k:k + 2]})[:6]:
            for include in (False, True):
                cases.append((prompt, SamplingParams(**greedy, stop=[stop], include_stop_str_in_output=include)))
            cut = _run(base, [prompt], SamplingParams(**greedy, stop=[stop]))[0][0]
            if cut[2] == "stop" and not at_limit:   # the token completing it is the last one allowed
                at_limit.append((prompt, SamplingParams(**dict(greedy, max_tokens=len(cut[0])), stop=[stop])))
        cases.append((prompt, SamplingParams(**greedy, stop_token_ids=[ids[9]])))
        cases.append((prompt, SamplingParams(**greedy, stop_token_ids=[ids[3]], min_tokens=7)))
        cases.append((prompt, SamplingParams(**dict(greedy, max_tokens=13))))
    reasons = set()
    for prompt, sp in cases + at_limit:
        got, want = _run(spec, [prompt], sp), _run(base, [prompt], sp)
        assert got == want, (prompt, sp)
        reasons |= {(c[0][2], c[0][3] is not None) for c in want}
    assert at_limit and all(_run(spec, [p], sp)[0][0][2:] == ("stop", sp.stop[0]) for p, sp in at_limit)
    assert reasons == {("stop", True), ("length", False)}   # stop strings and ids, and lengths, were reached
    assert cuts, "no stop string fell inside a step's accepted tokens"


def test_logprobs_and_n(pair):
    base, spec = pair
    sp = SamplingParams(max_tokens=30, temperature=0.9, seed=7, n=2, logprobs=3, ignore_eos=True)
    got = spec.generate(PROMPTS[:2], sp, use_tqdm=False)
    want = base.generate(PROMPTS[:2], sp, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert len(a.logprobs) == len(a.token_ids)
            for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                for t in pa:
                    assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)
                    assert pa[t].rank == pb[t].rank
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_budget_preemption_and_prefix_cache(model_dir):
    """A small token budget (drafts cut to fit), a small KV cache (preemption, never caused by drafts) and the
    prefix cache (only verified tokens' blocks are registered) give the tokens of the same engine without drafts."""
    kw = dict(max_num_batched_tokens=16, block_size=4, num_blocks=40, max_num_seqs=8)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 2
    base, spec = _llm(model_dir, None, **kw), _llm(model_dir, NGRAM, **kw)
    want = _run(base, prompts, sp)
    assert _run(spec, prompts, sp) == want
    stats = spec.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["speculative"]["num_accepted_tokens"] > 0
    # the same prompts again, same tokens; the last one once more alone: its prompt's head is still cached
    assert _run(spec, prompts, sp) == want
    hits = spec.engine.stats()["prefix_cache"]["hit_blocks"]
    assert _run(spec, prompts[-1:], sp) == want[-1:]
    assert spec.engine.stats()["prefix_cache"]["hit_blocks"] > hits


def _looped(base, prompts):
    """Prompts followed by their own greedy continuation (as token ids): the model goes on repeating it, so drafts
    copied from the prompt are accepted."""
    outs = base.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [{"prompt_token_ids": base.engine.tokenize(p) + list(o.outputs[0].token_ids)}
            for p, o in zip(prompts, outs, strict=True)]


def test_structured_output_requests_decode_without_drafts(pair):
    """Requests with a grammar decode without drafts, also in steps where their neighbours carry drafts (their text
    then goes through the verified steps' path: it must end as it ends alone)."""
    base, spec = pair
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = _looped(base, PROMPTS[:2]) + PROMPTS[2:]
    for constraint in ({"json": schema}, {"choice": ["yes", "no", "maybe"]}, {"regex": "[a-c]{3}"}):
        params = [greedy, greedy] + [SamplingParams(max_tokens=30, temperature=0.0,
                                                    structured_outputs=constraint)] * 2
        before = _accepted(spec)
        got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
               for o in spec.generate(prompts, params, use_tqdm=False)]
        want = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in base.generate(prompts, params, use_tqdm=False)]
        assert got == want, constraint
        assert _accepted(spec) > before


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(tmp_path, arch):
    model = save_tiny_model(tmp_path / arch, arch=arch)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    spec = _llm(model, {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1})
    assert _run(spec, PROMPTS, sp) == _run(_llm(model, None), PROMPTS, sp)
    assert _accepted(spec) > 0


def test_lora_adapters(tmp_path):
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from plinth import LoRARequest

    model = save_tiny_model(tmp_path / "m")
    lora = LoRARequest("a", 1, str(make_adapter(model, tmp_path / "a", 5)))
    kw = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    picks = [lora, None, lora, None]
    base, spec = _llm(model, None, **kw), _llm(model, NGRAM, **kw)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, sp, lora_request=picks, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, sp, lora_request=picks, use_tqdm=False)]
    assert got == want
    assert _accepted(spec) > 0


def test_tensor_and_pipeline_parallel(tmp_path, processes):
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    model = save_tiny_model(tmp_path / "m", num_key_value_heads=1)
    # the CPU platform (gloo) on any machine: two ranks need no second GPU
    kw = dict(model=str(model), dtype="float32", selection="off", max_num_batched_tokens=32, block_size=4,
              platform="cpu")
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(PROMPTS, sp, use_tqdm=False)]
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        engine = LLMEngine(EngineConfig.from_kwargs(**kw, **layout, distributed_executor="mp",
                                                    speculative_config=NGRAM),
                           executor_factory=lambda c: MultiprocExecutor(c, processes))
        try:
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"r{i}", prompt, sp)
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
            assert engine.stats()["speculative"]["num_accepted_tokens"] > 0
        finally:
            engine.shutdown()
        assert [done[f"r{i}"] for i in range(len(PROMPTS))] == want, layout


def test_async_scheduling_is_turned_off(model_dir, caplog):
    with caplog.at_level("WARNING"):
        llm = _llm(model_dir, NGRAM, async_scheduling=True)
    assert not llm.engine.async_scheduling
    assert "asynchronous scheduling is off with speculative decoding" in caplog.text


@pytest.mark.slow
def test_default_model_edit_prompt(monkeypatch):
    """The default model (GGUF, the CPU decode plan) asked to repeat code with an edit: most drafts are accepted and
    the tokens are those of the engine without speculation."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from spec_decode import EDITS, LISTING

    # float32 and one request: in bfloat16 a step's row count changes the GEMMs' rounding, which can flip a near
    # tie between two tokens (as any change of batch shape can; one such flip was seen here at a 0.03 logprob gap).
    # And no 8-bit decode inputs (on by default for a float32 GGUF model): with them the two engines'
    # log-probabilities at the fifth token of this prompt differ by ~0.05, enough to swap its two best tokens
    # (0.06-0.09 apart), although the rows that verify drafts take the same 8-bit GEMMs, quantized per row. Not
    # traced; likely float32 summation-order differences (one row's keys are split over the threads, five rows' are
    # not) tipping some inputs' 8-bit rounding. With float32 rows the engines agree to ~1e-6.
    monkeypatch.setenv("PLINTH_CPU_INT8_ACT", "0")
    base, spec = LLM(dtype="float32"), LLM(dtype="float32", speculative_config=NGRAM)
    messages = [[{"role": "user", "content": f"Here is some Python code:\n\n```python\n{LISTING}```\n\n{EDITS[0]} "
                                             "Reply with the complete code only."}]]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.chat(messages, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat(messages, sp, use_tqdm=False)]
    assert got == want
    stats = spec.engine.stats()["speculative"]
    assert stats["acceptance_rate"] > 0.4 and stats["mean_accepted_length"] > 2.0, stats


def test_server_with_speculation(tmp_path):
    """``plinth serve --speculative-config``: completions equal those of a server without it, and /metrics counts
    the drafts; a bad value stops the server at start with the reason."""
    import subprocess
    import sys

    import httpx
    from server_utils import running_server, scrape_metrics

    model = save_tiny_model(tmp_path / "m")
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    texts = []
    for extra in ([], ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']):
        with running_server([str(model), "--selection", "off", "--dtype", "float32", *extra]) as srv:
            reply = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60.0).json()
            texts.append(reply["choices"][0]["text"])
            metrics = scrape_metrics(srv.base_url)
    assert texts[0] == texts[1]
    assert metrics["plinth_spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["plinth_spec_decode_num_accepted_tokens_total"] <= metrics[
        "plinth_spec_decode_num_draft_tokens_total"]
    bad = subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", "serve", str(model), "--speculative-config",
                          '{"method": "medusa", "num_speculative_tokens": 2}'], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0
    assert "must be one of ngram" in bad.stderr and "Traceback" not in bad.stderr


def test_drafts_leave_the_blocks_later_decodes_need():
    """Speculation never preempts: a decode's drafts may not take the last free block when a decode after it in
    the same step needs that block for its own token (the drafts are cut to what fits without it)."""
    from test_scheduler import make_scheduler, req

    for drafting in (False, True):
        sched = make_scheduler(num_blocks=5, block_size=4, budget=64, prefix_caching=False)
        if drafting:
            sched.proposer = lambda r, limit: [7, 7, 7][:limit] if r.request_id == "a" else []
        sched.add_request(req("a", [1, 2, 3]))                  # its first decode fits its block
        sched.add_request(req("b", [1, 2, 3, 4, 5, 6, 7, 8]))   # its first decode needs a new block
        sched.update_from_output(sched.schedule(), [9, 9])
        assert sched.block_manager.num_free_blocks == 1
        out = sched.schedule()
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
        assert not out.preempted_request_ids and sched.num_preemptions == 0
    # with a block to spare, the drafts take it
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    sched.proposer = lambda r, limit: [7, 7, 7][:limit] if r.request_id == "a" else []
    sched.add_request(req("a", [1, 2, 3]))
    sched.add_request(req("b", [1, 2, 3, 4, 5, 6, 7, 8]))
    sched.update_from_output(sched.schedule(), [9, 9])
    out = sched.schedule()
    assert [(s.request.request_id, s.num_drafts) for s in out.scheduled] == [("a", 3), ("b", 0)]


def test_scheduler_limits_drafts():
    """Drafts fit the decode-row cap, the token budget and the request's max_tokens; a step with drafts rolls the
    computed tokens back to the accepted ones and keeps the blocks."""
    from test_scheduler import make_scheduler, req

    sched = make_scheduler(budget=12, block_size=4)
    sched.proposer = lambda r, limit: [7] * min(limit, 5)
    sched.max_decode_rows = 6
    reqs = [req(f"r{i}", [1, 2, 3], max_tokens=4) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()   # the prompts
    sched.update_from_output(out, [9] * 3)
    out = sched.schedule()
    drafts = [s.num_drafts for s in out.scheduled]
    assert sum(drafts) == 3 and sum(drafts) + len(drafts) <= 6   # the cap: 6 rows for 3 decodes
    assert all(d <= 2 for d in drafts)   # max_tokens 4, one output token: at most 2 drafts before the limit
    blocks = [list(s.request.block_ids) for s in out.scheduled]
    # the first request accepts one draft of its two; the others none
    tokens = [[7, 8] if s.num_drafts == 2 else [5] for s in out.scheduled]
    sched.update_from_output(out, [t if s.num_drafts else t[0] for s, t in zip(out.scheduled, tokens, strict=True)])
    for s, t, b in zip(out.scheduled, tokens, blocks, strict=True):
        r = s.request
        assert r.output_token_ids == [9, *t] and r.num_computed_tokens == 3 + len(t) and r.block_ids == b
        assert r.draft_token_ids == []
