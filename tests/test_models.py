"""Native architectures and the transformers fallback against transformers itself (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_driver import PagedDriver, build_metadata

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ModelConfig
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source
from plinth.model_registry.models.transformers_fallback import TransformersForCausalLM
from plinth.model_registry.registry import ModelRegistry

COMMON = dict(vocab_size=1003, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08)

# architecture -> (config class, config overrides)
ARCHS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=6, head_dim=16)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=24, num_hidden_layers=3)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3)),
    # no native class: runs through the transformers fallback
    "GemmaForCausalLM": ("GemmaConfig", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh")),
}

PROMPT_LENS = (5, 11, 17)
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    """A small random transformers model of one architecture, saved as safetensors."""
    arch = request.param
    config_cls, overrides = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(1234)
    hf = getattr(transformers, arch)(config).eval()
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    return arch, str(path), hf


def _load(path: str, backend: TorchSDPABackend):
    source = resolve_model_source(ModelConfig(model=path, dtype="float32"))
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=4)
    return load_model(source, ctx)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def test_native_or_fallback_class(checkpoint):
    arch, _, _ = checkpoint
    cls = ModelRegistry.resolve(arch)
    assert issubclass(cls, TransformersForCausalLM) == (arch == "GemmaForCausalLM")


def test_prefill_logits_match_transformers(checkpoint):
    arch, path, hf = checkpoint
    backend = TorchSDPABackend()
    model = _load(path, backend)
    PagedDriver(model, backend, block_size=4)  # allocates the KV caches
    prompt = _prompts(hf.config.vocab_size)[2]
    ids, pos, md = build_metadata([(prompt, 0, [3, 9, 1, 7, 5])], block_size=4)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, pos, md))  # [L, vocab]
    ref = _hf_logits(hf, prompt)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    # the tolerance is meaningful: changing an earlier token moves the last logits far more
    other = _hf_logits(hf, prompt[:-5] + [(prompt[-5] + 1) % hf.config.vocab_size] + prompt[-4:])
    assert (other[-1] - ref[-1]).abs().max().item() > 1e-2


@pytest.mark.parametrize("chunks", [1, 2], ids=["whole_prefill", "chunked_prefill"])
def test_batched_greedy_matches_transformers(checkpoint, chunks):
    arch, path, hf = checkpoint
    backend = TorchSDPABackend()
    model = _load(path, backend)
    driver = PagedDriver(model, backend, block_size=4)
    prompts = _prompts(hf.config.vocab_size)
    generated, step_logits = driver.generate_greedy(prompts, NEW_TOKENS, prefill_chunks=chunks)
    for prompt, gen, logits in zip(prompts, generated, step_logits, strict=True):
        assert len(gen) == NEW_TOKENS
        ref = _hf_logits(hf, prompt + gen[:-1])[len(prompt) - 1:]  # [NEW_TOKENS, vocab]
        assert (torch.stack(logits) - ref).abs().max().item() < 1e-4
        assert ref.argmax(-1).tolist() == gen  # transformers' greedy choice at every step


def test_sliding_window_is_applied(tmp_path):
    """One layer with window 4: the last logits depend on the last 4 tokens only."""
    cfg = transformers.MistralConfig(**{**COMMON, "sliding_window": 4, "num_hidden_layers": 1})
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    backend = TorchSDPABackend()
    model = _load(str(tmp_path), backend)
    driver = PagedDriver(model, backend, block_size=4)
    driver.add(0, [1, 2, 3, 4, 5, 6, 7, 8])
    driver.add(1, [9, 9, 9, 9, 5, 6, 7, 8])
    driver.add(2, [9, 9, 9, 4, 5, 6, 7, 8])
    out = driver.step({0: 8, 1: 8, 2: 4})
    out.update(driver.step({2: 4}))  # the same tokens, the last four as a second chunk
    assert (out[0] - out[1]).abs().max().item() < 1e-5
    assert (out[0] - out[2]).abs().max().item() < 1e-5
    model.model.layers[0].self_attn.attn.sliding_window = None
    driver = PagedDriver(model, backend, block_size=4)
    driver.add(0, [1, 2, 3, 4, 5, 6, 7, 8])
    driver.add(1, [9, 9, 9, 9, 5, 6, 7, 8])
    out = driver.step({0: 8, 1: 8})
    assert (out[0] - out[1]).abs().max().item() > 1e-3
