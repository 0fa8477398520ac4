"""Sequence classifiers (``task="classify"``): label probabilities, cross-encoder scores and their routes, against
transformers' ``*ForSequenceClassification`` running the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import decisive_weights, make_tokenizer
from engine_driving import drive
from safetensors.torch import load_file, save_file

from plinth import LLM, ClassificationRequestOutput, PoolingParams, SamplingParams
from plinth.config import EngineConfig
from plinth.core.scheduler import RequestRejectedError
from plinth.errors import ModelLoadError

PROMPTS = ["The cat sat on the mat.", "hello world", "a", "Paris is the capital of France and a large city."]
ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
         "mistral": (transformers.MistralConfig, transformers.MistralForSequenceClassification)}


def save_classifier(path, arch: str = "qwen3", num_labels: int = 3, seed: int = 0, **overrides):
    """A small random sequence classifier of a real architecture, with the tiny tokenizer; returns the
    transformers model (float32, eval) for references."""
    tokenizer = make_tokenizer()
    config_cls, model_cls = ARCHS[arch]
    labels = {i: f"label_{chr(97 + i)}" for i in range(num_labels)}
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        pad_token_id=tokenizer.pad_token_id, num_labels=num_labels, id2label=labels,
                        label2id={v: k for k, v in labels.items()}, **overrides)
    torch.manual_seed(seed)
    model = decisive_weights(model_cls(config).eval())
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_probabilities_match_transformers(tmp_path, arch):
    model = save_classifier(tmp_path, arch)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    assert llm.labels == ("label_a", "label_b", "label_c")
    outs = llm.classify(PROMPTS, use_tqdm=False)
    raw = llm.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits in zip(outs, raw, strict=True):
        assert isinstance(out, ClassificationRequestOutput) and out.finished
        ref = reference_logits(model, out.prompt_token_ids)
        np.testing.assert_allclose(logits.outputs.probs, ref, atol=2e-5)
        np.testing.assert_allclose(out.outputs.probs, softmax(ref), atol=1e-6)
        assert out.outputs.num_classes == 3
    llm.close()


def test_chunked_prefill_prefix_cache_and_batching_change_nothing(tmp_path):
    model = save_classifier(tmp_path, "llama")
    long = [" ".join(PROMPTS) * k for k in (1, 2, 3)]
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off", max_num_batched_tokens=8,
              block_size=4)
    first = llm.classify(long + PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    again = llm.classify(long[::-1], PoolingParams(use_activation=False), use_tqdm=False)   # prefix-cache hits
    for out in first + again:
        np.testing.assert_allclose(out.outputs.probs, reference_logits(model, out.prompt_token_ids), atol=3e-5)
    assert any(o.num_cached_tokens > 0 for o in again)
    llm.close()


@pytest.mark.parametrize("problem", [None, "multi_label_classification", "regression", "one label"])
def test_activation_follows_transformers_text_classification_rule(tmp_path, problem):
    labels = 1 if problem == "one label" else 2
    overrides = {} if problem in (None, "one label") else {"problem_type": problem}
    model = save_classifier(tmp_path, "qwen2", num_labels=labels, **overrides)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    out = llm.classify(PROMPTS[0], use_tqdm=False)[0]
    ref = reference_logits(model, out.prompt_token_ids)
    expected = {None: softmax(ref), "regression": ref}.get(problem, 1 / (1 + np.exp(-ref)))
    np.testing.assert_allclose(out.outputs.probs, expected, atol=2e-6)
    llm.close()


def test_a_score_bias_is_added(tmp_path):
    model = save_classifier(tmp_path, "llama")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    bias = torch.tensor([0.5, -1.0, 2.0])
    save_file({**tensors, "score.bias": bias}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    out = llm.classify(PROMPTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(out.outputs.probs, reference_logits(model, out.prompt_token_ids) + bias.numpy(),
                               atol=2e-5)
    llm.close()


def test_cross_encoder_scores_pairs_read_together(tmp_path):
    model = save_classifier(tmp_path, "qwen3", num_labels=1)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    tokenizer = llm.get_tokenizer()
    got = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    for out, doc in zip(got, PROMPTS[1:], strict=True):
        ids = tokenizer(PROMPTS[0], doc)["input_ids"]   # the tokenizer's pair template
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.outputs.score, 1 / (1 + np.exp(-reference_logits(model, ids)[0])), atol=2e-6)
    joined = llm.score([[5, 6, 7]], [[8, 9]], use_tqdm=False)[0]   # token ids: the two lists joined
    np.testing.assert_allclose(joined.outputs.score, 1 / (1 + np.exp(-reference_logits(model, [5, 6, 7, 8, 9])[0])),
                               atol=2e-6)
    with pytest.raises(ValueError, match="both as texts or both as token ids"):
        llm.score("a", [[5, 6]])
    llm.close()


def test_refusals(tmp_path):
    save_classifier(tmp_path / "c", "llama")
    with pytest.raises(ModelLoadError, match="is a sequence classifier.*--task classify"):
        LLM(str(tmp_path / "c"), dtype="float32", selection="off")
    from conftest import save_tiny_model

    with pytest.raises(ModelLoadError, match="--task classify needs a sequence or token classifier"):
        LLM(str(save_tiny_model(tmp_path / "g")), task="classify", dtype="float32", selection="off")
    llm = LLM(str(tmp_path / "c"), task="classify", dtype="float32", selection="off")
    with pytest.raises(RequestRejectedError, match="scoring pairs needs a cross-encoder.*has 3"):
        llm.score("a", "b")
    with pytest.raises(RequestRejectedError, match="LLM.embed needs an engine made with task='embed'"):
        llm.embed("a")
    with pytest.raises(RequestRejectedError, match="use LLM.classify"):
        llm.generate("a", SamplingParams(max_tokens=2))
    for params, field in ((PoolingParams(dimensions=2), "dimensions"), (PoolingParams(normalize=True), "normalize")):
        with pytest.raises(RequestRejectedError, match=f"{field} applies to embeddings") as info:
            llm.classify("a", params, use_tqdm=False)
        assert info.value.param == field
    with pytest.raises(RequestRejectedError, match="token_type_ids are for encoder models") as info:
        llm.classify({"prompt_token_ids": [5, 6], "token_type_ids": [0, 1]}, use_tqdm=False)   # (a decoder has none)
    assert info.value.param == "token_type_ids"
    with pytest.raises(ValueError, match="activation must be true or false"):
        PoolingParams(activation=1)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disagree"):
        PoolingParams(use_activation=True, activation=False)
    older = llm.classify("a", PoolingParams(activation=False), use_tqdm=False)[0].outputs.probs   # vLLM's older name
    assert older == llm.classify("a", PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.probs
    llm.close()
    embedder = LLM(str(save_tiny_model(tmp_path / "e")), task="embed", dtype="float32", selection="off")
    raw = np.asarray(embedder.embed("a", PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.embedding)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3   # vLLM's newer switch of normalization, for embeddings
    normalized = embedder.embed("a", PoolingParams(use_activation=False, normalize=True), use_tqdm=False)
    np.testing.assert_allclose(normalized[0].outputs.embedding, raw / np.linalg.norm(raw), atol=1e-6)
    with pytest.raises(RequestRejectedError, match="LLM.classify needs an engine made with task='classify'"):
        embedder.classify("a")
    embedder.close()
    bad = json.loads((tmp_path / "c" / "config.json").read_text())
    bad["id2label"] = {"0": "x", "1": "y"}
    bad["label2id"] = {"x": 0, "y": 1}
    (tmp_path / "c" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError, match="'score.weight' has 3 rows, but the config has 2 labels"):
        LLM(str(tmp_path / "c"), task="classify", dtype="float32", selection="off")


def test_tensor_parallel_probabilities_equal(tmp_path, processes):
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    save_classifier(tmp_path, "qwen3")
    # the CPU worker processes (a machine with one GPU has no second device for TP=2)
    one = LLM(str(tmp_path), task="classify", dtype="float32", selection="off", platform="cpu").classify(
        PROMPTS, use_tqdm=False)
    config = EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", selection="off", task="classify",
                                      tensor_parallel_size=2, distributed_executor="mp", max_num_batched_tokens=8,
                                      platform="cpu")
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        done = drive(engine, [(0, f"r{i}", prompt, PoolingParams()) for i, prompt in enumerate(PROMPTS)], {}, 500)
    finally:
        engine.shutdown()
    for i, out in enumerate(one):
        np.testing.assert_allclose(done[f"r{i}"].outputs.probs, out.outputs.probs, atol=1e-5)


def _client(path, **kwargs):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off",
                                                served_model_name="tiny-cls", **kwargs))
    return TestClient(build_app(AsyncLLMEngine(engine))), engine


def test_classify_route(tmp_path):
    model = save_classifier(tmp_path, "mistral")
    client, engine = _client(tmp_path, task="classify")
    with client:
        r = client.post("/classify", json={"model": "tiny-cls", "input": PROMPTS[:2]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == "tiny-cls"
        ids = [engine.tokenize(p) for p in PROMPTS[:2]]
        for i, item in enumerate(body["data"]):
            probs = softmax(reference_logits(model, ids[i]))
            assert item["index"] == i and item["num_classes"] == 3
            np.testing.assert_allclose(item["probs"], probs, atol=1e-6)
            assert item["label"] == f"label_{chr(97 + int(np.argmax(probs)))}"
        tokens = sum(map(len, ids))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        r = client.post("/v1/classify", json={"input": ids[0], "use_activation": False}).json()   # token ids, logits
        np.testing.assert_allclose(r["data"][0]["probs"], reference_logits(model, ids[0]), atol=2e-5)
        for body, param in (({"input": []}, "input"), ({"input": [10**9]}, "input"),
                            ({"input": "x", "activation": 3}, "activation"), ({"input": "x", "model": "other"}, "model"),
                            ({"input": "x", "use_activation": True, "activation": False}, "use_activation"),
                            ({"text_1": "a", "text_2": "b"}, "model")):
            route = "/v1/score" if "text_1" in body else "/classify"
            r = client.post(route, json=body)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
        r = client.post("/v1/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400 and "needs a cross-encoder" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "use /classify" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and "is a classifier (--task classify)" in r.json()["error"]["message"]


def test_score_and_rerank_routes_with_a_cross_encoder(tmp_path):
    model = save_classifier(tmp_path, "qwen3", num_labels=1)
    client, engine = _client(tmp_path, task="classify")
    tokenizer = engine.tokenizer
    sigmoid = lambda ids: float(1 / (1 + np.exp(-reference_logits(model, ids)[0])))   # noqa: E731
    with client:
        r = client.post("/v1/score", json={"text_1": PROMPTS[0], "text_2": PROMPTS[1:]})
        assert r.status_code == 200, r.text
        expected = [sigmoid(tokenizer(PROMPTS[0], d)["input_ids"]) for d in PROMPTS[1:]]
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=2e-6)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(tokenizer(PROMPTS[0], d)["input_ids"])
                                                         for d in PROMPTS[1:])
        r = client.post("/rerank", json={"query": PROMPTS[0], "documents": PROMPTS[1:], "top_n": 2})
        assert r.status_code == 200, r.text
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [x["index"] for x in r.json()["results"]] == order
        np.testing.assert_allclose([x["relevance_score"] for x in r.json()["results"]], [expected[i] for i in order],
                                   atol=2e-6)
        assert r.json()["results"][0]["document"] == {"text": PROMPTS[1 + order[0]]}
        r = client.post("/v1/score", json={"text_1": [5, 6], "text_2": [[7, 8], [9]]})   # token ids joined
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], [sigmoid([5, 6, 7, 8]), sigmoid([5, 6, 9])],
                                   atol=2e-6)
        for route, body, param in (("/v1/score", {"text_1": "a", "text_2": [[5]]}, "text_2"),
                                   ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                                   ("/v1/score", {"text_1": [5], "text_2": [[10**9]]}, "text_2"),
                                   ("/v1/score", {"text_1": "a" * 100_000, "text_2": "b"}, "text_1"),
                                   ("/v1/score", {"text_1": "a", "text_2": ["b" * 100_000]}, "text_2"),
                                   ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                                   ("/v1/score", {"text_1": [], "text_2": []}, "text_2")):
            r = client.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_run_batch_classify_and_score_lines(tmp_path):
    from plinth.entrypoints.cli import main

    model = save_classifier(tmp_path / "m", "llama", num_labels=1)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": "c", "method": "POST", "url": "/classify", "body": {"input": PROMPTS[1]}},
             {"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"text_1": "a", "text_2": ["b", "c"]}},
             {"custom_id": "r", "method": "POST", "url": "/v1/rerank", "body": {"query": "a", "documents": ["b"]}},
             {"custom_id": "p", "method": "POST", "url": "/pooling",
              "body": {"input": PROMPTS[1], "task": "token_classify", "use_activation": False}}]
    inp.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["run-batch", str(tmp_path / "m"), "--task", "classify", "--dtype", "float32", "--selection", "off",
                 "-i", str(inp), "-o", str(out)]) == 0
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in by_id.values()), by_id
    ids = make_tokenizer()(PROMPTS[1])["input_ids"]
    np.testing.assert_allclose(by_id["c"]["response"]["body"]["data"][0]["probs"],
                               1 / (1 + np.exp(-reference_logits(model, ids))), atol=2e-6)
    assert len(by_id["s"]["response"]["body"]["data"]) == 2 and len(by_id["r"]["response"]["body"]["results"]) == 1
    torch_model = model.eval()
    with torch.no_grad():   # the score layer at every position
        per_token = torch_model.score(torch_model.model(torch.tensor([ids])).last_hidden_state)[0].double().numpy()
    np.testing.assert_allclose(by_id["p"]["response"]["body"]["data"][0]["data"], per_token, atol=2e-5)


def test_trailing_pad_tokens_are_not_read(tmp_path):
    """transformers pools the last token that is not the pad token; checkpoints that pad with their end-of-sequence
    token end every pair with it."""
    model = save_classifier(tmp_path, "llama", num_labels=1)
    pad = model.config.pad_token_id
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    for ids in ([5, 6, 7, pad], [5, 6, 7, pad, pad], [5, pad, 7], [pad, pad]):
        out = llm.classify([ids], PoolingParams(use_activation=False), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids   # reported as given
        np.testing.assert_allclose(out.outputs.probs, reference_logits(model, ids), atol=2e-5)
    llm.close()


def test_truncation_cuts_a_pair_as_the_tokenizer_does(tmp_path):
    model = save_classifier(tmp_path, "qwen3", num_labels=1)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    tokenizer = llm.get_tokenizer()
    query, doc = PROMPTS[0], PROMPTS[3] * 3
    cut = tokenizer(query, doc, truncation="longest_first", max_length=12)["input_ids"]
    assert len(cut) == 12 and cut[:3] == tokenizer(query)["input_ids"][:3]   # the query keeps its beginning
    out = llm.score(query, doc, truncate_prompt_tokens=12, use_tqdm=False)[0]
    assert out.prompt_token_ids == cut
    np.testing.assert_allclose(out.outputs.score, 1 / (1 + np.exp(-reference_logits(model, cut)[0])), atol=2e-6)
    ids = llm.score([[1, 2, 3]], [[4, 5, 6, 7, 8, 9]], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert ids.prompt_token_ids == [1, 2, 3, 4, 5]   # token ids: the longer list cut first, both keeping their start
    for bad, error in ((0, ValueError), (10**6, RequestRejectedError)):
        with pytest.raises(error, match="truncate_prompt_tokens"):
            llm.score(query, doc, truncate_prompt_tokens=bad)
    llm.close()
    client, _ = _client(tmp_path, task="classify")
    with client:
        r = client.post("/v1/rerank", json={"query": query, "documents": [doc], "truncate_prompt_tokens": 12})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["results"][0]["relevance_score"], out.outputs.score, atol=1e-6)
        r = client.post("/v1/score", json={"text_1": [1, 2, 3], "text_2": [[4, 5, 6, 7, 8, 9]],
                                           "truncate_prompt_tokens": 5})
        np.testing.assert_allclose(r.json()["data"][0]["score"],
                                   1 / (1 + np.exp(-reference_logits(model, [1, 2, 3, 4, 5])[0])), atol=2e-6)


def test_routes_of_a_generation_server_name_themselves(tmp_path):
    save_classifier(tmp_path, "llama")
    client, _ = _client(tmp_path, task="classify")
    with client:
        for route, body in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/responses", {"input": "hi"})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and f"{route} needs a text generation model" in r.json()["error"]["message"]


def test_the_classifier_of_an_image_and_text_model_is_refused(tmp_path):
    from plinth.errors import UnsupportedModelError

    tokenizer = make_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, num_labels=2,
                                       image_token_index=tokenizer.pad_token_id)
    transformers.Gemma3ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="image-and-text model; plinth runs text-only"):
        LLM(str(tmp_path), task="classify", dtype="float32", selection="off")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "latency"]])
def test_generation_commands_refuse_a_pooling_task_before_loading(tmp_path, command, capsys):
    from plinth.entrypoints.cli import main

    missing = str(tmp_path / "no-such-model")   # refused before the model is looked at
    args = [command[0], *command[1:2], missing, *command[2:], "--task", "classify"]
    assert main(args) != 0
    assert "--task classify" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_a_causal_lm_read_as_a_cross_encoder_with_hf_overrides(tmp_path, tied):
    """vLLM's recipe for rerankers that are causal LMs (Qwen3-Reranker): hf_overrides names a classifier
    architecture and two tokens; the score is the second token's probability in a softmax over the two."""
    from conftest import save_tiny_model

    save_tiny_model(tmp_path, arch="qwen3", tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()
    no, yes = tokenizer.convert_ids_to_tokens([40, 41])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "method": "from_2_way_softmax"}
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off", hf_overrides=overrides)
    assert llm.labels == (yes,)
    pad = tokenizer.pad_token_id
    got = llm.score([PROMPTS[0], [5, 6]], [PROMPTS[1], [7, pad]], use_tqdm=False)   # a pad at the end is read
    for out in got:
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt_token_ids])).logits[0, -1].double()
        np.testing.assert_allclose(out.outputs.score, torch.softmax(logits[[40, 41]], -1)[1].item(), atol=2e-6)
    assert got[1].prompt_token_ids == [5, 6, 7, pad]
    llm.close()
    both = LLM(str(tmp_path), task="classify", dtype="float32", selection="off",
               hf_overrides=json.dumps({**overrides, "method": "no_post_processing"}))   # JSON text, as the flag
    out = both.classify(PROMPTS[1], use_tqdm=False)[0]
    with torch.no_grad():
        logits = model(torch.tensor([out.prompt_token_ids])).logits[0, -1].double()
    np.testing.assert_allclose(out.outputs.probs, torch.softmax(logits[[40, 41]], -1).numpy(), atol=2e-6)
    assert both.labels == (no, yes)
    both.close()


