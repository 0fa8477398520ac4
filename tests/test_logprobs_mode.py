"""logprobs_mode (vLLM's option): logprobs as the model's distribution or the one each token was drawn from, as
log-probabilities or logits; checked against transformers' logits on the same weights, processed in float64."""

from __future__ import annotations

import math

import pytest
import torch

from plinth import LLM, SamplingParams
from plinth.config import ConfigError, EngineConfig

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is"]


def llm_for(path, mode: str, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, selection="off", logprobs_mode=mode, **kw)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """float64 logits of every position of ``ids`` ([len(ids), V])."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def processed(logits: torch.Tensor, seen: set[int], p: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, by the definitions: repetition penalty over prompt and output tokens,
    then (random rows) temperature, top-k (ties kept), top-p (the smallest most likely set reaching top_p)."""
    x = logits.clone()
    if p.repetition_penalty != 1.0:
        for t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    if p.temperature == 0:
        return x
    x = x / p.temperature
    if 0 < p.top_k < len(x):
        x[x < torch.topk(x, p.top_k).values[-1]] = -math.inf
    if p.top_p < 1:
        probs = x.softmax(-1)
        order = probs.argsort(descending=True)
        above = probs[order].cumsum(0) - probs[order]   # the mass of the tokens more likely than each
        drop = order[above >= p.top_p]
        x[drop] = -math.inf
    return x


CASES = {
    "sampled-top-k": SamplingParams(temperature=0.7, top_k=3, seed=3, max_tokens=10, ignore_eos=True, logprobs=5),
    "sampled-top-p": SamplingParams(temperature=0.8, top_p=0.03, seed=4, max_tokens=10, ignore_eos=True, logprobs=5),
    "greedy-penalty": SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True,
                                     logprobs=5),
}


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_each_mode_against_transformers(tiny_llama_dir, hf, mode):
    """Every position's chosen token and top 5, in one batch of three kinds of rows, equal the float64 values
    computed from transformers' logits by the mode's definition (dropped tokens at -inf)."""
    llm = llm_for(tiny_llama_dir, mode)
    names = list(CASES)
    outs = llm.generate([PROMPTS[i % 2] for i in range(len(names))], [CASES[n] for n in names], use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        params, completion = CASES[name], out.outputs[0]
        ids = list(out.prompt_token_ids) + completion.token_ids
        logits = hf_logits(hf, ids)
        for i, (token, pos) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            at = len(out.prompt_token_ids) + i - 1
            values = logits[at] if mode.startswith("raw") else processed(logits[at], set(ids[:at + 1]), params)
            if mode.endswith("logprobs"):
                values = values.log_softmax(-1)
            assert pos[token].logprob == pytest.approx(values[token].item(), abs=2e-4), (name, i)
            top = sorted(((lp.logprob, t) for t, lp in pos.items() if lp.rank is not None and lp.rank <= 5),
                         reverse=True)
            want = values.topk(5).values.tolist()
            assert [v for v, _ in top][:5] == pytest.approx(want, abs=2e-4), (name, i)
        if mode.startswith("processed") and name != "greedy-penalty":
            assert any(lp.logprob == -math.inf for pos in completion.logprobs for lp in pos.values()), \
                "no dropped token among the top 5: the filters were not exercised"


def test_prompt_logprobs_are_the_models(tiny_llama_dir, hf):
    """Prompt positions report the model's own values: logits in the logits modes, else log-probabilities."""
    for mode, as_logits in (("processed_logits", True), ("processed_logprobs", False)):
        out = llm_for(tiny_llama_dir, mode).generate(PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=3),
                                                      use_tqdm=False)[0]
        ids = list(out.prompt_token_ids)
        logits = hf_logits(hf, ids)
        for i in range(1, len(ids)):
            values = logits[i - 1] if as_logits else logits[i - 1].log_softmax(-1)
            assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(values[ids[i]].item(), abs=2e-4)


def test_speculative_decoding_keeps_the_processed_logprobs(tiny_llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    prompt = "0123456789 0123456789 0123456789 01"
    params = SamplingParams(temperature=0.5, top_k=10, seed=9, max_tokens=24, ignore_eos=True, logprobs=3)
    a = llm_for(tiny_llama_dir, "processed_logprobs", speculative_config=spec)
    b = llm_for(tiny_llama_dir, "processed_logprobs")
    x, y = (m.generate(prompt, params, use_tqdm=False)[0].outputs[0] for m in (a, b))
    assert x.token_ids == y.token_ids
    for p, q in zip(x.logprobs, y.logprobs, strict=True):
        assert p.keys() == q.keys()
        assert [p[t].logprob for t in p] == pytest.approx([q[t].logprob for t in p], abs=1e-4)
    assert a.engine.stats()["speculative"]["num_accepted_tokens"] > 0


def test_refusals_and_the_flag(tiny_llama_dir):
    import argparse

    from plinth import BeamSearchParams
    from plinth.entrypoints.engine_args import add_engine_args, engine_kwargs

    with pytest.raises(ConfigError, match="logprobs_mode must be one of raw_logprobs, raw_logits, processed_logprobs"):
        EngineConfig.from_kwargs(logprobs_mode="logits")
    parser = argparse.ArgumentParser()
    add_engine_args(parser, "serve")
    assert engine_kwargs(parser.parse_args(["--logprobs-mode", "processed_logits"]))["logprobs_mode"] == \
        "processed_logits"
    with pytest.raises(ValueError, match="beam search ranks beams by log-probabilities"):
        llm_for(tiny_llama_dir, "raw_logits").beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=3))


def test_server_writes_dropped_tokens_as_a_floor(tiny_llama_dir):
    """JSON has no -inf: a dropped token's logprob is -9999.0 (as vLLM's server); beam search is refused on a
    logits-mode server."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    def client(mode):
        engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off",
                                                    served_model_name="tiny", logprobs_mode=mode))
        return TestClient(build_app(AsyncLLMEngine(engine)))

    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.5, "top_k": 2, "seed": 1, "ignore_eos": True}
    with client("processed_logprobs") as c:
        got = c.post("/v1/completions", json={**body, "prompt": PROMPTS[0], "logprobs": 4})
        assert got.status_code == 200
        tops = got.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert all(sorted(t.values()).count(-9999.0) == 2 for t in tops), tops
        chat = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}],
                                                    "logprobs": True, "top_logprobs": 4})
        assert chat.status_code == 200
        assert [t["logprob"] for t in chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]][2:] == \
            [-9999.0, -9999.0]
    with client("raw_logits") as c:
        beams = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 2,
                                                 "use_beam_search": True})
        assert beams.status_code == 400 and "this server's logprobs are logits" in beams.json()["error"]["message"]
