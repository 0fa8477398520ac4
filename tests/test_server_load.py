"""Load on a real ``plinth serve`` process: 64 concurrent streams, then clients that vanish mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import make_tiny_model, running_server, scrape_metrics

pytestmark = pytest.mark.server

NUM_PROMPTS = 16
NUM_CLIENTS = 64
MAX_TOKENS = 24
PROMPTS = [f"Request number {i}: the quick brown fox" for i in range(NUM_PROMPTS)]
FINISHED = "plinth_requests_finished_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model: Path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-load"))
    args = [str(model), "--selection", "off", "--served-model-name", "tiny", "--max-num-seqs", "64",
            "--no-access-log"]
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def solo(server) -> list[tuple[str, int]]:
    """Each prompt's greedy text and completion tokens, run alone."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = []
    for p in PROMPTS:
        resp = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        out.append((resp.choices[0].text, resp.usage.completion_tokens))
    return out


def finished_total(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith(FINISHED + "{"))


def test_concurrent_streams_match_solo_runs_and_metrics_add_up(server, solo):
    before = scrape_metrics(server.base_url)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None, object]:
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % NUM_PROMPTS], max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return i, text, finish, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    assert time.monotonic() - t0 < 90
    for i, text, finish, usage in results:
        solo_text, solo_tokens = solo[i % NUM_PROMPTS]
        assert text == solo_text, f"client {i}"
        assert finish in ("length", "stop")
        assert usage.completion_tokens == solo_tokens
    after = scrape_metrics(server.base_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert finished_total(after) - finished_total(before) == NUM_CLIENTS
    assert delta[f"{FINISHED}{{finish_reason=abort}}"] == 0 and delta[f"{FINISHED}{{finish_reason=error}}"] == 0
    assert delta[f"{FINISHED}{{finish_reason=length}}"] == sum(r[2] == "length" for r in results)
    assert delta["plinth_generation_tokens_total"] == sum(r[3].completion_tokens for r in results)
    assert delta["plinth_prompt_tokens_total"] == sum(r[3].prompt_tokens for r in results)
    assert delta["plinth_time_to_first_token_seconds_count"] == NUM_CLIENTS
    assert delta["plinth_e2e_request_latency_seconds_count"] == NUM_CLIENTS
    # one per token after the first, also when the first output read holds several tokens
    assert delta["plinth_inter_token_latency_seconds_count"] == sum(r[3].completion_tokens - 1 for r in results)
    assert after["plinth_num_requests_running"] == 0 and after["plinth_num_requests_waiting"] == 0
    assert after["plinth_kv_cache_usage_ratio"] == 0.0
    assert 0.0 < after["plinth_prefix_cache_hit_rate"] <= 1.0   # 4 clients per prompt share cached blocks
    # per-request sizes and queue times, and the engine's totals as counters (vLLM's names under plinth_)
    assert delta["plinth_request_prompt_tokens_count"] == delta["plinth_request_generation_tokens_count"] == \
        delta["plinth_request_queue_time_seconds_count"] == NUM_CLIENTS
    assert delta["plinth_request_prompt_tokens_sum"] == delta["plinth_prompt_tokens_total"]
    assert delta["plinth_request_generation_tokens_sum"] == delta["plinth_generation_tokens_total"]
    assert delta["plinth_prefix_cache_queries_total"] == delta["plinth_prompt_tokens_total"]   # each admitted once
    assert 0 < delta["plinth_prefix_cache_hits_total"] < delta["plinth_prefix_cache_queries_total"]
    assert "plinth_num_preemptions_total" in after   # (its value: tests/test_server.py -k preemptions_and_first)


def test_disconnected_streams_free_their_blocks(server, solo):
    idle = scrape_metrics(server.base_url)
    assert idle["plinth_num_requests_running"] == 0
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True, "stream": True}

    async def leave_early(http: httpx.AsyncClient, ready: list[int], go: asyncio.Event) -> int:
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    seen += 1
                    if seen == 3:
                        ready.append(1)
                        await go.wait()   # hold the stream open until the busy state is measured
                        break
        return seen   # leaving the block closes the connection mid-stream

    async def run_all() -> tuple[list[int], dict[str, float]]:
        ready: list[int] = []
        go = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            tasks = [asyncio.create_task(leave_early(http, ready, go)) for _ in range(20)]
            while len(ready) < 20 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(timeout=10) as probe:
                busy = (await probe.get(f"{server.base_url}/metrics")).text
            go.set()
            return list(await asyncio.gather(*tasks)), busy

    seen, busy_text = asyncio.run(run_all())
    busy = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in busy_text.splitlines()
            if line.startswith(("plinth_num_requests_running", "plinth_kv_cache_usage_ratio"))}
    assert busy["plinth_num_requests_running"] == 20
    assert busy["plinth_kv_cache_usage_ratio"] > idle["plinth_kv_cache_usage_ratio"]
    assert seen == [3] * 20
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = scrape_metrics(server.base_url)
        if m[f"{FINISHED}{{finish_reason=abort}}"] - idle[f"{FINISHED}{{finish_reason=abort}}"] == 20:
            break
        time.sleep(0.1)
    assert m[f"{FINISHED}{{finish_reason=abort}}"] - idle[f"{FINISHED}{{finish_reason=abort}}"] == 20
    # the engine counts the aborts on its next loop iteration; give the gauge that long
    while time.monotonic() < deadline and m["plinth_kv_cache_usage_ratio"] != idle["plinth_kv_cache_usage_ratio"]:
        time.sleep(0.1)
        m = scrape_metrics(server.base_url)
    assert m["plinth_kv_cache_usage_ratio"] == idle["plinth_kv_cache_usage_ratio"]
    assert m["plinth_num_requests_running"] == 0 and m["plinth_num_requests_waiting"] == 0
    assert m["plinth_generation_tokens_total"] - idle["plinth_generation_tokens_total"] < 20 * 3000 // 2
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    again = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert again.choices[0].text == solo[1][0]


def test_tokens_that_arrive_with_the_first_get_inter_token_observations():
    """A first output read with several tokens (the reader fell behind) counts the time to its first token and one
    inter-token observation per later token, spread over the engine's time between its first and latest token."""
    from plinth.core.request import CompletionOutput, RequestMetrics, RequestOutput
    from plinth.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    tracker = metrics.request()
    timing = RequestMetrics(first_token_time=10.0, last_token_time=10.4)

    def output(tokens: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", tokens, finish_reason="length" if finished
                                                                   else None)], finished, metrics=timing)

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m"})

    tracker.observe(output([5, 6, 7]))
    assert value("plinth_time_to_first_token_seconds_count") == 1
    assert value("plinth_inter_token_latency_seconds_count") == 2
    assert value("plinth_inter_token_latency_seconds_sum") == pytest.approx(0.4)
    tracker.observe(output([5, 6, 7, 8, 9], finished=True))
    tracker.close()
    assert value("plinth_inter_token_latency_seconds_count") == 4
    assert value("plinth_generation_tokens_total") == 5