def test_hf_overrides_and_their_refusals(tmp_path):
    from conftest import save_tiny_model

    from plinth.config import ConfigError

    save_tiny_model(tmp_path / "m", arch="qwen3")
    llm = LLM(str(tmp_path / "m"), dtype="float32", selection="off", hf_overrides={"max_position_embeddings": 96})
    assert llm.engine.max_model_len == 96 and llm.engine.model_source.hf_config.max_position_embeddings == 96
    llm.close()
    for bad, match in (("{not json", "not valid JSON"), ([1], "must be a JSON object")):
        with pytest.raises(ConfigError, match=match):
            LLM(str(tmp_path / "m"), hf_overrides=bad)
    (tmp_path / "f.gguf").write_bytes(b"GGUF")   # refused before the file is read
    with pytest.raises(ModelLoadError, match="is a GGUF file, whose settings are its metadata"):
        LLM(str(tmp_path / "f.gguf"), hf_overrides={"max_position_embeddings": 96})
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True}
    with pytest.raises(ModelLoadError, match=r"names \['no', 'yes'\], which the tokenizer does not have"):
        LLM(str(tmp_path / "m"), task="classify", dtype="float32", selection="off", hf_overrides=overrides)
    with pytest.raises(ConfigError, match="a sequence classifier \\(task classify\\) decodes nothing"):
        LLM(str(tmp_path / "m"), task="classify", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ModelLoadError, match="method 'other' is not one plinth knows"):
        LLM(str(tmp_path / "m"), task="classify", dtype="float32", selection="off",
            hf_overrides={**overrides, "classifier_from_token": ["a"], "method": "other"})


