"""Per-token pooling (``LLM.encode``): each prompt token's final hidden state (``token_embed``) and token classifiers'
labels for every position (``*ForTokenClassification``, ``token_classify``), against transformers running the same
weights, through chunked prefill, asynchronous steps, preemption and a warm prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from conftest import decisive_weights, make_tokenizer, save_tiny_model
from engine_driving import drive
from test_encoders import TEXTS, hf_inputs, save_encoder

from plinth import LLM, PoolingOutput, PoolingParams
from plinth.core.pooling import PoolState
from plinth.core.scheduler import RequestRejectedError

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is the capital of Germany.", "0",
           "Continuous batching keeps the accelerator busy while requests come and go."]
DECODERS = {"llama": (transformers.LlamaConfig, transformers.LlamaForTokenClassification),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForTokenClassification),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForTokenClassification)}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-token-embed"), arch="llama")


def hidden_states(model_dir, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def test_token_embeddings_match_transformers_and_skip_the_prefix_cache(llama_dir):
    """Last-token pooling keeps the prefix cache on; a per-token request computes its whole prompt anyway (a
    cached prefix has no hidden states), chunked 8 tokens a step."""
    llm = LLM(str(llama_dir), dtype="float32", selection="off", task="embed", max_num_batched_tokens=8, block_size=4)
    assert llm.engine.block_manager.enable_prefix_caching
    llm.embed(PROMPTS, use_tqdm=False)   # fills the prefix cache with every prompt's blocks
    again = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    outs = llm.encode(PROMPTS, pooling_task="token_embed", use_tqdm=False)
    raw = llm.encode(PROMPTS, PoolingParams(task="token_embed", normalize=False, dimensions=16), use_tqdm=False)
    for prompt, out, plain in zip(PROMPTS, outs, raw, strict=True):
        ids = llm.engine.tokenize(prompt)
        assert out.finished and out.prompt_token_ids == ids and out.num_cached_tokens == 0
        assert isinstance(out.outputs, PoolingOutput) and out.outputs.data.dtype == torch.float32
        ref = hidden_states(llama_dir, ids)
        assert tuple(out.outputs.data.shape) == (len(ids), 64)
        np.testing.assert_allclose(out.outputs.data.numpy(), ref / np.linalg.norm(ref, axis=-1, keepdims=True),
                                   atol=2e-5)
        np.testing.assert_allclose(plain.outputs.data.numpy(), ref[:, :16], atol=2e-5, rtol=1e-4)
    # the whole-prompt task through encode: the embedding as a tensor
    whole = llm.encode(PROMPTS[0], use_tqdm=False)[0]
    np.testing.assert_allclose(whole.outputs.data.numpy(), llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding,
                               atol=1e-6)
    llm.close()


def test_token_embeddings_with_asynchronous_steps_and_preemption(llama_dir):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 100, size=n).tolist() for n in (13, 4, 11, 1, 9, 12, 6, 10)]
    llm = LLM(str(llama_dir), dtype="float32", selection="off", task="embed", max_num_batched_tokens=8,
              max_num_seqs=4, block_size=4, num_blocks=5, async_scheduling=True)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False),
                      pooling_task="token_embed", use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0 and not llm.engine._sync_groups
    for ids, out in zip(prompts, outs, strict=True):
        np.testing.assert_allclose(out.outputs.data.numpy(), hidden_states(llama_dir, ids), atol=2e-5, rtol=1e-4)
    llm.close()


def test_every_position_is_added_once():
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    state = PoolState("all", 10, PoolingParams(task="token_embed"))
    assert state.rows_wanted(0, 4) == (0, 4)
    state.add(0, rows[0:4])
    assert state.rows_wanted(0, 6) == (4, 6)   # recomputed after preemption: only the new positions
    state.add(2, rows[2:7])
    assert state.covered == 7 and state.vector is None
    state.add(7, rows[7:10])
    np.testing.assert_array_equal(state.vector, rows)


def save_token_classifier(path, arch: str, num_labels: int = 5):
    tokenizer = make_tokenizer()
    config_cls, model_cls = DECODERS[arch]
    labels = {i: f"tag_{i}" for i in range(num_labels)}
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        pad_token_id=tokenizer.pad_token_id, num_labels=num_labels, id2label=labels,
                        label2id={v: k for k, v in labels.items()})
    torch.manual_seed(0)
    model = decisive_weights(model_cls(config).eval())
    with torch.no_grad():
        model.score.bias.normal_(0.0, 1.0)   # (the score layer's bias counts)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", list(DECODERS))
def test_decoder_token_classifiers_match_transformers(tmp_path, arch):
    model = save_token_classifier(tmp_path, arch)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off", max_num_batched_tokens=8,
              block_size=4)
    assert llm.labels == tuple(f"tag_{i}" for i in range(5))
    outs = llm.encode(PROMPTS, use_tqdm=False)   # token_classify: the token classifier's own task
    raw = llm.encode(PROMPTS, PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    for out, logits in zip(outs, raw, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([out.prompt_token_ids])).logits[0].double().numpy()
        assert tuple(out.outputs.data.shape) == (len(out.prompt_token_ids), 5)
        np.testing.assert_allclose(logits.outputs.data.numpy(), ref, atol=3e-5)
        np.testing.assert_allclose(out.outputs.data.numpy(), softmax(ref), atol=1e-5)
    with pytest.raises(RequestRejectedError, match="token_classify task"):
        llm.classify(PROMPTS[0], use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="token classifier"):
        llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)
    llm.close()


def test_a_decoders_sequence_classifier_labels_every_position(tmp_path):
    """vLLM's token_classify of a *ForSequenceClassification: its score layer at each position (trailing pad
    tokens are read too); classify still pools the last token that is not a pad."""
    from test_classification import save_classifier

    model = save_classifier(tmp_path, "llama")
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    pad = llm.get_tokenizer().pad_token_id
    ids = llm.engine.tokenize(PROMPTS[1]) + [pad, pad]
    out = llm.encode({"prompt_token_ids": ids}, PoolingParams(use_activation=False), pooling_task="token_classify",
                     use_tqdm=False)[0]
    with torch.no_grad():
        ref = model.score(model.model(torch.tensor([ids])).last_hidden_state)[0].double().numpy()
    assert out.prompt_token_ids == ids and tuple(out.outputs.data.shape) == (len(ids), 3)
    np.testing.assert_allclose(out.outputs.data.numpy(), ref, atol=3e-5)
    whole = llm.classify({"prompt_token_ids": ids}, PoolingParams(use_activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(whole.outputs.probs, ref[-3], atol=3e-5)   # (the last token before the pads)
    llm.close()


def test_a_token_classifier_keeps_each_chunks_logits_not_its_hidden_states(tmp_path):
    """A long prompt's positions are kept as their label logits ([tokens, labels]) as each chunk comes, not as
    float32 hidden states ([tokens, hidden]) until the prompt ends."""
    model = save_token_classifier(tmp_path, "llama")
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off", max_num_batched_tokens=8)
    engine = llm.engine
    ids = engine.tokenize(PROMPTS[1])
    assert len(ids) > 16
    engine.add_request("r", ids, PoolingParams(use_activation=False))
    state = engine.scheduler.waiting[0].pooling
    widths, out = set(), None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        widths |= {part.shape[-1] for part in state.parts}
    assert widths == {5}
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(out.outputs.data.numpy(), ref, atol=3e-5)
    llm.close()


@pytest.mark.parametrize("kind", ["bert", "xlmr", "modernbert"])
def test_encoder_token_classifiers_match_transformers(tmp_path, kind):
    """BERT's and RoBERTa's linear layer over each position, ModernBERT's head and classifier."""
    save_encoder(tmp_path, kind, labels=3)   # (a sequence classifier's encoder: saved again as a token classifier)
    cls = {"bert": transformers.BertForTokenClassification, "xlmr": transformers.XLMRobertaForTokenClassification,
           "modernbert": transformers.ModernBertForTokenClassification}[kind]
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.architectures = [cls.__name__]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), task="classify", dtype="float32", selection="off")
    outs = llm.encode(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    for text, out in zip(TEXTS, outs, strict=True):
        enc = hf_inputs(tokenizer, model, text)
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        with torch.no_grad():
            ref = model(**enc).logits[0].double().numpy()
        np.testing.assert_allclose(out.outputs.data.numpy(), ref, atol=3e-5, rtol=1e-4)
    llm.close()


def test_refusals(tmp_path, llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", selection="off", task="embed")
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode(PROMPTS[0], pooling_task="tokens")
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="embedding")
    with pytest.raises(RequestRejectedError, match="token_classify task is not one of an embedding model's"):
        llm.encode(PROMPTS[0], pooling_task="token_classify", use_tqdm=False)
    # (the hint names what serves classify: a sequence classifier, not the token_classify task refused here too)
    with pytest.raises(RequestRejectedError, match=r"classify task is not one of an embedding model's "
                                                   r"\(embed, token_embed\): sequence classifiers") as refused:
        llm.encode(PROMPTS[0], pooling_task="classify", use_tqdm=False)
    assert "token_classify" not in str(refused.value)
    llm.close()
    llm = LLM(str(save_encoder(tmp_path / "bert", "bert", labels=2)), dtype="float32", selection="off",
              task="classify")
    with pytest.raises(RequestRejectedError, match=r"token_classify task is not one of a sequence classifier's "
                                                   r"\(classify\): token classifiers \(\*ForTokenClassification\)"):
        llm.encode(TEXTS[0], pooling_task="token_classify", use_tqdm=False)
    assert llm.encode(TEXTS[0], use_tqdm=False)[0].outputs.data.shape == (2,)   # its own task: classify
    llm.close()
    llm = LLM(str(llama_dir), dtype="float32", selection="off")
    with pytest.raises(RequestRejectedError, match="LLM.encode needs an embedding or classification engine"):
        llm.encode(PROMPTS[0])
    llm.close()


@pytest.mark.server
def test_server_pooling_route(tmp_path, llama_dir):
    """vLLM's /pooling: any of the model's tasks, numbers or base64; /classify and /v1/embeddings keep their
    whole-input tasks."""
    import base64

    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    def serve(path, task):
        engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off",
                                                    served_model_name="m", task=task))
        return TestClient(build_app(AsyncLLMEngine(engine))), engine

    client, engine = serve(llama_dir, "embed")
    with client:
        ids = engine.tokenize(PROMPTS[1])
        ref = hidden_states(llama_dir, ids)
        got = client.post("/pooling", json={"input": [ids, ids[:3]], "task": "token_embed",
                                               "normalize": False})
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == len(ids) + 3
        assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
        np.testing.assert_allclose(body["data"][0]["data"], ref, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(body["data"][1]["data"], hidden_states(llama_dir, ids[:3]), atol=2e-5, rtol=1e-4)
        packed = client.post("/pooling", json={"input": ids, "task": "token_embed", "normalize": False,
                                               "encoding_format": "base64"}).json()["data"][0]["data"]
        rows = np.frombuffer(base64.b64decode(packed), dtype="<f4").reshape(len(ids), -1)
        np.testing.assert_allclose(rows, ref, atol=2e-5, rtol=1e-4)
        whole = client.post("/pooling", json={"input": PROMPTS[1]}).json()["data"][0]["data"]   # embed
        np.testing.assert_allclose(whole, ref[-1] / np.linalg.norm(ref[-1]), atol=2e-5)
        bad = client.post("/pooling", json={"input": "a", "task": "token_classify"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"
        assert client.post("/pooling", json={"input": "a", "task": "tokens"}).status_code == 400
        bad = client.post("/pooling", json={"input": "a", "dimensions": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    model = save_token_classifier(tmp_path / "tok", "qwen2")
    client, engine = serve(tmp_path / "tok", "classify")
    with client:
        ids = engine.tokenize(PROMPTS[0])
        body = client.post("/pooling", json={"input": PROMPTS[0]}).json()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].double().numpy()
        np.testing.assert_allclose(body["data"][0]["data"], softmax(ref), atol=1e-5)
        raw = client.post("/pooling", json={"input": PROMPTS[0], "activation": False}).json()   # the older name
        np.testing.assert_allclose(raw["data"][0]["data"], ref, atol=3e-5)
        both = client.post("/pooling", json={"input": "a", "activation": False, "use_activation": True})
        assert both.status_code == 400 and both.json()["error"]["param"] == "use_activation"
        refused = client.post("/classify", json={"input": PROMPTS[0]})
        assert refused.status_code == 400 and "token_classify" in refused.json()["error"]["message"]


def test_tensor_parallel_worker_processes(tmp_path, processes):
    """TP=2 CPU worker processes (pooling steps run one after another there): the same rows as one process."""
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    save_token_classifier(tmp_path, "llama")
    one = LLM(str(tmp_path), dtype="float32", selection="off", task="classify", platform="cpu").encode(PROMPTS)
    config = EngineConfig.from_kwargs(model=str(tmp_path), dtype="float32", selection="off", task="classify",
                                      tensor_parallel_size=2, distributed_executor="mp", max_num_batched_tokens=8,
                                      platform="cpu")
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        done = drive(engine, [(0, f"r{i}", prompt, PoolingParams()) for i, prompt in enumerate(PROMPTS)], {}, 200)
    finally:
        engine.shutdown()
    for i, out in enumerate(one):
        np.testing.assert_allclose(done[f"r{i}"].outputs.data.numpy(), out.outputs.data.numpy(), atol=1e-5)
