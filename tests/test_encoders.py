"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa, ModernBERT): embeddings, classifiers and cross-encoder pair scores
against transformers running the same weights, batched inputs of mixed lengths, RoBERTa's positions around pad
tokens, BERT's two segments, ModernBERT's local windows, tensor parallelism, the server's routes and the refusals."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from plinth import LLM, PoolingParams
from plinth.config import ConfigError
from plinth.core.scheduler import RequestRejectedError
from plinth.errors import ModelLoadError, UnsupportedModelError

WORDS = ("the a of to and in is was for on that with as it by at from his her be this are have an not which or but "
         "one all were they we you cat mat sat dog").split()
VOCAB = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list("abcdefghijklmnopqrstuvwxyz.,?!")
                           + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]))
TEXTS = ["the cat sat on a mat.", "it was all for one and one for all, we are!", "hi",
         "to be or not to be, that is the question of his and her dog"]


def save_encoder(path, kind: str = "bert", labels: int = 0, **overrides):
    """A small random encoder (``bert`` or ``xlmr``; a sequence classifier with ``labels`` labels) with a WordPiece
    tokenizer, its weights drawn wide enough (N(0, 0.2)) that a wrong segment or position shows."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True)
    assert len(tokenizer) == len(VOCAB)   # (the words are in it: texts are not [UNK]s)
    tokenizer.save_pretrained(path)
    common = dict(vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, **({"num_labels": labels} if labels else {}))
    if kind == "bert":
        cfg = transformers.BertConfig(max_position_embeddings=64, **common, **overrides)
        cls = transformers.BertForSequenceClassification if labels else transformers.BertModel
    elif kind == "modernbert":   # four layers (full, local, local, full), local layers 4 positions to each side
        common.update(num_hidden_layers=4, intermediate_size=96)
        cfg = transformers.ModernBertConfig(max_position_embeddings=128, pad_token_id=0, cls_token_id=2,
                                            sep_token_id=3, bos_token_id=2, eos_token_id=3, local_attention=8,
                                            **common, **overrides)
        cls = transformers.ModernBertForSequenceClassification if labels else transformers.ModernBertModel
    else:   # positions from pad + 1 (66 - 1 = 65 of them), one segment
        cfg = transformers.XLMRobertaConfig(max_position_embeddings=66, pad_token_id=0, bos_token_id=2,
                                            eos_token_id=3, type_vocab_size=1, **common, **overrides)
        cls = transformers.XLMRobertaForSequenceClassification if labels else transformers.XLMRobertaModel
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def hf_encoder(path, labels: bool = False):
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    model = (AutoModelForSequenceClassification if labels else AutoModel).from_pretrained(path).eval()
    return AutoTokenizer.from_pretrained(path), model


def hf_inputs(tokenizer, model, *texts, ids=None):
    enc = tokenizer(*texts, return_tensors="pt") if ids is None else {"input_ids": torch.tensor([ids])}
    if model.config.model_type != "bert":   # (XLM-RoBERTa's and ModernBERT's own tokenizers give no token types)
        enc.pop("token_type_ids", None)
    return enc


@pytest.fixture(scope="module", params=["bert", "xlmr", "modernbert"])
def encoder(request, tmp_path_factory):
    return request.param, save_encoder(tmp_path_factory.mktemp(f"enc-{request.param}"), request.param)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_match_transformers(encoder, pooling):
    kind, path = encoder
    tokenizer, hf = hf_encoder(path)
    llm = LLM(str(path), task="embed", dtype="float32", selection="off", pooling=pooling)
    assert llm.engine.config.cache.enable_prefix_caching is False
    assert llm.engine.config.scheduler.enable_chunked_prefill is False
    # mixed lengths in one step, then inputs of one length (the batch needs no padding)
    same = [tokenizer(t)["input_ids"][:6] for t in TEXTS[:2]] + [tokenizer(TEXTS[3])["input_ids"][:6]]
    for prompts in (TEXTS, [{"prompt_token_ids": ids} for ids in same]):
        outs = llm.embed(prompts, PoolingParams(normalize=False))
        for prompt, out in zip(prompts, outs, strict=True):
            enc = hf_inputs(tokenizer, hf, prompt) if isinstance(prompt, str) else \
                hf_inputs(tokenizer, hf, ids=prompt["prompt_token_ids"])
            assert out.prompt_token_ids == enc["input_ids"][0].tolist()
            with torch.no_grad():
                states = hf(**enc).last_hidden_state[0].double()
            ref = states[0] if pooling == "cls" else states.mean(0)
            np.testing.assert_allclose(out.outputs.embedding, ref.numpy(), atol=2e-5, rtol=1e-5)
    normed = llm.embed(TEXTS[1])[0].outputs.embedding   # normalized by default
    assert abs(float(np.linalg.norm(normed)) - 1.0) < 1e-5
    # truncation keeps the beginning and the closing [SEP] / </s>, as the tokenizer truncates
    out = llm.embed(TEXTS[3], PoolingParams(truncate_prompt_tokens=7, normalize=False))[0]
    enc = tokenizer(TEXTS[3], truncation=True, max_length=7, return_tensors="pt")
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    with torch.no_grad():
        states = hf(**hf_inputs(tokenizer, hf, ids=out.prompt_token_ids)).last_hidden_state[0].double()
    np.testing.assert_allclose(out.outputs.embedding, (states[0] if pooling == "cls" else states.mean(0)).numpy(),
                               atol=2e-5)


def test_an_embedding_model_reads_a_sep_inside_a_text_as_one_segment(tmp_path):
    path = save_encoder(tmp_path / "sep")
    tokenizer, hf = hf_encoder(path)
    text = "the cat [SEP] sat on a mat"   # one text: token type 0 throughout, as the tokenizer says
    enc = hf_inputs(tokenizer, hf, text)
    assert enc["token_type_ids"].sum() == 0 and (enc["input_ids"] == tokenizer.sep_token_id).sum() == 2
    with torch.no_grad():
        ref = hf(**enc).last_hidden_state[0, 0].double()
    llm = LLM(str(path), task="embed", dtype="float32", selection="off")
    out = llm.embed(text, PoolingParams(normalize=False))[0].outputs.embedding
    np.testing.assert_allclose(out, ref.numpy(), atol=2e-5)


def test_default_pooling_is_the_first_token_and_sentence_transformers_configs_are_read(tmp_path):
    path = save_encoder(tmp_path / "st")
    tokenizer, hf = hf_encoder(path)
    with torch.no_grad():
        states = hf(**hf_inputs(tokenizer, hf, TEXTS[0])).last_hidden_state[0].double()
    cls_vec = states[0] / states[0].norm()
    llm = LLM(str(path), task="embed", dtype="float32", selection="off")
    assert llm.engine.pooling.kind == "cls"
    np.testing.assert_allclose(llm.embed(TEXTS[0])[0].outputs.embedding, cls_vec.numpy(), atol=2e-5)
    del llm
    # all-MiniLM's layout: mean pooling, then Normalize
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                "pooling_mode_cls_token": False,
                                                                "pooling_mode_mean_tokens": True}))
    mean_vec = states.mean(0) / states.mean(0).norm()
    llm = LLM(str(path), task="embed", dtype="float32", selection="off")
    assert llm.engine.pooling.kind == "mean" and llm.engine.pooling.normalize
    np.testing.assert_allclose(llm.embed(TEXTS[0])[0].outputs.embedding, mean_vec.numpy(), atol=2e-5)


def test_roberta_positions_step_over_pad_tokens(tmp_path):
    path = save_encoder(tmp_path / "xlmr", "xlmr")
    tokenizer, hf = hf_encoder(path)
    ids = tokenizer(TEXTS[1])["input_ids"]
    ids = ids[:3] + [0, 0] + ids[3:]   # pad tokens inside the input take the pad position
    llm = LLM(str(path), task="embed", dtype="float32", selection="off", pooling="mean")
    out = llm.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False))[0].outputs.embedding
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].double().mean(0)
    np.testing.assert_allclose(out, ref.numpy(), atol=2e-5)
    # the context: 66 position rows less the pad_token_id + 1 (here 0 + 1) that positions start after
    assert llm.engine.max_model_len == 65
    llm.embed({"prompt_token_ids": [5] * 65})
    with pytest.raises(RequestRejectedError, match="longer than max_model_len"):
        llm.engine.add_request("long", [5] * 66, PoolingParams())


def test_bert_cross_encoder_reads_a_pair_as_two_segments(tmp_path):
    path = save_encoder(tmp_path / "ce", labels=1)
    tokenizer, hf = hf_encoder(path, labels=True)
    llm = LLM(str(path), task="classify", dtype="float32", selection="off")
    assert llm.engine.num_token_types == 2
    queries = ["the cat", "one", "what is this"]
    docs = ["a cat sat on the mat", "all for one", "this is a dog"]
    scores = [s.outputs.score for s in llm.score(queries, docs)]
    with torch.no_grad():
        two = [torch.sigmoid(hf(**tokenizer(q, d, return_tensors="pt")).logits[0, 0]).item()
               for q, d in zip(queries, docs, strict=True)]
        enc = [tokenizer(q, d, return_tensors="pt") for q, d in zip(queries, docs, strict=True)]
        one = [torch.sigmoid(hf(input_ids=e["input_ids"]).logits[0, 0]).item() for e in enc]
    np.testing.assert_allclose(scores, two, atol=1e-5)
    assert max(abs(a - b) for a, b in zip(two, one, strict=True)) > 1e-3   # the segments matter
    # token-id pairs cut as the tokenizer cuts the texts: the [CLS] and both [SEP]s stay
    query, doc = tokenizer("what is this")["input_ids"], tokenizer("this is a dog")["input_ids"][1:]
    assert query + doc == tokenizer("what is this", "this is a dog")["input_ids"]
    for keep in (6, 9):
        enc = tokenizer("what is this", "this is a dog", truncation=True, max_length=keep, return_tensors="pt")
        with torch.no_grad():
            ref = torch.sigmoid(hf(**enc).logits[0, 0]).item()
        out = llm.score([query], [doc], truncate_prompt_tokens=keep)[0]
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        assert abs(out.outputs.score - ref) < 1e-5
    with pytest.raises(ValueError, match="text_2 must not hold an empty token list"):
        llm.score([query], [[]])


def test_token_types_come_with_the_request_not_from_sep_tokens(tmp_path):
    """A single text that holds a literal ``[SEP]`` is one segment (as its tokenizer types it); a pair whose first text
    holds one splits where the tokenizer splits it; ``token_type_ids`` given with token ids are used as given (cut
    with the prompt by ``truncate_prompt_tokens``) and checked."""
    path = save_encoder(tmp_path / "types", labels=1)
    tokenizer, hf = hf_encoder(path, labels=True)
    llm = LLM(str(path), task="classify", dtype="float32", selection="off")

    def hf_logit(**enc):
        with torch.no_grad():
            return hf(**{k: torch.as_tensor(v).reshape(1, -1) for k, v in enc.items()}).logits[0, 0].item()

    text = "the cat [SEP] sat on a mat"
    enc = tokenizer(text)
    assert sum(enc["token_type_ids"]) == 0 and enc["input_ids"].count(tokenizer.sep_token_id) == 2
    got = llm.classify(text, PoolingParams(use_activation=False))[0].outputs.probs[0]
    assert abs(got - hf_logit(**enc)) < 1e-5
    as_pair = hf_logit(input_ids=enc["input_ids"], token_type_ids=[0] * 5 + [1] * (len(enc["input_ids"]) - 5))
    assert abs(got - as_pair) > 1e-3   # (read as a pair, it would score otherwise)
    enc = tokenizer("the cat [SEP] sat", "on a mat")
    score = llm.score("the cat [SEP] sat", "on a mat")[0].outputs.score
    assert abs(score - torch.sigmoid(torch.tensor(hf_logit(**enc))).item()) < 1e-5
    # given token types, also cut by truncate_prompt_tokens (the first tokens and the closing [SEP] stay)
    ids, types = enc["input_ids"], [0, 1, 1, 0, 1, 0, 1, 1, 0, 1]
    assert len(types) == len(ids)
    out = llm.classify({"prompt_token_ids": ids, "token_type_ids": types}, PoolingParams(use_activation=False))
    assert abs(out[0].outputs.probs[0] - hf_logit(input_ids=ids, token_type_ids=types)) < 1e-5
    out = llm.classify({"prompt_token_ids": ids, "token_type_ids": types},
                       PoolingParams(use_activation=False, truncate_prompt_tokens=6))
    assert out[0].prompt_token_ids == ids[:5] + ids[-1:]
    assert abs(out[0].outputs.probs[0] - hf_logit(input_ids=ids[:5] + ids[-1:], token_type_ids=types[:5] + types[-1:])) < 1e-5
    for bad, match in (([0, 1], "holds 2 values for a prompt of 10 tokens"), ([0] * 9 + [2], r"in \[0, 2\).* got 2"),
                       ([0] * 9 + [-1], "got -1"), (["a"] * 10, "must be a list of integers"),
                       (dict.fromkeys(range(10), 1), "must be a list of integers")):
        with pytest.raises(RequestRejectedError, match=match) as info:
            llm.classify({"prompt_token_ids": ids, "token_type_ids": bad})
        assert info.value.param == "token_type_ids"
    with pytest.raises(ValueError, match="'token_type_ids' .* go with 'prompt_token_ids'"):
        llm.classify({"prompt": text, "token_type_ids": [0]})


@pytest.mark.parametrize("kind", ["bert", "xlmr", "modernbert", "modernbert-mean"])
def test_classifier_heads_match_transformers(tmp_path, kind):
    labels = 2 if kind == "bert" else 3
    extra = {"classifier_pooling": "mean"} if kind == "modernbert-mean" else {}
    path = save_encoder(tmp_path / kind, kind.removesuffix("-mean"), labels=labels, **extra)
    tokenizer, hf = hf_encoder(path, labels=True)
    llm = LLM(str(path), task="classify", dtype="float32", selection="off")
    assert llm.labels == tuple(f"LABEL_{i}" for i in range(labels))
    probs = [o.outputs.probs for o in llm.classify(TEXTS)]
    logits = [o.outputs.probs for o in llm.classify(TEXTS, PoolingParams(use_activation=False))]
    for text, p, raw in zip(TEXTS, probs, logits, strict=True):
        with torch.no_grad():
            ref = hf(**hf_inputs(tokenizer, hf, text)).logits[0].double()
        np.testing.assert_allclose(raw, ref.numpy(), atol=2e-5)
        np.testing.assert_allclose(p, torch.softmax(ref, 0).numpy(), atol=1e-6)
    # the classifier's hidden states serve as embeddings too
    assert len(LLM(str(path), task="embed", dtype="float32", selection="off").embed("hi")[0].outputs.embedding) == 64


def test_modernbert_local_layers_see_their_window_only(tmp_path):
    path = save_encoder(tmp_path / "mb", "modernbert")
    tokenizer, hf = hf_encoder(path)
    text = " ".join(WORDS[:30])   # 32 tokens: the local layers' windows (4 each side) cut most pairs
    llm = LLM(str(path), task="embed", dtype="float32", selection="off", pooling="mean")
    out = llm.embed(text, PoolingParams(normalize=False))[0].outputs.embedding
    enc = hf_inputs(tokenizer, hf, text)
    with torch.no_grad():
        ref = hf(**enc).last_hidden_state[0].double().mean(0)
        hf.config.local_attention = 1024   # every layer sees the whole input: the output changes
        hf.config._attn_implementation = "eager"
        wide = hf(**enc).last_hidden_state[0].double().mean(0)
    np.testing.assert_allclose(out, ref.numpy(), atol=2e-5)
    assert float((wide - ref).abs().max()) > 1e-3


def test_an_accelerators_default_step_runs_many_inputs():
    """No budget set: an encoder's steps on a GPU take ENCODER_STEP_TOKENS (many short inputs a step); a budget the
    user set, or a CPU's, is kept (raised only to the context)."""
    import dataclasses

    from plinth.config import EngineConfig
    from plinth.worker.setup import ENCODER_STEP_TOKENS, encoder_settings

    config = EngineConfig.from_kwargs(model="m", max_num_batched_tokens=2048, enable_chunked_prefill=True)
    unset = EngineConfig.from_kwargs(model="m", enable_chunked_prefill=True)
    unset = dataclasses.replace(unset, scheduler=unset.scheduler.with_defaults(512, 2048))   # (the platform's)
    configs = {False: unset, True: config}
    steps = {(given, device): encoder_settings(configs[given], 512, device).scheduler
             for given in (False, True) for device in ("cuda", "cpu")}
    assert steps[False, "cuda"].max_num_batched_tokens == ENCODER_STEP_TOKENS > 2048
    assert [steps[k].max_num_batched_tokens for k in ((True, "cuda"), (False, "cpu"), (True, "cpu"))] == [2048] * 3
    assert encoder_settings(config, 40000, "cuda").scheduler.max_num_batched_tokens == 40000
    assert not any(s.enable_chunked_prefill for s in steps.values())


