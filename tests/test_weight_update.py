"""``update_weights``: new values loaded into a running engine's model in place (reinforcement-learning weight
sync), compared with an engine started on those weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file, save_file

from plinth import LLM, SamplingParams
from plinth.errors import ModelLoadError

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123"]
PLAIN = {"PLINTH_CPU_PACKED": "0"}   # the CPU path's plain weights (repacked ones cannot take new values)


@pytest.fixture(autouse=True)
def _plain_weights(monkeypatch):
    for name, value in PLAIN.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two random Llamas of one shape (different seeds), and a third with the first's weights but the second's
    layer 0 (a partial update's expected result)."""
    root = tmp_path_factory.mktemp("weights")
    a, b = save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)
    mixed = root / "mixed"
    import shutil

    shutil.copytree(a, mixed)
    state = load_file(str(a / "model.safetensors"))
    layer0 = {k: v for k, v in load_file(str(b / "model.safetensors")).items() if k.startswith("model.layers.0.")}
    save_file({**state, **layer0}, str(mixed / "model.safetensors"))
    return a, b, mixed, layer0


def run(llm, prompts=PROMPTS):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs],
            [o.num_cached_tokens for o in outs])


def same(got, want, atol=1e-5):
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        assert max(abs(x - y) for x, y in zip(g, w, strict=True)) < atol


def llm_for(path, **kw):
    return LLM(str(path), dtype="float32", selection="off", block_size=4, **kw)


def test_new_weights_give_the_outputs_of_an_engine_started_on_them(models):
    """Every weight from a checkpoint path, a state dict, ``(name, tensor)`` pairs; some weights (one layer); the
    prefix cache forgotten (or kept on request); outputs equal to an engine started on the weights."""
    a, b, mixed, layer0 = models
    want_a, want_b, want_mixed = run(llm_for(a)), run(llm_for(b)), run(llm_for(mixed))
    assert want_a[0] != want_b[0] and want_mixed[0] not in (want_a[0], want_b[0])
    llm = llm_for(a)
    same(run(llm), want_a)
    assert llm.update_weights(b) == len(load_file(str(b / "model.safetensors")))   # a checkpoint directory
    got = run(llm)
    same(got, want_b)
    assert got[2] == [0, 0, 0]   # the prompts' cached blocks were computed with the old weights: forgotten
    llm.update_weights(load_file(str(a / "model.safetensors")))   # a state dict
    same(run(llm), want_a)
    assert llm.update_weights(list(layer0.items())) == len(layer0)   # some weights: (name, tensor) pairs
    same(run(llm), want_mixed)
    llm.update_weights(str(b / "model.safetensors"), reset_prefix_cache=False)   # one file; the cache kept
    assert sum(run(llm)[2]) > 0   # (the old weights' KV reused, as asked)
    llm.reset_prefix_cache()
    same(run(llm), want_b)
    # bfloat16 tensors into a float32 model are widened, as at load time
    half = {k: v.to(torch.bfloat16) for k, v in load_file(str(a / "model.safetensors")).items()}
    llm.update_weights(half)
    widened = llm_for(a)
    widened.update_weights({k: v.float() for k, v in half.items()})
    same(run(llm), run(widened))


