"""Sleep mode (``enable_sleep_mode``): ``sleep()`` frees the KV cache (and on accelerators the weights), requests
are refused while asleep, and ``wake_up()`` gives back an engine whose outputs equal those before the sleep."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file
from test_weight_update import PROMPTS, run, same  # (greedy tokens, logprobs, cached tokens)

from plinth import LLM, SamplingParams
from plinth.errors import EngineSleepingError, SleepModeError
from plinth.worker.sleep import OffloadedTensors, device_storages

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _plain_weights(monkeypatch):
    monkeypatch.setenv("PLINTH_CPU_PACKED", "0")   # weights update_weights() can take (the CPU path's plain ones)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


def llm_for(path, **kw):
    # (the CPU's sleep: the KV cache only; the GPU's is tested below)
    kw = {"dtype": "float32", "selection": "off", "block_size": 4, "enable_sleep_mode": True, "platform": "cpu", **kw}
    return LLM(str(path), **kw)


def test_sleep_frees_the_kv_cache_and_waking_gives_the_same_outputs(models):
    a, _ = models
    llm = llm_for(a)
    runner = llm.engine.executor.runner
    want = run(llm)
    assert runner.graphs is not None   # the CPU decode plan, which holds the cache's addresses
    for _ in range(2):   # twice: a woken engine sleeps again
        caches = [weakref.ref(c) for c in runner.kv_caches]
        plan = weakref.ref(runner.graphs)
        assert not llm.is_sleeping()
        llm.sleep()
        gc.collect()
        assert llm.is_sleeping() and runner.kv_caches == [] and runner.graphs is None
        assert all(c() is None for c in caches) and plan() is None   # nothing holds the old cache any more
        with pytest.raises(EngineSleepingError, match=r"asleep: wake_up\(\) first"):
            run(llm)
        assert not llm.engine.has_unfinished_requests()   # the refused prompts left nothing queued
        llm.wake_up()
        assert not llm.is_sleeping() and runner.graphs is not None and len(runner.kv_caches) == 2
        got = run(llm)
        same(got, want)
        assert got[2] == [0, 0, 0]   # the prefix cache was forgotten with the cache's contents


def test_weights_woken_first_take_an_update(models):
    """vLLM's reinforcement-learning order: sleep, wake the weights, load new ones, wake the KV cache."""
    a, b = models
    want_b = run(llm_for(b))
    llm = llm_for(a)
    run(llm)
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError, match="weights are asleep"):
        llm.update_weights(b)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()   # the KV cache sleeps on
    assert llm.update_weights(b) == len(load_file(str(b / "model.safetensors")))
    with pytest.raises(EngineSleepingError):
        run(llm)
    llm.wake_up(["kv_cache"])
    same(run(llm), want_b)