@pytest.mark.parametrize("async_steps", [False, True])
def test_many_inputs_over_several_steps_and_a_small_budget(tmp_path, caplog, async_steps):
    """With ``async_steps`` each step is scheduled while the one before is in flight (its pooled rows read back
    after the next step is launched), as on a GPU."""
    path = save_encoder(tmp_path / "many")
    tokenizer, hf = hf_encoder(path)
    texts = [" ".join(WORDS[i % 7: i % 7 + 1 + i % 11]) for i in range(24)]
    with caplog.at_level(logging.INFO, logger="plinth"):
        llm = LLM(str(path), task="embed", dtype="float32", selection="off", max_num_batched_tokens=16,
                  max_num_seqs=4, async_scheduling=async_steps)
    assert llm.engine.async_scheduling == async_steps
    assert llm.engine.config.scheduler.max_num_batched_tokens == 64   # raised to the context: inputs run whole
    assert "an encoder's input runs whole in one step" in caplog.text
    outs = llm.embed(texts, PoolingParams(normalize=False))
    for text, out in zip(texts, outs, strict=True):
        with torch.no_grad():
            ref = hf(**hf_inputs(tokenizer, hf, text)).last_hidden_state[0, 0].double()
        np.testing.assert_allclose(out.outputs.embedding, ref.numpy(), atol=2e-5)
    # one-token inputs (scheduled as decode-sized steps) beside longer ones
    outs = llm.embed([{"prompt_token_ids": [7]}, {"prompt_token_ids": [8]}, texts[5]], PoolingParams(normalize=False))
    for ids, out in zip(([7], [8]), outs, strict=False):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).last_hidden_state[0, 0].double()
        np.testing.assert_allclose(out.outputs.embedding, ref.numpy(), atol=2e-5)


