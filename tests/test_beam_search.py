"""``LLM.beam_search`` against the same beam search written directly on transformers' float64 log-probabilities
of the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from plinth import LLM, BeamSearchParams

PROMPTS = ["The quick brown fox", "Paris is the capital of", "0123"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", block_size=4, selection="off")


@pytest.fixture(scope="module")
def reference_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()


@torch.no_grad()
def reference(model, prompt: list[int], width: int, max_tokens: int, eos: set[int], length_penalty: float,
              ignore_eos: bool = False) -> list[tuple[list[int], float, str]]:
    """The module's algorithm on float64 log-probabilities: (tokens, cumulative logprob, finish), best first."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not live:
            break
        grown = []
        for tokens, cum in live:
            lps = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, -1], -1)
            top = torch.topk(lps, 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t in eos and not ignore_eos else grown).append((tokens + [t], cum + lp))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    beams = [(t, c, "stop") for t, c in done] + [(t, c, "length") for t, c in live]

    def score(beam):
        tokens, cum, finish = beam
        length = len(prompt) + len(tokens) - (1 if finish == "stop" else 0)
        return cum / length ** length_penalty

    return sorted(beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, max_tokens, length_penalty", [(1, 12, 1.0), (3, 10, 1.0), (4, 8, 0.0), (2, 8, 2.0)])
def test_beams_match_a_float64_reference(llm, reference_model, width, max_tokens, length_penalty):
    eos = set(llm.engine.eos_token_ids)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                     length_penalty=length_penalty))
    assert len(outs) == len(PROMPTS)
    for text, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == llm.engine.tokenize(text)
        want = reference(reference_model, out.prompt_token_ids, width, max_tokens, eos, length_penalty)
        assert [(b.token_ids, b.finish_reason) for b in out.sequences] == [(t, f) for t, _, f in want]
        for beam, (_, cum, _) in zip(out.sequences, want, strict=True):
            assert beam.cumulative_logprob == pytest.approx(cum, abs=1e-4)
            assert beam.text == llm.get_tokenizer().decode(beam.token_ids, skip_special_tokens=True)
        scores = [b.score for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
    # beam width 1 is greedy decoding
    if width == 1:
        greedy = llm.generate(PROMPTS, __import__("plinth").SamplingParams(temperature=0, max_tokens=max_tokens),
                              use_tqdm=False)
        assert [o.sequences[0].token_ids for o in outs] == [g.outputs[0].token_ids for g in greedy]


def test_ignore_eos_token_id_prompts_and_bad_parameters(llm, reference_model):
    ids = llm.engine.tokenize(PROMPTS[1])
    out = llm.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert len(out) == 1 and all(len(b.token_ids) == 6 and b.finish_reason == "length" for b in out[0].sequences)
    want = reference(reference_model, ids, 2, 6, set(llm.engine.eos_token_ids), 1.0, ignore_eos=True)
    assert [b.token_ids for b in out[0].sequences] == [t for t, _, _ in want]
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=11, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=True, max_tokens=4), dict(beam_width=2, max_tokens=4, length_penalty=float("nan"))):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)
    assert not llm.engine.has_unfinished_requests()


@torch.no_grad()
def test_beams_that_end_in_eos_are_complete(llm, reference_model):
    """A one-token prompt after which EOS is among the two most likely tokens: the beam ending there is
    complete (finish "stop", ranked without its EOS) and the result still equals the reference."""
    eos = llm.engine.eos_token_ids[0]
    vocab = reference_model.config.vocab_size
    starts = torch.arange(3, vocab).unsqueeze(1)
    logits = reference_model(starts).logits[:, -1]
    rank = (logits > logits[:, eos:eos + 1]).sum(-1)
    prompt = [int(starts[int(torch.argmin(rank))])]
    assert int(rank.min()) <= 1
    # no length penalty: the short complete beam keeps its lead over longer ones
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.0))[0]
    want = reference(reference_model, prompt, 2, 5, {eos}, 0.0)
    assert [(b.token_ids, b.finish_reason) for b in out.sequences] == [(t, f) for t, _, f in want]
    assert any(b.finish_reason == "stop" and b.token_ids[-1] == eos for b in out.sequences)


