"""The default model end to end: plinth and transformers give the same greedy tokens (float32, CPU).

plinth loads SmolLM2-135M-Instruct (GGUF Q4_1) the way the engine does (ModelConfig with no model ->
the default model -> the GGUF loader -> the native Llama through the paged KV cache). transformers
builds the same architecture from the same file with its own GGUF loader and must make the same greedy
choice after every prefix. Both dequantize the same blocks, so the 48 tokens of each prompt must agree.
"""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ModelConfig
from plinth.model_registry.gguf_loader import load_gguf_tokenizer, transformers_config
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source

NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook, as a numbered list.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plinth_model():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PLINTH_DEFAULT_MODEL", raising=False)
        source = resolve_model_source(ModelConfig(model=None, dtype="float32"))
    assert source.kind == "gguf" and source.architecture == "LlamaForCausalLM"
    backend = TorchSDPABackend()
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=16)
    return source, load_model(source, ctx), backend


@pytest.fixture(scope="module")
def transformers_model(plinth_model):
    source, _, _ = plinth_model
    config = transformers_config(source.hf_config)  # the engine's config is a plain one
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    return model


@torch.no_grad()
def transformers_next_tokens(model, prompt: list[int], generated: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy choice after each prefix ``prompt + generated[:i]``, in one forward pass.

    When these equal ``generated``, transformers' own greedy decoding produces ``generated`` (by
    induction over the steps), without its 48 slow single-token steps.
    """
    logits = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]  # [steps, vocab]
    return logits.argmax(-1).tolist(), logits


def test_default_model_greedy_tokens_match_transformers(plinth_model, transformers_model):
    source, model, backend = plinth_model
    tokenizer = load_gguf_tokenizer(source.path)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        for q in QUESTIONS
    ]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)  # ChatML starts with <|im_start|>
    driver = PagedDriver(model, backend, block_size=16, num_blocks=64)
    generated, step_logits = driver.generate_greedy(prompts, NEW_TOKENS)
    for question, prompt, ours, logits in zip(QUESTIONS, prompts, generated, step_logits, strict=True):
        assert len(ours) == NEW_TOKENS
        reference, reference_logits = transformers_next_tokens(transformers_model, prompt, ours)
        answer = tokenizer.decode(ours)
        assert ours == reference, f"{question!r}: plinth {answer!r} vs transformers {tokenizer.decode(reference)!r}"
        torch.testing.assert_close(torch.stack(logits), reference_logits, rtol=0, atol=2e-3)
    assert "Paris" in tokenizer.decode(generated[0])
