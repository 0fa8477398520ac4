"""Embedding models (``task="embed"``): pooled final hidden states against transformers running the same
weights, through chunked prefill, the prefix cache, tensor parallelism and the server's /v1/embeddings."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from conftest import save_tiny_model

from plinth import LLM, PoolingParams, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.core.scheduler import RequestRejectedError
from plinth.errors import ModelLoadError

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is the capital of Germany. Large language models",
    "0123",
    "Continuous batching keeps the accelerator busy while requests come and go, one token at a time.",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp(f"tiny-embed-{request.param}"), arch=request.param)


def reference(model_dir, ids: list[int], kind: str, normalize: bool) -> np.ndarray:
    """The pooled final-norm hidden states from transformers (float64 from the float32 model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    return (vector / vector.norm() if normalize else vector).numpy()


@pytest.mark.parametrize("kind, normalize", [("last", True), ("mean", True), ("cls", False), ("mean", False)])
def test_pooled_hidden_states_match_transformers(model_dir, kind, normalize):
    """Prompts of 3-30 tokens in one call, prefilled in chunks of at most 8 tokens next to each other."""
    llm = LLM(str(model_dir), dtype="float32", selection="off", task="embed", pooling=kind,
              normalize_embeddings=normalize, max_num_batched_tokens=8, block_size=4)
    assert (llm.engine.pooling.kind, llm.engine.pooling.normalize) == (kind, normalize)
    assert llm.engine.block_manager.enable_prefix_caching == (kind == "last")
    outs = llm.embed(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.engine.tokenize(prompt)
        assert out.finished and out.prompt_token_ids == ids
        got = np.array(out.outputs.embedding)
        assert got.shape == (64,)
        np.testing.assert_allclose(got, reference(model_dir, ids, kind, normalize), atol=2e-5, rtol=1e-4)


def normalized_references(model_dir, prompts: list[list[int]], kind: str) -> list[np.ndarray]:
    """transformers' pooled (``last`` or ``mean``) and normalized final hidden states of each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double()
            vector = hidden[-1] if kind == "last" else hidden.mean(0)
            refs.append((vector / vector.norm()).numpy())
    return refs


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_every_chunk_split(model_dir, kind):
    """Prompts of 1-13 tokens against step budgets of 1-9 tokens: a prompt's last chunk is often one token (the
    scheduler counts it among the decodes) or shares its step with other prompts' chunks."""
    prompts = [list(range(5, 5 + n)) for n in range(1, 14)]
    refs = normalized_references(model_dir, prompts, kind)
    for budget in (1, 2, 3, 5, 8, 9):
        llm = LLM(str(model_dir), dtype="float32", selection="off", task="embed", pooling=kind,
                  max_num_batched_tokens=budget, max_num_seqs=4, block_size=4)
        for out, ref in zip(llm.embed(prompts, use_tqdm=False), refs, strict=True):
            assert out.outputs is not None, (budget, len(out.prompt_token_ids))
            np.testing.assert_allclose(out.outputs.embedding, ref, atol=2e-5, err_msg=f"budget {budget}")


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_asynchronous_steps(model_dir, kind):
    """Embedding steps scheduled while the step before is in flight (its pooled rows read back one step late),
    through chunked prefill and preemption (few KV blocks): the same vectors as transformers'."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 100, size=n).tolist() for n in (13, 4, 11, 1, 9, 12, 6, 10)]
    refs = normalized_references(model_dir, prompts, kind)
    for blocks, budget in ((64, 5), (5, 8)):
        llm = LLM(str(model_dir), dtype="float32", selection="off", task="embed", pooling=kind,
                  max_num_batched_tokens=budget, max_num_seqs=4, block_size=4, num_blocks=blocks, async_scheduling=True)
        engine = llm.engine
        assert engine.async_scheduling
        launched: list[int] = []   # arguments of each launch (3: with pool ranges)
        engine.executor.launch = lambda *args, seen=launched, launch=engine.executor.launch: (
            seen.append(len(args)) or launch(*args))
        for out, ref in zip(llm.embed(prompts, use_tqdm=False), refs, strict=True):
            np.testing.assert_allclose(out.outputs.embedding, ref, atol=2e-5, err_msg=f"{blocks} blocks")
        assert 3 in launched and not engine._sync_groups   # (launched with pool ranges: no synchronous steps)
        if blocks == 5:
            assert engine.scheduler.stats().num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_mean_pooling_adds_each_position_once():
    """Rows of positions a request has already (a prefill recomputed after preemption, or rows of a step that was
    in flight when its next chunk was scheduled) are not counted twice."""
    from plinth.core.pooling import PoolState

    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    state = PoolState("mean", 10, PoolingParams())
    assert state.rows_wanted(0, 4) == (0, 4)
    state.add(0, rows[0:4])
    assert state.rows_wanted(0, 6) == (4, 6)   # recomputed from the start: only the new positions
    state.add(2, rows[2:7])                    # overlapping rows: positions 2-3 are skipped
    state.add(5, rows[5:7])                    # nothing new
    assert state.covered == 7 and state.vector is None
    state.add(7, rows[7:10])
    np.testing.assert_allclose(state.vector, rows.astype(np.float64).mean(0))


def test_one_token_steps_are_not_decode_graphs_on_workers():
    """A step whose every entry is one sampled token but which an embedding request needs the hidden states
    of: worker processes must not replay a decode graph for it either."""
    from plinth.distributed.messages import StepBatch
    from plinth.worker.batching import FlatBatch

    def flat(needs_hidden: bool) -> FlatBatch:
        return FlatBatch(token_ids=np.array([3, 4]), q_lens=np.array([1, 1]), starts=np.array([7, 9]),
                         block_tables=np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32),
                         block_counts=np.array([2, 3]), sample=np.array([True, True]),
                         decode_only=not needs_hidden, needs_hidden=needs_hidden)

    assert StepBatch.from_entries(flat(True)).flat().decode_only is False
    assert StepBatch.from_entries(flat(False)).flat().decode_only is True


def test_prefix_cache_dimensions_and_errors(model_dir):
    llm = LLM(str(model_dir), dtype="float32", selection="off", task="embed", block_size=4)
    first = llm.embed(PROMPTS[1])[0]
    # the same prompt again: all but its last token come from the cache, so its step computes one token
    # (never a replayed decode step, which keeps no hidden states)
    long_first = llm.embed(PROMPTS[3])[0]
    n = len(long_first.prompt_token_ids)
    assert n % 4 == 1   # n - 1 tokens fill whole blocks
    same = llm.embed(PROMPTS[3])[0]
    assert same.num_cached_tokens == n - 1
    np.testing.assert_allclose(same.outputs.embedding, long_first.outputs.embedding, atol=1e-6)
    # a cache_salt: only prompts of the same salt share blocks
    salted = [llm.embed({"prompt": PROMPTS[3], "cache_salt": "s"})[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in salted] == [0, n - 1]
    for out in salted:
        np.testing.assert_allclose(out.outputs.embedding, long_first.outputs.embedding, atol=1e-6)
    with pytest.raises(ValueError, match="LLM.score takes no 'cache_salt'"):
        llm.score({"prompt": PROMPTS[3], "cache_salt": "s"}, PROMPTS[1])
    again = llm.embed(PROMPTS[1] + " one token at a time")[0]   # shares the first prompt's blocks
    assert again.num_cached_tokens >= 8
    ids = llm.engine.tokenize(PROMPTS[1] + " one token at a time")
    np.testing.assert_allclose(again.outputs.embedding, reference(model_dir, ids, "last", True), atol=2e-5)
    # the first dimensions of the raw vector, normalized again; or not normalized at all
    raw = reference(model_dir, first.prompt_token_ids, "last", False)
    cut = llm.embed(PROMPTS[1], PoolingParams(dimensions=16))[0].outputs.embedding
    np.testing.assert_allclose(cut, raw[:16] / np.linalg.norm(raw[:16]), atol=2e-5)
    plain = llm.embed(PROMPTS[1], PoolingParams(normalize=False))[0].outputs.embedding
    np.testing.assert_allclose(plain, raw, atol=1e-4, rtol=1e-4)
    # one PoolingParams per prompt
    both = llm.embed([PROMPTS[1], PROMPTS[1]], [PoolingParams(dimensions=16), PoolingParams(normalize=False)])
    np.testing.assert_allclose(both[0].outputs.embedding, cut, atol=1e-6)
    np.testing.assert_allclose(both[1].outputs.embedding, plain, atol=1e-6)
    with pytest.raises(ValueError, match="got 1 pooling params for 2 prompts"):
        llm.embed([PROMPTS[1], PROMPTS[1]], [PoolingParams()])
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams .or one per prompt., got SamplingP"):
        llm.embed(PROMPTS[1], SamplingParams())
    with pytest.raises(RequestRejectedError, match="dimensions is 65, but this model's embeddings have 64"):
        llm.embed("x", PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(RequestRejectedError, match="use LLM.embed"):
        llm.generate(["hi"])
    with pytest.raises(RequestRejectedError, match="takes PoolingParams"):
        llm.engine.add_request("x", "hi", SamplingParams())
    with pytest.raises(ConfigError, match="need task='embed'"):
        EngineConfig.from_kwargs(pooling="mean")


def test_embed_needs_an_embedding_engine(tmp_path):
    llm = LLM(str(save_tiny_model(tmp_path / "m")), dtype="float32", selection="off")
    with pytest.raises(RequestRejectedError, match="task='embed'"):
        llm.embed("hi")
    with pytest.raises(RequestRejectedError, match="task='embed'"):
        llm.engine.add_request("x", "hi", PoolingParams())


def test_sentence_transformers_configuration(tmp_path):
    model = save_tiny_model(tmp_path / "st")
    (model / "1_Pooling").mkdir()
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    llm = LLM(str(model), dtype="float32", selection="off", task="embed")
    assert (llm.engine.pooling.kind, llm.engine.pooling.normalize) == ("mean", True)
    out = llm.embed(PROMPTS[0])[0]
    np.testing.assert_allclose(out.outputs.embedding, reference(model, out.prompt_token_ids, "mean", True), atol=2e-5)
    # the engine's options win over the files
    assert LLM(str(model), dtype="float32", selection="off", task="embed", pooling="last",
               normalize_embeddings=False).engine.pooling.kind == "last"
    modules = json.loads((model / "modules.json").read_text())
    (model / "modules.json").write_text(json.dumps(modules + [
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ModelLoadError, match="not sentence_transformers.models.Dense"):
        LLM(str(model), dtype="float32", selection="off", task="embed")


def test_tensor_parallel_embeddings_equal(tmp_path, processes):
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    model = save_tiny_model(tmp_path / "tp")
    # the CPU worker processes (a machine with one GPU has no second device for TP=2)
    one = LLM(str(model), dtype="float32", selection="off", task="embed", pooling="mean", platform="cpu").embed(PROMPTS)
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off", task="embed", pooling="mean",
                                      tensor_parallel_size=2, distributed_executor="mp", max_num_batched_tokens=8,
                                      platform="cpu")
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, PoolingParams())
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs.embedding
    finally:
        engine.shutdown()
    for i, out in enumerate(one):
        np.testing.assert_allclose(done[f"r{i}"], out.outputs.embedding, atol=1e-5)


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model = save_tiny_model(tmp_path_factory.mktemp("tiny-embed-server"))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off",
                                                served_model_name="tiny-embed", task="embed"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        yield client, engine, model


def test_server_embeddings(http):
    client, engine, model = http
    ids = engine.tokenize(PROMPTS[0])
    r = client.post("/v1/embeddings", json={"model": "tiny-embed", "input": [PROMPTS[0], PROMPTS[2]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    np.testing.assert_allclose(body["data"][0]["embedding"], reference(model, ids, "last", True), atol=2e-5)
    prompt_tokens = len(ids) + len(engine.tokenize(PROMPTS[2]))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    # token ids, base64 (little-endian float32), fewer dimensions, no normalization
    r = client.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64", "dimensions": 8,
                                            "normalize": False}).json()
    decoded = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, reference(model, ids, "last", False)[:8], atol=1e-4, rtol=1e-4)
    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "x", "dimensions": 999},
                                                                            "dimensions"),
                        ({"input": "x", "dimensions": True}, "dimensions"), ({"input": ["x"] * 3000}, "input"),
                        ({"input": [10**9]}, "input"), ({"input": "x", "model": "other"}, "model"),
                        ({"input": "x", "cache_salt": ""}, "cache_salt")):
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "use /v1/embeddings" in r.json()["error"]["message"]
    metrics = client.get("/metrics").text
    assert 'finish_reason="stop"' in metrics


def test_server_embeddings_of_a_conversation(http):
    """vLLM's chat-form pooling requests: ``messages`` rendered with the chat template (no assistant opening unless
    asked, no special tokens added by the tokenizer unless asked), in /v1/embeddings and /pooling."""
    client, engine, model = http
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    tokenizer = engine.tokenizer
    for extra, generation_prompt in (({}, False), ({"add_generation_prompt": True}, True)):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        r = client.post("/v1/embeddings", json={"messages": messages, "normalize": False, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], reference(model, ids, "last", False), atol=2e-5)
    pooled = client.post("/pooling", json={"messages": messages, "task": "token_embed"}).json()
    assert len(pooled["data"][0]["data"]) == len(tokenizer(tokenizer.apply_chat_template(
        messages, tokenize=False), add_special_tokens=False)["input_ids"])
    for body, param in (({"input": "x", "messages": messages}, "messages"), ({}, "input"),
                        ({"messages": []}, "messages"),
                        ({"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message")):
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_embeddings_route_on_a_generation_server(tmp_path):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(save_tiny_model(tmp_path / "g")), dtype="float32",
                                                selection="off"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]


def test_base_model_checkpoints(tmp_path):
    """A checkpoint of the base model (``architectures: ["LlamaModel"]``: no ``model.`` prefix, no LM head), as
    many embedding models ship: it runs as an embedding model, and refuses to generate."""
    import transformers
    from conftest import make_tokenizer

    tok = make_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    base = transformers.LlamaModel(config).eval()
    base.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = LLM(str(tmp_path), dtype="float32", selection="off", task="embed", pooling="mean")
    for prompt, out in zip(PROMPTS[:2], llm.embed(PROMPTS[:2]), strict=True):
        ids = llm.engine.tokenize(prompt)
        with torch.no_grad():
            hidden = base(torch.tensor([ids])).last_hidden_state[0].double().mean(0)
        np.testing.assert_allclose(out.outputs.embedding, (hidden / hidden.norm()).numpy(), atol=2e-5)
    with pytest.raises(ModelLoadError, match="base model without an LM head .*--task embed"):
        LLM(str(tmp_path), dtype="float32", selection="off")
    # Phi's head has a bias, which a base-model checkpoint (PhiModel) does not hold either; Gemma 3's text model's
    # causal LM is not named after it (Gemma3TextModel -> Gemma3ForCausalLM)
    small = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512)
    for name, base_model in (
            ("phi", transformers.PhiModel(transformers.PhiConfig(**small, eos_token_id=tok.eos_token_id))),
            ("gemma3", transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**small, num_key_value_heads=2,
                                                                                   head_dim=16, pad_token_id=0)))):
        folder = tmp_path / name
        base_model.eval().save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        out = LLM(str(folder), dtype="float32", selection="off", task="embed", pooling="mean").embed(PROMPTS[:1])[0]
        with torch.no_grad():
            hidden = base_model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].double().mean(0)
        np.testing.assert_allclose(out.outputs.embedding, (hidden / hidden.norm()).numpy(), atol=2e-5, err_msg=name)


def test_server_score_and_rerank(http):
    """``/v1/score`` and ``/v1/rerank`` (vLLM's, Jina's and Cohere's shapes) on an embedding server: cosine similarities
    of the embeddings transformers' hidden states give, one text against many or pairwise, texts or token ids;
    documents ordered by them, ``top_n``, documents returned or not; clear 400s; ``LLM.score`` alike."""
    client, engine, model = http
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    ids = [engine.tokenize(t) for t in texts]
    vec = [reference(model, i, "last", True).astype(np.float64) for i in ids]
    cos = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    r = client.post("/score", json={"model": "tiny-embed", "text_1": texts[0], "text_2": texts[1:]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
    np.testing.assert_allclose([d["score"] for d in body["data"]], [cos(vec[0], vec[1]), cos(vec[0], vec[2])],
                               atol=2e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    pairs = client.post("/v1/score", json={"text_1": [ids[1], ids[2]], "text_2": [ids[0], ids[1]]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [cos(vec[1], vec[0]), cos(vec[2], vec[1])],
                               atol=2e-5)
    r = client.post("/v1/rerank", json={"query": texts[0], "documents": texts, "top_n": 2}).json()
    want = sorted(range(3), key=lambda i: -cos(vec[0], vec[i]))[:2]
    assert [x["index"] for x in r["results"]] == want and r["results"][0]["document"] == {"text": texts[want[0]]}
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [cos(vec[0], vec[i]) for i in want],
                               atol=2e-5)
    assert r["usage"]["total_tokens"] == len(ids[0]) + sum(len(i) for i in ids)
    r = client.post("/v2/rerank", json={"query": texts[1], "documents": texts[:2], "return_documents": False}).json()
    assert len(r["results"]) == 2 and "document" not in r["results"][0]
    for top_n in (0, -1):   # vLLM's default top_n is 0: every document
        r = client.post("/v1/rerank", json={"query": texts[0], "documents": texts, "top_n": top_n})
        assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text
    for route, body, param in (("/v1/score", {"text_1": texts[:2], "text_2": texts}, "text_1"),
                               ("/v1/score", {"text_1": "x", "text_2": []}, "text_2"),
                               ("/v1/rerank", {"query": "x", "documents": []}, "documents"),
                               ("/v1/rerank", {"query": "", "documents": ["y"]}, "query")):
        r = client.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, body, r.text)


def test_score_refusals_name_the_field_of_the_refused_input(tmp_path):
    """An input the KV cache cannot hold (shorter than max_model_len, so only the engine refuses it) is a 400 naming
    the field it came in: ``text_1`` / ``query``, not the route's last field."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model = save_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off", task="embed",
                                                max_model_len=64, block_size=4, num_blocks=6))
    long_ids = list(range(5, 35))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        for route, body, param in (("/v1/score", {"text_1": long_ids, "text_2": [[7, 8]]}, "text_1"),
                                   ("/v1/score", {"text_1": [7, 8], "text_2": [[9], long_ids]}, "text_2"),
                                   ("/v1/rerank", {"query": long_ids, "documents": [[7, 8]]}, "query"),
                                   ("/v1/rerank", {"query": [7, 8], "documents": [long_ids]}, "documents"),
                                   ("/v1/embeddings", {"input": [[7, 8], long_ids]}, "input")):
            r = client.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
            assert "KV cache" in r.json()["error"]["message"]
        assert client.post("/v1/rerank", json={"query": [7, 8], "documents": [[9, 10]]}).status_code == 200