def test_score_counts_the_prompt_and_not_an_ending_eos():
    from plinth.entrypoints.beam_search import BeamSequence, score

    ended = BeamSequence([7, 8, 2], -3.0, finish_reason="stop")
    assert score(5, ended, (2,), 2.0) == pytest.approx(-3.0 / (5 + 3 - 1) ** 2)
    cut = BeamSequence([7, 8, 9], -3.0)
    assert score(5, cut, (2,), 1.0) == pytest.approx(-3.0 / 8)
    assert score(5, cut, (2,), 0.0) == -3.0
    # ignore_eos: an EOS that happens to end a beam is not counted either (as vLLM does)
    assert score(5, BeamSequence([7, 2], -1.0), (2,), 1.0) == pytest.approx(-1.0 / 6)


@pytest.mark.parametrize("length_penalty", [400.0, -400.0])
def test_extreme_length_penalty_ranks_without_overflow(llm, length_penalty):
    """``length ** length_penalty`` overflows (or underflows to 0) a float: the search still ends, ranks the beams
    by their true scores (compared in logarithms) and reports -0.0 / -inf."""
    from fractions import Fraction

    from plinth.entrypoints.beam_search import BeamSequence, rank_key, score

    short, long = BeamSequence([7, 8, 9], -3.0), BeamSequence([7, 8, 9, 4, 5], -3.5)
    exact = {b.cumulative_logprob: Fraction(b.cumulative_logprob) / Fraction(5 + len(b.token_ids)) ** int(length_penalty)
             for b in (short, long)}
    want = max((short, long), key=lambda b: exact[b.cumulative_logprob])
    got = max((short, long), key=lambda b: rank_key(5, b, (2,), length_penalty))
    assert got is want
    assert score(5, short, (2,), length_penalty) == (-0.0 if length_penalty > 0 else -math.inf)
    prompt = llm.engine.tokenize(PROMPTS[0])
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty))[0]
    assert len(out.sequences) == 3
    keys = [rank_key(len(prompt), b, tuple(llm.engine.eos_token_ids), length_penalty) for b in out.sequences]
    assert keys == sorted(keys, reverse=True)


def test_context_limit_array_prompts_and_wrong_parameters(tiny_llama_dir, llm):
    import numpy as np

    from plinth import SamplingParams
    from plinth.core.scheduler import RequestRejectedError

    short = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, selection="off", max_model_len=24)
    ids = short.engine.tokenize(PROMPTS[0])
    out = short.beam_search(np.array(ids), BeamSearchParams(beam_width=2, max_tokens=40, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    assert all(len(ids) + len(b.token_ids) == 24 and b.finish_reason == "length" for b in out.sequences)
    with pytest.raises(RequestRejectedError, match="prompt 1: 30 tokens leave no room"):
        short.beam_search([ids, [5] * 30], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="token ids"):
        short.beam_search([[5.5, 7.0]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not short.engine.has_unfinished_requests()
    short.close()
    # a KV cache of 40 tokens under a context of 512: the beams stop where the cache ends (each round's beams
    # are one-token requests, which the scheduler would refuse past it)
    small = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, selection="off", num_blocks=11)
    assert small.engine.max_sequence_len == 41 < small.engine.max_model_len
    prompt = list(range(10, 40))
    out = small.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))[0]
    assert all(len(prompt) + len(b.token_ids) == 41 and b.finish_reason == "length" for b in out.sequences)
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_usable_blocks
    small.close()
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty="1")