def test_refusals(tmp_path):
    path = save_encoder(tmp_path / "r")
    with pytest.raises(ModelLoadError, match="encoder-only model .*cannot generate text; serve it with --task embed"):
        LLM(str(path), dtype="float32", selection="off")
    with pytest.raises(ModelLoadError, match="--task classify needs a sequence or token classifier"):
        LLM(str(path), task="classify", dtype="float32", selection="off")
    with pytest.raises(ConfigError, match="BertModel declares no layers that take LoRA adapters"):
        LLM(str(path), task="embed", dtype="float32", selection="off", enable_lora=True)
    with pytest.raises(UnsupportedModelError, match="BertModel cannot take embeddings in its forward pass"):
        LLM(str(path), task="embed", dtype="float32", selection="off", enable_prompt_embeds=True)
    relative = save_encoder(tmp_path / "rel", position_embedding_type="relative_key")
    with pytest.raises(UnsupportedModelError, match="absolute position embeddings"):
        LLM(str(relative), task="embed", dtype="float32", selection="off")


def test_tensor_parallel_embeddings_equal(tmp_path, processes):
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    path = save_encoder(tmp_path / "tp", labels=1)
    one = [o.outputs.score for o in LLM(str(path), task="classify", dtype="float32", selection="off",
                                         platform="cpu").score("the cat", TEXTS)]
    config = EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off", task="classify",
                                      tensor_parallel_size=2, distributed_executor="mp", platform="cpu")
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        tokenizer = engine.tokenizer
        for i, text in enumerate(TEXTS):   # (the pairs' token types travel to the workers with the step)
            enc = tokenizer("the cat", text)
            engine.add_request(f"r{i}", enc["input_ids"], PoolingParams(), token_type_ids=enc["token_type_ids"])
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs.probs[0]
    finally:
        engine.shutdown()
    np.testing.assert_allclose([done[f"r{i}"] for i in range(len(TEXTS))], one, atol=1e-5)