def test_llm_score_and_routes_on_a_generation_server(tmp_path):
    from starlette.testclient import TestClient

    import plinth
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path = save_tiny_model(tmp_path / "m")
    llm = plinth.LLM(str(path), task="embed", dtype="float32", selection="off")
    vec = [np.asarray(o.outputs.embedding, dtype=np.float64) for o in llm.embed(PROMPTS[:3], use_tqdm=False)]
    got = llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False)   # vLLM's ScoringRequestOutput: outputs.score
    np.testing.assert_allclose([o.outputs.score for o in got], [float(vec[0] @ vec[i]) for i in (1, 2)], atol=1e-6)
    ids = [llm.engine.tokenize(p) for p in PROMPTS[:3]]
    assert [o.prompt_token_ids for o in got] == [ids[0] + ids[1], ids[0] + ids[2]] and all(o.finished for o in got)
    pairs = llm.score(PROMPTS[1:3], PROMPTS[:2], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in pairs], [float(vec[1] @ vec[0]), float(vec[2] @ vec[1])],
                               atol=1e-6)
    with pytest.raises(ValueError, match="text_1 holds 2 prompts and text_2 3"):
        llm.score(PROMPTS[:2], PROMPTS[:3])
    with pytest.raises(ValueError, match="must not be empty"):
        llm.score(PROMPTS[0], [])
    assert llm.score(PROMPTS[0], PROMPTS[0], use_tqdm=False)[0].outputs.score <= 1.0
    llm.close()
    from plinth.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        for route, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/v1/rerank", {"query": "a",
                                                                                            "documents": ["b"]})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and f"{route} needs an embedding model" in r.json()["error"]["message"]