def test_blocks_of_requests_running_during_an_update_are_never_reused(models):
    """An update while a request runs: that request goes on, and no later request reuses the KV blocks computed
    with the old weights, also those the running request held."""
    a, b, _, _ = models
    want_b = run(llm_for(b))
    llm = llm_for(a)
    engine = llm.engine
    engine.add_request("running", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.step()
    engine.step()
    llm.update_weights(b)
    while engine.has_unfinished_requests():
        engine.step()
    got = run(llm)
    same(got, want_b)
    assert got[2] == [0, 0, 0]


def test_bad_updates_are_clear_errors_that_write_nothing(models):
    a, b, _, _ = models
    llm = llm_for(a)
    before = run(llm)
    new = load_file(str(b / "model.safetensors"))
    norm = "model.layers.1.input_layernorm.weight"
    for weights, match in (
        ({**new, "model.layers.0.nonexistent.weight": new[norm]}, "has no matching parameter"),
        ({**new, norm: new[norm].to(torch.int32)}, "unsupported dtype int32"),
        ({**new, norm: new[norm][:-1]}, "shape mismatch"),
        # a fused projection's shard and the embedding: their loaders' shape checks run before anything is written
        ({**new, "model.layers.1.self_attn.k_proj.weight": new["model.layers.1.self_attn.k_proj.weight"][:-1]},
         "shape mismatch"),
        ({**new, "model.embed_tokens.weight": new["model.embed_tokens.weight"][:, :-1]}, "shape mismatch"),
        ({**new, "model.layers.7.mlp.up_proj.weight": new["model.layers.1.mlp.up_proj.weight"]},
         "has no matching parameter"),
        (new[norm], "must be a mapping of names to tensors"),
        ([("x",)], r"\(name, tensor\) pairs"),
        (a / "nothing-here", "not a safetensors file or a directory"),
    ):
        with pytest.raises(ModelLoadError, match=match):
            llm.update_weights(weights)
        same(run(llm), before)   # nothing was written
    assert llm.update_weights({}) == 0


@pytest.mark.parametrize("case", ["quantized", "cpu-packed", "gguf-blocks"])
def test_weights_held_converted_are_refused(models, monkeypatch, tmp_path, case):
    """Weights converted at load (quantized, the CPU path's repacked or GGUF-block copies) are refused, nothing
    written."""
    a, b, _, _ = models
    if case == "quantized":
        llm = llm_for(a, quantization="fp8")
        match = r"runs quantized \(fp8\)"
    elif case == "gguf-blocks":
        pytest.importorskip("gguf")
        from test_startup_cache import write_small_gguf

        llm = LLM(write_small_gguf(tmp_path / "m.gguf"), dtype="bfloat16", selection="off")
        if not any(getattr(getattr(m, "linear_method", None), "int4", None) is not None
                   for m in llm.engine.executor.runner.model.modules()):
            pytest.skip("this CPU multiplies no 4-bit copy of a GGUF file's blocks")
        match = "the GGUF file's quantized blocks"
        b = {"model.norm.weight": torch.ones(llm.engine.executor.runner.model.model.norm.weight.shape)}
    else:
        monkeypatch.delenv("PLINTH_CPU_PACKED")
        llm = LLM(str(a), dtype="bfloat16", selection="off", block_size=4)   # (oneDNN packs bfloat16 weights)
        if not any(type(getattr(m, "linear_method", None)).__name__ == "CpuLinearMethod"
                   for m in llm.engine.executor.runner.model.modules()):
            pytest.skip("this CPU has no packed bfloat16 GEMM")
        match = "PLINTH_CPU_PACKED=0"
    before = run(llm)
    with pytest.raises(ModelLoadError, match=match):
        llm.update_weights(b)
    same(run(llm), before)


def test_a_classifier_is_refused_and_a_base_model_checkpoint_is_renamed(tmp_path):
    """A sequence classifier's label weights live in the engine: refused. A base-model checkpoint (no ``model.``
    prefix, an embedding model) given as a path is renamed as at load time."""
    import numpy as np
    import transformers
    from conftest import make_tokenizer
    from test_classification import save_classifier

    save_classifier(tmp_path / "cls")
    classifier = LLM(str(tmp_path / "cls"), task="classify", dtype="float32", selection="off")
    with pytest.raises(ModelLoadError, match="a classifier's label weights are read into the engine"):
        classifier.update_weights(tmp_path / "cls")
    tok = make_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    for seed, name in ((0, "base-a"), (1, "base-b")):
        torch.manual_seed(seed)
        transformers.LlamaModel(config).eval().save_pretrained(tmp_path / name, safe_serialization=True)
        tok.save_pretrained(tmp_path / name)
    want = [o.outputs.embedding for o in LLM(str(tmp_path / "base-b"), dtype="float32", selection="off",
                                              task="embed", pooling="mean").embed(PROMPTS, use_tqdm=False)]
    llm = LLM(str(tmp_path / "base-a"), dtype="float32", selection="off", task="embed", pooling="mean")
    assert llm.update_weights(tmp_path / "base-b") == 20
    got = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_tied_embeddings_follow_the_new_token_embedding(tmp_path):
    """A model whose LM head is its token embedding: the new embedding is the new head too."""
    a = save_tiny_model(tmp_path / "a", arch="qwen3", seed=0, tie_word_embeddings=True)
    b = save_tiny_model(tmp_path / "b", arch="qwen3", seed=2, tie_word_embeddings=True)
    want = run(llm_for(b))
    llm = llm_for(a)
    llm.update_weights(b)
    same(run(llm), want)


def test_the_async_front_updates_between_steps(models):
    from plinth.core.async_engine import AsyncLLMEngine

    a, b, _, _ = models
    want = run(llm_for(b), PROMPTS[:1])
    front = AsyncLLMEngine(llm_for(a).engine)

    async def main():
        assert await front.update_weights(b) > 0
        final = None
        async for out in front.generate("r", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                                         ignore_eos=True)):
            final = out
        with pytest.raises(ModelLoadError, match="has no matching parameter"):
            await front.update_weights({"nothing": torch.zeros(1)})
        return final.outputs[0].token_ids

    try:
        assert asyncio.run(main()) == want[0][0]
    finally:
        front.shutdown()


