"""Shared fixtures: small random models with a real (tiny, trained in memory) tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Large language models generate text one token at a time.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d\u4e16\u754c \U0001f600 emoji and accents.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 20


def make_tokenizer(vocab_size: int = 300, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer trained on a tiny corpus (``corpus``: another), with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def decisive_weights(model):
    """``model`` with larger-than-default random matrices (N(0, 0.08)), which make greedy choices decisive (random
    models are otherwise near-uniform)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a small random model of a real architecture plus the tiny tokenizer into ``path``."""
    import torch
    import transformers

    tokenizer = make_tokenizer()
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = decisive_weights(model_cls(config_cls(**common)).eval())
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


#: worker processes shared by the session's engines, one executor at a time: count -> (their environment, pool)
_POOLS: dict[int, tuple[dict[str, str], Any]] = {}


def shared_worker_processes(count: int = 2):
    """``count`` worker processes that engines run on one after another (each releases its ranks when it shuts
    down), which saves each engine the start of its processes (importing torch). A pool left broken, with a dead
    process, or started under other environment variables (a test's ``monkeypatch.setenv``) is replaced."""
    import os

    from plinth.distributed.executor_mp import WorkerProcesses

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}   # (pytest's, changed every phase)
    started, procs = _POOLS.get(count, (None, None))
    if procs is not None and (procs.broken or started != env or not all(p.is_alive() for p in procs.procs)):
        procs.stop()
        procs = None
    if procs is None:
        procs = WorkerProcesses(count, timeout_s=120.0)
        _POOLS[count] = (env, procs)
    return procs


def pytest_sessionfinish(session, exitstatus):
    for _, procs in _POOLS.values():
        procs.stop()
    _POOLS.clear()


@pytest.fixture
def processes():
    """Two worker processes shared by the session's engines, one executor at a time, checked before each test
    (modules that need another pool define their own ``processes``)."""
    return shared_worker_processes(2)


def output_matches_transformers(out, model, steps: int = 6, tol: float = 2e-4, **inputs) -> None:
    """``out`` (a plinth ``RequestOutput`` with per-step logprobs) equals transformers' greedy ``generate`` of ``model``
    on its prompt tokens and ``inputs`` (pixels and the like): the same tokens, and each logprob within ``tol``."""
    import torch

    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **inputs)
    assert out.outputs[0].token_ids == gen.sequences[0, ids.shape[1]:].tolist()
    for step, scores in zip(out.outputs[0].logprobs, gen.scores, strict=True):
        ref = torch.log_softmax(scores[0].float(), -1)
        for tid, lp in step.items():
            assert abs(lp.logprob - ref[tid].item()) < tol, (tid, lp.logprob, ref[tid].item())


def random_picture(seed: int, size: tuple[int, int] = (40, 52)):
    """A PIL RGB image of ``size`` (height, width) whose pixels are uniform random bytes (seeded)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def server_tokens_of_image_chat(path, image, text: str) -> list[int]:
    """The tokens the server's ``/tokenize`` gives for a user message of ``image`` (a PIL image, sent as a PNG data
    URL) then ``text``, on an engine over ``path`` (CPU, float32)."""
    import base64
    import io

    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", block_size=4, selection="off",
                                                platform="cpu"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": text}]}]
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]


def generate_on_tp_workers(path, prompts, params, size: int = 2, rounds: int = 1, hits: list | None = None,
                           pp: int = 1, **engine_kw):
    """``LLM.generate`` through an engine whose ``size`` tensor-parallel ranks (times ``pp`` pipeline stages) are
    worker processes (CPU, float32); ``rounds`` times one after another (the outputs of every round, concatenated),
    the prefix cache's hit tokens appended to ``hits``. ``engine_kw``: more engine options."""
    import threading

    from plinth import LLM
    from plinth.config import EngineConfig
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    procs = shared_worker_processes(size * pp)
    config = EngineConfig.from_kwargs(model=str(path), dtype="float32", platform="cpu", block_size=4,
                                      selection="off", tensor_parallel_size=size, pipeline_parallel_size=pp,
                                      distributed_executor="mp", **engine_kw)
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, procs))
    try:
        assert engine.runner is None   # the ranks run in the workers
        llm = LLM.__new__(LLM)   # an LLM over this engine
        llm.engine, llm._ids, llm._lock = engine, iter(range(10**6)), threading.RLock()
        outs = [o for _ in range(rounds) for o in llm.generate(prompts, params)]
        if hits is not None:
            hits.append(engine.block_manager.stats.hit_tokens)
        return outs
    finally:
        engine.shutdown()