def test_an_input_may_fill_the_context_and_refusals_name_the_routes_fields(tmp_path):
    """An input of exactly max_model_len tokens embeds (nothing comes after it), offline and served, as transformers
    pools it; one token more is refused naming the route's own field, never max_tokens or prompt."""
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model = save_tiny_model(tmp_path / "m")
    ids = list(range(5, 37))   # 32 tokens
    llm = LLM(str(model), dtype="float32", selection="off", task="embed", max_model_len=32, block_size=4)
    got = np.array(llm.embed([ids])[0].outputs.embedding)
    np.testing.assert_allclose(got, reference(model, ids, "last", True), atol=2e-5, rtol=1e-4)
    with pytest.raises(RequestRejectedError, match="longer than max_model_len"):
        llm.embed([ids + [5]])
    del llm
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off", task="embed",
                                                max_model_len=32, block_size=4, max_num_seqs=2,
                                                max_waiting_requests=2))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        body = client.post("/v1/embeddings", json={"input": ids}).json()
        np.testing.assert_allclose(body["data"][0]["embedding"], got, atol=1e-5)
        for route, request, param in (("/v1/embeddings", {"input": ids + [5]}, "input"),
                                      ("/v1/embeddings", {"input": [ids[:3]] * 5}, "input"),
                                      ("/v1/score", {"text_1": "a", "text_2": ["b", "c", "d", "e", "f"]}, "text_2"),
                                      ("/v1/rerank", {"query": "a", "documents": ["b", "c", "d", "e", "f"]},
                                       "documents")):
            error = client.post(route, json=request).json()["error"]
            assert error["param"] == param and "max_tokens" not in error["message"], (route, error)
            assert "lower n" not in error["message"] and "prompt" not in error["message"], (route, error)


def test_embedding_truncate_prompt_tokens(tmp_path):
    """``PoolingParams(truncate_prompt_tokens=N)`` (vLLM's): the input's last N tokens are embedded."""
    path = save_tiny_model(tmp_path / "m")
    llm = LLM(str(path), task="embed", dtype="float32", selection="off", max_model_len=64)
    ids = list(range(5, 30))
    cut = llm.embed([ids], PoolingParams(truncate_prompt_tokens=7), use_tqdm=False)[0]
    tail = llm.embed([ids[-7:]], use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-7:]
    np.testing.assert_allclose(cut.outputs.embedding, tail.outputs.embedding, atol=1e-6)
    keyword = llm.embed([ids], use_tqdm=False, truncate_prompt_tokens=7)[0]   # vLLM's keyword of embed
    assert keyword.prompt_token_ids == ids[-7:] and keyword.outputs.embedding == cut.outputs.embedding
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be at least 1"):
        PoolingParams(truncate_prompt_tokens=0)
    llm.close()