@pytest.fixture(scope="module")
def processes():
    """Worker processes started with the plain CPU weights (their environment is fixed when they start)."""
    from plinth.distributed.executor_mp import WorkerProcesses

    with pytest.MonkeyPatch.context() as env:
        for name, value in PLAIN.items():
            env.setenv(name, value)
        procs = WorkerProcesses(2, timeout_s=120.0)
    yield procs
    procs.stop()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_every_rank_takes_its_part(models, processes, layout):
    """Tensor parallel (each rank its shard of a whole tensor) and pipeline parallel (each stage its layers)."""
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    a, b, mixed, layer0 = models
    want_b, want_mixed = run(llm_for(b)), run(llm_for(mixed))
    config = EngineConfig.from_kwargs(model=str(a), dtype="float32", selection="off", block_size=4,
                                      distributed_executor="mp", platform="cpu", **layout)
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    llm = LLM.__new__(LLM)   # an LLM over this engine (its executor on the shared worker processes)
    llm.engine, llm._ids, llm._lock = engine, iter(range(10**6)), __import__("threading").RLock()
    try:
        llm.update_weights(b)
        same(run(llm), want_b, atol=1e-4)
        llm.update_weights(mixed)
        llm.update_weights(layer0)
        same(run(llm), want_mixed, atol=1e-4)
        # a bad tensor among good ones (every rank checks before any writes), a layer no stage holds
        new = load_file(str(b / "model.safetensors"))
        for bad in ({**new, "model.layers.1.self_attn.nonexistent.weight": torch.zeros(4)},
                    {**new, "model.layers.5.self_attn.q_proj.weight": new["model.layers.1.self_attn.q_proj.weight"]}):
            with pytest.raises(ModelLoadError, match="has no matching parameter"):
                llm.update_weights(bad)
            same(run(llm), want_mixed, atol=1e-4)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_server_routes(models, enabled):
    """``plinth serve --enable-weight-updates``: ``POST /update_weights`` loads a checkpoint from the server's disk
    (a bad one is a 400 naming ``path``, nothing written), ``POST /reset_prefix_cache`` forgets the cache; without
    the flag both are 404s."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    a, b, _, _ = models
    want_a, want_b = run(llm_for(a), PROMPTS[:1]), run(llm_for(b), PROMPTS[:1])
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    key = {"Authorization": "Bearer secret"}
    with TestClient(build_app(AsyncLLMEngine(llm_for(a).engine), api_key="secret",
                              allow_weight_updates=enabled), headers=key) as http:
        def tokens():
            r = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        assert tokens() == want_a[0][0]
        for route in ("/update_weights", "/reset_prefix_cache"):   # the API key guards them as every route
            assert http.post(route, json={"path": str(b)}, headers={"Authorization": ""}).status_code == 401
        r = http.post("/update_weights", json={"path": str(b)})
        if not enabled:
            assert r.status_code == 404 and "--enable-weight-updates" in r.json()["error"]["message"]
            assert http.post("/reset_prefix_cache").status_code == 404
            assert tokens() == want_a[0][0]
            return
        assert r.status_code == 200 and r.json() == {"status": "ok", "tensors": 21}, r.text
        assert tokens() == want_b[0][0]
        for bad in ({"path": str(a / "nothing-here")}, {"path": str(a / "config.json")}, {"path": 5}, {}):
            r = http.post("/update_weights", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "path", (bad, r.text)
        assert tokens() == want_b[0][0]
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"status": "ok", "reset": True}