def test_misuse_is_a_clear_error(models):
    a, _ = models
    with pytest.raises(SleepModeError, match="enable_sleep_mode=True"):
        llm_for(a, enable_sleep_mode=False).sleep()
    llm = llm_for(a)
    want = run(llm)
    for level in (0, 3, True, "1"):
        with pytest.raises(SleepModeError, match="sleep level must be 1"):
            llm.sleep(level)
    with pytest.raises(SleepModeError, match="on a CPU they are in host memory"):
        llm.sleep(level=2)
    engine = llm.engine
    engine.add_request("running", PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(SleepModeError, match=r"1 unfinished request\(s\)"):
        llm.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    llm.wake_up()   # awake: nothing to do
    llm.sleep()
    with pytest.raises(SleepModeError, match="asleep already"):
        llm.sleep()
    for tags in (["bogus"], [], ["weights", "kv"]):
        with pytest.raises(SleepModeError, match="wake_up tags must be among weights, kv_cache"):
            llm.wake_up(tags)
    assert llm.is_sleeping()
    llm.wake_up("kv_cache")   # one tag as a string
    llm.wake_up()
    same(run(llm), want)


def test_offloading_keeps_each_tensor_and_its_views():
    """The weights' mechanism (accelerators; here on CPU tensors): every storage the model reaches is freed and
    comes back under the same tensors, views included; level 2 zeroes the parameters and keeps the rest."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    model.register_buffer("table", torch.randn(5, 3))
    head = model[0]
    head.weight_view = head.weight[:4]   # a tensor attribute viewing a parameter
    head.extra = {"copy": torch.randn(7)}   # a tensor in a container
    values = {id(t): t.clone() for t in (head.weight, head.bias, model[1].weight, model.table, head.extra["copy"])}
    cpu = torch.device("cpu")
    found = device_storages(model, cpu)
    assert len(found) == 6 and sum(is_param for _, is_param in found) == 4   # the view shares its weight's storage
    for discard in (False, True):
        tensors = [head.weight, head.bias, model[1].weight, model.table, head.extra["copy"]]
        offloaded = OffloadedTensors(model, cpu, discard_parameters=discard)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert offloaded.host_bytes == (offloaded.nbytes - sum(t.numel() * 4 for t in model.parameters())
                                        if discard else offloaded.nbytes)
        offloaded.restore()
        for t in tensors:
            kept = values[id(t)]
            is_param = any(t is p for p in model.parameters())
            assert torch.equal(t, torch.zeros_like(kept) if discard and is_param else kept)
        assert head.weight_view.data_ptr() == head.weight.data_ptr()   # the view follows its weight
        assert tensors[0] is head.weight
    # scratch storages (a model's recurrent state) are freed with no host copy and come back as zeros
    scratch = frozenset({head.extra["copy"].untyped_storage().data_ptr()})
    offloaded = OffloadedTensors(model, cpu, discard_parameters=False, scratch=scratch)
    assert head.extra["copy"].untyped_storage().nbytes() == 0
    assert offloaded.host_bytes == offloaded.nbytes - 7 * 4
    offloaded.restore()
    assert torch.equal(head.extra["copy"], torch.zeros(7)) and torch.equal(model.table, values[id(model.table)])


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_every_rank_sleeps_and_wakes(models, processes, layout):
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    a, b = models
    want_a, want_b = run(llm_for(a)), run(llm_for(b))
    config = EngineConfig.from_kwargs(model=str(a), dtype="float32", selection="off", block_size=4,
                                      distributed_executor="mp", platform="cpu", enable_sleep_mode=True, **layout)
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    llm = LLM.__new__(LLM)   # an LLM over this engine (its executor on the shared worker processes)
    llm.engine, llm._ids, llm._lock = engine, iter(range(10**6)), threading.RLock()
    try:
        same(run(llm), want_a, atol=1e-4)
        llm.sleep()
        with pytest.raises(EngineSleepingError):
            run(llm)
        llm.wake_up(["weights"])
        llm.update_weights(b)
        llm.wake_up()
        same(run(llm), want_b, atol=1e-4)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_server_routes(models, enabled):
    """``plinth serve --enable-sleep-mode``: ``POST /sleep``, ``POST /wake_up`` (``tags``), ``GET /is_sleeping``
    (vLLM's routes); requests to a sleeping server are 503s; without the flag the routes are 404s."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    a, _ = models
    want = run(llm_for(a), PROMPTS[:1])
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 0}
    key = {"Authorization": "Bearer secret"}
    with TestClient(build_app(AsyncLLMEngine(llm_for(a, enable_sleep_mode=enabled).engine), api_key="secret",
                              allow_weight_updates=True), headers=key) as http:
        def tokens():
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        assert tokens() == want[0][0]
        if not enabled:
            for method, route in (("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")):
                assert getattr(http, method)(route).status_code == 404
            return
        assert http.post("/sleep", headers={"Authorization": ""}).status_code == 401   # the API key guards it
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        r = http.post("/sleep", params={"level": 5})
        assert r.status_code == 400 and "sleep level must be 1" in r.json()["error"]["message"], r.text
        r = http.post("/sleep")
        assert r.status_code == 200 and r.json() == {"status": "ok", "is_sleeping": True}, r.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping", r.text
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and "wake_up() first" in r.json()["error"]["message"], r.text
        r = http.post("/wake_up", params={"tags": "bogus"})
        assert r.status_code == 400 and "wake_up tags" in r.json()["error"]["message"], r.text
        r = http.post("/update_weights", json={"path": str(a)})   # the weights sleep: wake them first
        assert r.status_code == 409 and "wake_up?tags=weights" in r.json()["error"]["message"], r.text
        r = http.post("/wake_up", params={"tags": "weights"})
        assert r.status_code == 200 and r.json() == {"status": "ok", "is_sleeping": True}, r.text
        r = http.post("/update_weights", json={"path": str(a)})   # (the same weights: the outputs stay)
        assert r.status_code == 200, r.text
        r = http.post("/wake_up")
        assert r.status_code == 200 and r.json() == {"status": "ok", "is_sleeping": False}, r.text
        assert tokens() == want[0][0]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("level", [1, 2])
def test_the_gpu_gives_its_memory_back(models, level):
    """On CUDA, with its decode graphs: the weights' and the KV cache's memory is freed (level 1 keeps the weights
    in host memory, level 2 discards them and takes an update); the woken engine's outputs equal the first ones."""
    a, _ = models
    llm = LLM(str(a), dtype="float32", block_size=16, enable_sleep_mode=True, num_blocks=2048)
    runner = llm.engine.executor.runner
    want = run(llm)
    assert runner.graphs is not None
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_cache_bytes
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm.sleep(level=level)
    after = torch.cuda.memory_allocated()
    assert before - after >= weights + kv, (before, after, weights, kv)
    llm.wake_up()
    assert type(runner.graphs).__name__ == "DecodeGraphRunner"
    if level == 2:
        with pytest.raises(EngineSleepingError, match="discarded by sleep"):
            run(llm)
        llm.update_weights(a)
    same(run(llm), want)


def test_a_sleep_that_fails_leaves_the_engine_awake(models, monkeypatch):
    """The weights are offloaded before anything is freed: when that fails (no host memory to pin, say) the engine
    is as it was (here an accelerator's path, its offload failing, on the CPU)."""
    import plinth.worker.sleep as sleep_module

    a, _ = models
    llm = llm_for(a)
    want = run(llm)
    runner = llm.engine.executor.runner

    def no_memory(*args, **kwargs):
        raise MemoryError("no host memory to pin")

    monkeypatch.setattr(sleep_module, "OffloadedTensors", no_memory)
    monkeypatch.setattr(runner, "device", torch.device("meta"))   # (an accelerator: its weights are offloaded)
    with pytest.raises(MemoryError):
        llm.sleep()
    monkeypatch.undo()
    assert not llm.is_sleeping() and not runner.asleep and len(runner.kv_caches) == 2
    assert run(llm)[0] == want[0]


def test_weights_discarded_stay_discarded_until_an_update(models):
    """A level-2 sleep's discarded weights (the flag as it leaves it: level 2 itself needs an accelerator) are not
    forgotten by a later level-1 sleep: requests are refused until update_weights."""
    a, _ = models
    llm = llm_for(a)
    want = run(llm)
    llm.engine._weights_discarded = True   # as after sleep(level=2) and wake_up() on a GPU
    llm.sleep(level=1)
    llm.wake_up()
    with pytest.raises(EngineSleepingError, match="discarded by sleep"):
        run(llm)
    llm.update_weights(a)
    same(run(llm), want)


def test_the_async_front_faults_the_new_cache_in_after_waking(models):
    """Under the server's loop the woken CPU KV cache is faulted in while idle, as at start."""
    import asyncio
    import time

    from plinth.core.async_engine import AsyncLLMEngine

    a, _ = models
    engine = llm_for(a).engine
    runner = engine.executor.runner
    front = AsyncLLMEngine(engine)

    async def main():
        await front.sleep()
        await front.wake_up()
        deadline = time.monotonic() + 10
        while runner.prefaulter is not None and not runner.prefaulter.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    prefaulter = runner.prefaulter
    assert prefaulter is not None and (prefaulter.populated_bytes > 0 or prefaulter.done)


def test_a_beam_search_between_its_rounds_keeps_the_engine_awake(models):
    """A beam search's rounds are engine requests one after another: a sleep asked between two rounds is refused
    (as while requests run), and the search finishes."""
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.entrypoints.beam_search import BeamSearchParams, beam_search_async

    a, _ = models
    front = AsyncLLMEngine(llm_for(a).engine)
    generate = front.generate
    refusals = []

    async def generate_after_trying_to_sleep(request_id, *args, **kwargs):
        if not request_id.endswith("-0-0"):   # between two rounds (nothing runs in the engine before this one)
            try:
                await front.sleep()
            except SleepModeError as exc:
                refusals.append(str(exc))
        async for out in generate(request_id, *args, **kwargs):
            yield out

    front.generate = generate_after_trying_to_sleep

    async def main():
        return await beam_search_async(front, "beam", [[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                                      ignore_eos=True))

    try:
        out = asyncio.run(main())
    finally:
        front.shutdown()
    assert len(out[0].sequences) == 2 and all(len(s.token_ids) == 4 for s in out[0].sequences)
    assert refusals and all("beam search(es) running" in r for r in refusals)