@pytest.mark.server
def test_server_embeddings_and_rerank(tmp_path):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    path = save_encoder(tmp_path / "srv")
    tokenizer, hf = hf_encoder(path)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", selection="off", task="embed"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        r = client.post("/v1/embeddings", json={"input": TEXTS[:2]})
        assert r.status_code == 200, r.text
        # without --served-model-name the model argument as given names the model too (vLLM's served name), and
        # the reported name stays the folder's
        r2 = client.post("/v1/embeddings", json={"input": TEXTS[:2], "model": str(path)})
        assert r2.status_code == 200 and r2.json()["data"] == r.json()["data"] and r2.json()["model"] == "srv"
        assert client.post("/v1/embeddings", json={"input": "a", "model": str(path) + "x"}).status_code == 404
        for text, item in zip(TEXTS[:2], r.json()["data"], strict=True):
            with torch.no_grad():
                ref = hf(**hf_inputs(tokenizer, hf, text)).last_hidden_state[0, 0].double()
            np.testing.assert_allclose(item["embedding"], (ref / ref.norm()).numpy(), atol=2e-5)
        r = client.post("/v1/embeddings", json={"input": TEXTS[3], "truncate_prompt_tokens": 7})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7, r.text
        with torch.no_grad():
            ref = hf(**tokenizer(TEXTS[3], truncation=True, max_length=7, return_tensors="pt")).last_hidden_state[0, 0]
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], (ref / ref.norm()).double().numpy(), atol=2e-5)
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"input": " ".join(["cat"] * 70)})
        assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]
    cross = save_encoder(tmp_path / "ce", labels=1)
    tokenizer, hf = hf_encoder(cross, labels=True)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(cross), dtype="float32", selection="off", task="classify"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        r = client.post("/v1/rerank", json={"query": "the cat", "documents": TEXTS, "top_n": 2})
        assert r.status_code == 200, r.text
        with torch.no_grad():
            ref = [torch.sigmoid(hf(**tokenizer("the cat", d, return_tensors="pt")).logits[0, 0]).item() for d in TEXTS]
        best = sorted(range(len(TEXTS)), key=lambda i: -ref[i])[:2]
        r2 = client.post("/v1/rerank", json={"query": " ".join(["cat"] * 70), "documents": ["a"]})
        assert r2.status_code == 400 and r2.json()["error"]["param"] == "query", r2.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == best
        np.testing.assert_allclose([x["relevance_score"] for x in results], [ref[i] for i in best], atol=1e-5)
        # token-id pairs: joined and typed as the tokenizer types the texts (a [SEP] of the first list included)
        query, docs = tokenizer("the cat")["input_ids"], [tokenizer(d)["input_ids"][1:] for d in TEXTS[:2]]
        r = client.post("/v1/score", json={"text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([x["score"] for x in r.json()["data"]], ref[:2], atol=1e-5)
        r = client.post("/v1/rerank", json={"query": query, "documents": docs})
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        np.testing.assert_allclose([got[0], got[1]], ref[:2], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["xlmr", "modernbert"])
def test_gpu_bfloat16_embeddings(tmp_path, kind):
    path = save_encoder(tmp_path / "gpu", kind)
    tokenizer, hf = hf_encoder(path)
    llm = LLM(str(path), task="embed", dtype="bfloat16", pooling="mean")
    outs = llm.embed(TEXTS)
    for text, out in zip(TEXTS, outs, strict=True):
        with torch.no_grad():
            states = hf.double()(**hf_inputs(tokenizer, hf, text)).last_hidden_state[0].mean(0)
        cos = float(np.dot(out.outputs.embedding, (states / states.norm()).numpy()))
        assert cos > 0.999, cos
    # the variable-length kernel (mixed lengths in one step) against padded SDPA
    from plinth.model_registry.models import bert

    if bert._varlen_kernel() is not None:
        device = str(llm.engine.device)
        bert._NO_VARLEN.add(device)
        try:
            padded = llm.embed(TEXTS)
        finally:
            bert._NO_VARLEN.discard(device)
        for a, b in zip(outs, padded, strict=True):
            assert float(np.dot(a.outputs.embedding, b.outputs.embedding)) > 0.9999