def test_offline_scoring_needs_no_server_packages(tmp_path):
    """LLM.score (a bi-encoder's and a cross-encoder's) runs where the HTTP server's packages are not installed."""
    import subprocess
    import sys

    from conftest import save_tiny_model

    save_classifier(tmp_path / "c", "qwen3", num_labels=1)
    save_tiny_model(tmp_path / "e")
    script = (f"import sys; sys.modules['fastapi'] = sys.modules['starlette'] = None\n"
              f"from plinth import LLM\n"
              f"for path, task in (({str(tmp_path / 'c')!r}, 'classify'), ({str(tmp_path / 'e')!r}, 'embed')):\n"
              f"    llm = LLM(path, task=task, dtype='float32', selection='off')\n"
              f"    print(llm.score('a b', ['c', 'd e'], use_tqdm=False, truncate_prompt_tokens=3)[1].outputs.score)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.split()) == 2


def test_hf_overrides_merge_nested_objects_and_reach_remote_code_configs(tmp_path):
    from conftest import save_tiny_model

    from plinth.config import ModelConfig
    from plinth.model_registry.loader import resolve_model_source

    save_tiny_model(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    source = resolve_model_source(ModelConfig(model=str(tmp_path / "m"), hf_overrides={"rope_scaling": {"factor": 4.0}}))
    rope = source.hf_config.rope_parameters
    assert rope["factor"] == 4.0 and rope["rope_type"] == "linear"   # the other key kept
    # a config class shipped with the checkpoint (--trust-remote-code): overrides set on the built config
    config["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig"}
    config["model_type"] = "mine"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "configuration_mine.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MineConfig(LlamaConfig):\n    model_type = 'mine'\n")
    remote = resolve_model_source(ModelConfig(model=str(tmp_path / "m"), trust_remote_code=True,
                                              hf_overrides={"max_position_embeddings": 77, "classifier_note": "x"}))
    assert type(remote.hf_config).__name__ == "MineConfig"
    assert remote.hf_config.max_position_embeddings == 77 and remote.hf_config.classifier_note == "x"
    with pytest.raises(ModelLoadError, match="with hf_overrides: .*num_hidden_layers"):
        resolve_model_source(ModelConfig(model=str(tmp_path / "m"), trust_remote_code=True,
                                         hf_overrides={"num_hidden_layers": "x"}))
    with pytest.raises(ModelLoadError, match="config.json with hf_overrides"):
        resolve_model_source(ModelConfig(model=str(tmp_path / "m"), hf_overrides={"architectures": "Foo"}))


def test_a_dummy_preset_runs_as_a_classifier(tmp_path):
    overrides = {"architectures": ["Qwen2ForSequenceClassification"], "num_hidden_layers": 2, "hidden_size": 64,
                 "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
                 "num_labels": 3, "max_position_embeddings": 256}
    runs = []
    for seed in (0, 0, 1):
        llm = LLM("qwen2.5-7b", load_format="dummy", task="classify", dtype="float32", selection="off",
                  hf_overrides=overrides, seed=seed)
        runs.append(llm.classify([[1, 2, 3]], use_tqdm=False)[0].outputs.probs)
        assert len(runs[-1]) == 3 and abs(sum(runs[-1]) - 1) < 1e-5
        llm.close()
    assert runs[0] == runs[1] and runs[0] != runs[2]   # the random weights and head follow the engine's seed