def test_server_use_beam_search(tiny_llama_dir, llm):
    """vLLM's use_beam_search on both routes: the n best beams, as LLM.beam_search finds them, in the metrics."""
    from server_utils import scrape_metrics
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                                                selection="off", served_model_name="tiny"))
    want = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        before = scrape_metrics("", http)
        r = http.post("/v1/completions", json={"prompt": PROMPTS[:2], "n": 3, "max_tokens": 6, "use_beam_search": True,
                                               "length_penalty": 0.5, "echo": True})
        assert r.status_code == 200, r.text
        # counted as one request per prompt: its prompt tokens once, the returned beams' tokens, the best beam's end
        after = scrape_metrics("", http)
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        assert delta["plinth_prompt_tokens_total"] == r.json()["usage"]["prompt_tokens"]
        assert delta["plinth_generation_tokens_total"] == r.json()["usage"]["completion_tokens"]
        assert sum(v for k, v in delta.items() if k.startswith("plinth_requests_finished_total")) == 2
        assert delta["plinth_e2e_request_latency_seconds_count"] == 2
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        assert [c["text"] for c in choices] == [p + b.text for p, o in zip(PROMPTS[:2], want, strict=True)
                                                for b in o.sequences]
        assert [c["finish_reason"] for c in choices] == [b.finish_reason for o in want for b in o.sequences]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                    "max_tokens": 5, "use_beam_search": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        # (the usage's shape as on the other routes)
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        ids = engine.tokenize(engine.render_chat([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
        beams = llm.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=5))[0].sequences
        assert [c["message"]["content"] for c in r.json()["choices"]] == [b.text for b in beams]
        for body, param in [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"n": 11}, "n"),
                            ({"guided_regex": "a+"}, "use_beam_search"), ({"length_penalty": "x"}, "length_penalty"),
                            ({"stop": [" the"]}, "stop"), ({"stop_token_ids": [5]}, "stop_token_ids"),
                            ({"min_tokens": 2}, "min_tokens"), ({"presence_penalty": 0.5}, "presence_penalty"),
                            ({"repetition_penalty": 1.2}, "repetition_penalty")]:
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "use_beam_search": True, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_width_bounded_by_the_engines_max_logprobs(tmp_path):
    from conftest import save_tiny_model

    from plinth import LLM, BeamSearchParams

    llm = LLM(str(save_tiny_model(tmp_path / "m")), dtype="float32", selection="off", max_logprobs=4)
    with pytest.raises(ValueError, match="beam_width must be at most 2 on this engine .*max_logprobs is 4"):
        llm.beam_search(["hello"], BeamSearchParams(beam_width=3, max_tokens=2))
    assert len(llm.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences) == 2


def test_server_width_bounded_by_max_logprobs(tmp_path):
    from conftest import save_tiny_model
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(save_tiny_model(tmp_path / "m")), dtype="float32",
                                                selection="off", max_logprobs=4))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "at most 2 on this server" in r.json()["error"]["message"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_server_beam_search_runs_at_the_request_priority(tiny_llama_dir, monkeypatch, policy):
    """``use_beam_search`` with a ``priority`` and a ``cache_salt``: every round's requests carry both (priority
    policy), and under first come, first served a nonzero priority is a 400, as for any request."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    seen = []
    add = LLMEngine.add_request

    def recording(self, request_id, prompt, params=None, arrival_time=None, priority=0, lora_request=None,
                  cache_salt=None, multi_modal_data=None, token_type_ids=None):
        seen.append((priority, cache_salt))
        return add(self, request_id, prompt, params, arrival_time, priority, lora_request, cache_salt,
                   multi_modal_data, token_type_ids)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off",
                                                served_model_name="tiny", scheduling_policy=policy))
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "n": 2, "use_beam_search": True, "priority": -4,
            "cache_salt": "s"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 3, "n": 2,
            "use_beam_search": True, "priority": -4, "cache_salt": "s"}
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        for route, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            r = http.post(route, json=request)
            if policy == "fcfs":
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            else:
                assert r.status_code == 200, r.text
    if policy == "priority":
        assert len(seen) >= 4 and set(seen) == {(-4, "s")}
