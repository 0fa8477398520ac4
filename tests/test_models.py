"""Native architectures and the transformers fallback against transformers itself (float32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from paged_driver import PagedDriver, build_metadata

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ModelConfig
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source
from plinth.model_registry.models.decoder import SandwichDecoderLayer
from plinth.model_registry.models.transformers_fallback import TransformersForCausalLM
from plinth.model_registry.registry import ModelRegistry

COMMON = dict(vocab_size=1003, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08)

# test id -> (architecture, config class, config overrides)
ARCHS = {
    "LlamaForCausalLM": ("LlamaForCausalLM", "LlamaConfig", dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "MistralForCausalLM": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=6, head_dim=16)),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24, num_hidden_layers=3)),
    "MixtralForCausalLM": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        num_hidden_layers=3)),
    "GemmaForCausalLM": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=16, hidden_act="gelu_pytorch_tanh")),
    # attention-logit soft cap small enough to bite, sliding layers, a final cap
    "Gemma2ForCausalLM": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # sliding layers with their own RoPE base, q/k norms, a softmax scale other than head_dim ** -0.5, a final cap
    "Gemma3ForCausalLM": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})),
    # fused checkpoint projections, RoPE over half of each head
    "Phi3ForCausalLM": ("Phi3ForCausalLM", "Phi3Config", dict(
        pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # layers 1 and 2 without RoPE (NoPE)
    "SmolLM3ForCausalLM": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(
        num_hidden_layers=4, no_rope_layers=[1, 0, 0, 1], pad_token_id=0)),
    # every multiplier away from 1 (Granite 3's values are 12, 1/64, 0.22, 8)
    "GraniteForCausalLM": ("GraniteForCausalLM", "GraniteConfig", dict(
        embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0)),
    # norms on the block outputs only, q/k norms over all heads
    "Olmo2ForCausalLM": ("Olmo2ForCausalLM", "Olmo2Config", dict(pad_token_id=0)),
    # OLMo 2's blocks with sliding layers, each kind with its own RoPE base
    "Olmo3ForCausalLM": ("Olmo3ForCausalLM", "Olmo3Config", dict(
        pad_token_id=0, num_hidden_layers=3, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # sinks in every head, sliding and full layers, biased experts whose clamp bites, YaRN without truncation
    "GptOssForCausalLM": ("GptOssForCausalLM", "GptOssConfig", dict(
        head_dim=16, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        swiglu_limit=0.05, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    # a shared expert with its sigmoid gate beside the routed ones, one dense layer, top-k not renormalised
    "Qwen2MoeForCausalLM": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])),
    # q/k norms over all heads, a q/k/v clamp that bites
    "OlmoeForCausalLM": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, clip_qkv=0.5, pad_token_id=0)),
    # Granite's multipliers on experts stacked in the checkpoint; with a shared MLP
    "GraniteMoeForCausalLM": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0, attention_multiplier=0.3,
        residual_multiplier=0.5, logits_scaling=4.0)),
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40, residual_multiplier=0.5)),
    # multi-head latent attention (values narrower than keys), grouped sigmoid routing with its correction (which
    # reroutes here), shared experts, a dense first layer, interleaved rotary pairs
    "DeepseekV3ForCausalLM": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, routed_scaling_factor=2.5)),
    # no query compression, softmax routing within the best group, YaRN with DeepSeek's mscale on the softmax scale
    "DeepseekV2ForCausalLM": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
    # Llama-style attention with q/k/v biases, per-head q/k norms and RoPE over half of each head, on DeepSeek-V3's
    # grouped sigmoid routing with shared experts and a dense first layer
    "Glm4MoeForCausalLM": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # GLM-4.5's layout with biases on all four projections, q/k norms, sliding and full layers
    "Dots1ForCausalLM": ("Dots1ForCausalLM", "Dots1Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        attention_bias=True, head_dim=16, num_hidden_layers=3, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Mistral with the window on the layers layer_types marks
    "MinistralForCausalLM": ("MinistralForCausalLM", "MinistralConfig", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # q/k/v biases and a separate output bias, MLP biases, an explicit head_dim
    "SeedOssForCausalLM": ("SeedOssForCausalLM", "SeedOssConfig", dict(
        attention_bias=True, attention_out_bias=True, mlp_bias=True, head_dim=24)),
    # RoPE over adjacent pairs, biases on every projection, tied embeddings
    "Ernie4_5ForCausalLM": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(use_bias=True, head_dim=16,
                                                                          tie_word_embeddings=True)),
    # ERNIE's attention; experts from layer 1, chosen on the scores plus a correction that reroutes here, two shared
    "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        head_dim=16, num_hidden_layers=3, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
        moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1)),
    # the parallel block on one bias-free LayerNorm, per-head q/k LayerNorms with their own weights (Command-R+),
    # biases, interleaved RoPE, a logit scale
    "CohereForCausalLM": ("CohereForCausalLM", "CohereConfig", dict(
        use_qk_norm=True, attention_bias=True, logit_scale=0.5, layer_norm_eps=1e-4)),
    # Cohere's block with sliding layers on RoPE and full layers without (Command-R7B)
    "Cohere2ForCausalLM": ("Cohere2ForCausalLM", "Cohere2Config", dict(
        num_hidden_layers=3, sliding_window=5, logit_scale=0.25,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # LayerNorms with biases, RoPE over half of each head, q/k/v biases (StableLM 2 1.6B)
    "StableLmForCausalLM": ("StableLmForCausalLM", "StableLmConfig", dict(
        use_qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # StableLM 2 12B: the parallel block and per-head q/k LayerNorms stored one tensor per head
    "StableLmParallel": ("StableLmForCausalLM", "StableLmConfig", dict(
        use_parallel_residual=True, qk_layernorm=True, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 10000.0,
                                                                         "partial_rotary_factor": 0.25})),
    # Phi-2: the parallel block on a LayerNorm with a bias, q/k/v and dense biases, an ungated GELU MLP with biases,
    # partial RoPE, q/k LayerNorms shared by the heads, an LM head with a bias
    "PhiForCausalLM": ("PhiForCausalLM", "PhiConfig", dict(
        qk_layernorm=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # no native class: runs through the transformers fallback
    "GPTNeoXForCausalLM": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.5, num_key_value_heads=4)),
}
FALLBACK = {"GPTNeoXForCausalLM"}

PROMPT_LENS = (5, 11, 17)
NEW_TOKENS = 32


@torch.no_grad()
def randomize_zero_parameters(hf: transformers.PreTrainedModel, seed: int = 5) -> transformers.PreTrainedModel:
    """transformers starts biases (and Gemma's norm offsets) at zero, which would hide a bias loaded into the wrong
    place: give every all-zero parameter random values, and attention sinks values large enough to matter."""
    g = torch.Generator().manual_seed(seed)
    for name, b in [*hf.named_buffers(), *hf.named_parameters()]:
        if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's / ERNIE's routing correction: rerouting
            b.copy_(torch.randn(b.shape, generator=g) * (0.1 if "moe_statics" in name else 1.0))
    for name, p in hf.named_parameters():
        if name.endswith(".sinks"):
            p.copy_(torch.randn(p.shape, generator=g) * 1.5)
        elif not p.any():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return hf


def follow_config_swiglu(hf: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """gpt-oss experts clamped and scaled as the config says (``swiglu_limit``, ``swiglu_alpha``): some transformers
    releases (5.17) fix them at 7.0 and 1.702 whatever the config holds (the released models' values)."""
    for module in hf.modules():
        if type(module).__name__ == "GptOssExperts":
            module.limit = getattr(hf.config, "swiglu_limit", module.limit)
            module.alpha = getattr(hf.config, "swiglu_alpha", module.alpha)
    return hf


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    """A small random transformers model of one architecture, saved as safetensors."""
    arch, config_cls, overrides = ARCHS[request.param]
    # eager attention: some transformers releases run Gemma 2 through SDPA, which drops its attention soft cap
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides}, attn_implementation="eager")
    torch.manual_seed(1234)
    hf = follow_config_swiglu(randomize_zero_parameters(getattr(transformers, arch)(config).eval()))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, str(path), hf


def _load(path: str, backend: TorchSDPABackend, max_model_len: int | None = None):
    source = resolve_model_source(ModelConfig(model=path, dtype="float32"))
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=4, max_model_len=max_model_len)
    return load_model(source, ctx)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def test_native_or_fallback_class(checkpoint):
    name, path, _ = checkpoint
    assert issubclass(ModelRegistry.resolve(ARCHS[name][0]), TransformersForCausalLM) == (name in FALLBACK)


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


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", -1.0), ("final_logit_softcapping", 0.0),
                                         ("attn_logit_softcapping", float("nan")), ("attn_logit_softcapping", 1e39),
                                         ("final_logit_softcapping", float("inf"))])
def test_gemma2_refuses_unusable_soft_caps(tmp_path, field, value):
    """A cap that is not a positive number is refused at load with the field's name (zero divided the logits)."""
    from plinth.worker.setup import attention_spec

    _, config_cls, overrides = ARCHS["Gemma2ForCausalLM"]
    config = transformers.Gemma2Config(**{**COMMON, **overrides, field: value})
    ctx = ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=TorchSDPABackend(), block_size=4)
    with pytest.raises(UnsupportedModelError, match=field):
        ModelRegistry.resolve("Gemma2ForCausalLM")(ctx)
    assert attention_spec(config, torch.float32, 4).logit_soft_cap == (0.5 if field != "attn_logit_softcapping"
                                                                         else None)


def test_transformers_fallback_applies_the_attention_soft_cap(tmp_path, monkeypatch):
    """transformers' own Gemma 2 code on plinth's paged attention: the soft cap it asks for is the layers' (the
    fallback used to refuse it), and the logits equal transformers'."""
    arch, config_cls, overrides = ARCHS["Gemma2ForCausalLM"]
    torch.manual_seed(3)
    hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**COMMON, **overrides},
                                                              attn_implementation="eager")).eval()
    model, error = fallback_against_transformers(hf, tmp_path, monkeypatch)
    assert {layer.soft_cap for layer in model._attn_layers} == {0.5}
    assert error < 1e-4


@pytest.mark.parametrize("name", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_transformers_fallback_merges_per_expert_tensors_and_pages_narrower_values(name, tmp_path, monkeypatch):
    """transformers' own DeepSeek code on plinth's paged attention: the checkpoint's per-expert tensors merge into
    its stacked experts (transformers' conversions), V3's routing correction (a buffer) is read, and values
    narrower than keys are paged; the logits equal transformers'."""
    arch, config_cls, overrides = ARCHS[name]
    torch.manual_seed(3)
    hf = randomize_zero_parameters(getattr(transformers, arch)(getattr(transformers, config_cls)(
        **{**COMMON, **overrides}, attn_implementation="eager")).eval())
    model, error = fallback_against_transformers(hf, tmp_path, monkeypatch)
    assert {(layer.num_kv_heads, layer.head_size) for layer in model._attn_layers} == {(4, 24)}
    assert error < 1e-4


def fallback_against_transformers(hf, path, monkeypatch) -> tuple[TransformersForCausalLM, float]:
    """``hf`` saved to ``path`` and loaded through the transformers fallback (float32, ``torch_sdpa``): the model
    and the largest difference of its prefill logits from ``hf``'s."""
    from plinth.model_registry.models.transformers_fallback import fallback_class

    hf.save_pretrained(path)
    monkeypatch.setattr(ModelRegistry, "resolve", fallback_class)
    backend = TorchSDPABackend()
    model = _load(str(path), backend)
    assert isinstance(model, TransformersForCausalLM)
    prompt = _prompts(hf.config.vocab_size)[1]
    return model, (paged_prefill_logits(model, backend, prompt) - _hf_logits(hf, prompt)).abs().max().item()


def paged_prefill_logits(model, backend, prompt: list[int]) -> torch.Tensor:
    """The prefill logits ``[L, vocab]`` of ``prompt`` through plinth's paged attention (block size 4)."""
    PagedDriver(model, backend, block_size=4)
    ids, pos, md = build_metadata([(prompt, 0, list(range(-(-len(prompt) // 4), 0, -1)))], block_size=4)  # reversed
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, md))


@pytest.mark.parametrize(("arch", "overrides"), [
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}}),
    ("Qwen3ForCausalLM", {"partial_rotary_factor": 0.5}),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    ("Gemma3ForCausalLM", {"attn_logit_softcapping": 0.5}),
    ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("Qwen3ForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("Gemma2ForCausalLM", {"mlp_bias": True}),
], ids=["llama_partial_rotary", "qwen3_partial_rotary", "phi3_partial_rotary", "gemma3_attn_soft_cap",
        "mistral_biases", "qwen3_biases", "gemma2_mlp_bias"])
def test_config_keys_their_architecture_ignores_or_reads(tmp_path, arch, overrides):
    """Config keys that transformers reads for some architectures only: ``partial_rotary_factor`` (Phi-3 turns half
    of each head; Llama and Qwen3 turn the whole head), ``attn_logit_softcapping`` (Gemma 2 caps, Gemma 3 does
    not), ``attention_bias``/``mlp_bias`` (Llama reads both, Qwen3 the first, Mistral neither: its checkpoints have
    no such tensors, and were refused as missing them). plinth equals transformers either way."""
    _, config_cls, base = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **base, **overrides})
    torch.manual_seed(3)
    hf = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)   # sharp attention: the rotated width and a cap of 0.5 move the logits far
    hf.save_pretrained(tmp_path)
    prompt = _prompts(config.vocab_size)[1]
    model = _load(str(tmp_path), TorchSDPABackend())
    assert (paged_prefill_logits(model, TorchSDPABackend(), prompt) - _hf_logits(hf, prompt)).abs().max() < 1e-4


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


def test_a_sliding_window_key_of_an_architecture_without_one_is_ignored(tmp_path):
    """A ``sliding_window`` in a Llama config (an architecture without a window: transformers ignores the key) does
    not change the model; a window that is not a positive integer is refused where the architecture has one."""
    from plinth.errors import ModelLoadError
    from plinth.worker.setup import attention_spec

    cfg = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    cfg.sliding_window = 4
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    model = _load(str(tmp_path / "llama"), TorchSDPABackend())
    assert model.model.layers[0].self_attn.attn.sliding_window is None
    # what backends are chosen for: no window either
    assert attention_spec(cfg, torch.float32, 4).sliding_window is None
    assert attention_spec(transformers.MistralConfig(**{**COMMON, "sliding_window": 4}), torch.float32,
                          4).sliding_window == 4
    prompt = list(range(1, 12))
    assert (paged_prefill_logits(model, TorchSDPABackend(), prompt) - _hf_logits(hf, prompt)).abs().max() < 1e-4
    for bad in (-5, -1):
        mistral = transformers.MistralConfig(**{**COMMON, "num_hidden_layers": 1})
        mistral.sliding_window = bad
        transformers.MistralForCausalLM(mistral).save_pretrained(tmp_path / "mistral")
        with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer"):
            _load(str(tmp_path / "mistral"), TorchSDPABackend())


# ---- building blocks ----

@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_rope_scaling_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from plinth.model_registry.layers.rotary import compute_inv_freq, rope_parameters

    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 256,
                                      "rope_parameters": {"rope_theta": 50000.0, **rope}})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    inv, scale = compute_inv_freq(rope_parameters(cfg), 16, cfg.max_position_embeddings)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_dynamic_rope_scaling_matches_transformers(tmp_path):
    """Dynamic (NTK-aware) scaling: the base raised for the engine's context, as transformers raises it for a
    sequence of that length (fixed for the run, as vLLM does); within the config's length it is the plain RoPE, so
    an engine there gives transformers' greedy tokens."""
    from conftest import save_tiny_model
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from plinth import LLM
    from plinth.model_registry.layers.rotary import compute_inv_freq, rope_parameters

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 64, "rope_parameters": rope})
    for context in (None, 32, 64, 100, 128):
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=context)
        inv, scale = compute_inv_freq(rope_parameters(cfg), 16, 64, context)
        assert torch.allclose(inv, want.float(), rtol=1e-6, atol=0) and scale == 1.0, context
    path = save_tiny_model(tmp_path / "m", max_position_embeddings=64, rope_parameters=rope)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", selection="off", max_model_len=64)
    llm_greedy_matches(llm, hf, [list(range(5, 25)), [7, 8, 9]], max_tokens=12)
    assert LLM(str(path), dtype="float32", selection="off").engine.max_model_len == 128   # the default context


@pytest.mark.parametrize("factor", [None, 2.0])
def test_longrope_scale_takes_the_configs_factor(factor):
    """longrope's cos/sin scale comes from ``factor`` where the config gives one, else from the growth of the
    context over the original one (Phi-3's configs), as in transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from plinth.model_registry.layers.rotary import compute_inv_freq, rope_parameters

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)],
            **({"factor": factor} if factor else {})}
    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 256, "rope_parameters": rope})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=17)   # past 16: the long factors
    inv, scale = compute_inv_freq(rope_parameters(cfg), 16, cfg.max_position_embeddings, context=256)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)
    assert scale == pytest.approx(math.sqrt(1 + math.log(factor or 16) / math.log(16)))   # 256 / 16 without one


@pytest.mark.parametrize("rope, expected", [
    (None, 256),
    ({"rope_type": "linear", "factor": 4.0}, 1024),
    ({"rope_type": "dynamic", "factor": 2.0}, 512),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),   # 64 x 4
    ({"rope_type": "yarn", "factor": 4.0}, 1024),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, 256),   # already the extended length
])
def test_context_length_takes_the_rope_scaling_factor(rope, expected, tmp_path):
    """The default ``max_model_len`` is the config's context as vLLM derives it: ``max_position_embeddings`` times a
    linear/dynamic factor, YaRN's original length times its factor; llama3's (and Gemma 3's) stay as stated."""
    from plinth.model_registry.layers.rotary import context_length

    cfg = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 256,
                                      **({"rope_parameters": {"rope_theta": 1e4, **rope}} if rope else {})})
    assert context_length(cfg) == expected
    gemma = transformers.Gemma3TextConfig(max_position_embeddings=256,
                                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert context_length(gemma) == 256
    if rope is not None and rope["rope_type"] == "yarn" and "original_max_position_embeddings" not in rope:
        from conftest import save_tiny_model

        from plinth import LLM

        path = save_tiny_model(tmp_path / "m", max_position_embeddings=64,
                               rope_parameters={"rope_theta": 1e4, **rope})
        assert LLM(str(path), dtype="float32", selection="off").engine.max_model_len == 256


def test_max_model_len_beyond_the_context_is_refused_unless_allowed(tmp_path, monkeypatch):
    """As vLLM: a ``max_model_len`` above the derived context is a configuration error naming both numbers and
    the variable that allows it; with the variable on, the engine runs at the length asked for."""
    from conftest import save_tiny_model

    from plinth import LLM
    from plinth.config import ConfigError

    path = save_tiny_model(tmp_path / "m", max_position_embeddings=64)
    monkeypatch.delenv("PLINTH_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ConfigError, match="max_model_len 100 exceeds the model's context length 64.*"
                                          "PLINTH_ALLOW_LONG_MAX_MODEL_LEN=1"):
        LLM(str(path), dtype="float32", selection="off", max_model_len=100)
    assert LLM(str(path), dtype="float32", selection="off", max_model_len=64).engine.max_model_len == 64
    monkeypatch.setenv("PLINTH_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(str(path), dtype="float32", selection="off", max_model_len=100).engine.max_model_len == 100


def test_rope_parameters_from_old_style_config():
    from plinth.model_registry.layers.rotary import rope_parameters

    old = type("Cfg", (), {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})()
    assert rope_parameters(old) == {"rope_theta": 5e5, "type": "linear", "factor": 2.0, "rope_type": "linear"}


def test_unsupported_rope_type_is_a_clear_error():
    from plinth.errors import UnsupportedModelError
    from plinth.model_registry.layers.rotary import compute_inv_freq

    with pytest.raises(UnsupportedModelError, match="'ntk'.*supported: default, linear, dynamic, llama3, yarn, longrope"):
        compute_inv_freq({"rope_type": "ntk", "rope_theta": 1e4}, 16, 128)
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE scaling needs a factor"):
        compute_inv_freq({"rope_type": "dynamic", "rope_theta": 1e4}, 16, 128)
    with pytest.raises(UnsupportedModelError, match="longrope RoPE scaling needs original_max_position_embeddings"):
        compute_inv_freq({"rope_type": "longrope", "rope_theta": 1e4}, 16, 128)


def _split_mlp(tp_size: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    from plinth.model_registry.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    ranks = []
    for r in range(tp_size):
        gu = MergedColumnParallelLinear(16, [24, 24], tp_rank=r, tp_size=tp_size)
        gu.weight_loader(gu.weight, gate, 0)
        gu.weight_loader(gu.weight, up, 1)
        dn = RowParallelLinear(24, 16, tp_rank=r, tp_size=tp_size)
        dn.weight_loader(dn.weight, down)
        ranks.append((gu, dn))
    return ranks


def test_tensor_parallel_mlp_shards_sum_to_the_full_result():
    from plinth.model_registry.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g),
                      torch.randn(16, 24, generator=g))
    x = torch.randn(5, 16, generator=g)
    full = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    for tp in (1, 2, 4):
        # each rank's partial output (before the all-reduce) summed over ranks
        total = sum(dn.linear_method.apply(dn, SiluAndMul()(gu(x)), None) for gu, dn in _split_mlp(tp, gate, up, down))
        assert torch.allclose(total, full, atol=1e-4)


@pytest.mark.parametrize("num_kv_heads,tp", [(4, 2), (2, 4), (1, 2)])
def test_tensor_parallel_qkv_shards(num_kv_heads, tp):
    from plinth.model_registry.layers.linear import QKVParallelLinear

    d, hq = 4, 8
    q = torch.arange(hq * d * 6, dtype=torch.float32).view(hq * d, 6)
    k = -torch.arange(num_kv_heads * d * 6, dtype=torch.float32).view(num_kv_heads * d, 6)
    v = k - 1000
    for r in range(tp):
        layer = QKVParallelLinear(6, d, hq, num_kv_heads, tp_rank=r, tp_size=tp)
        for sid, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, sid)
        qs, kvs = layer.num_heads * d, layer.num_kv_heads * d
        assert layer.num_heads == hq // tp
        kv_head = r * num_kv_heads // tp if num_kv_heads >= tp else r // (tp // num_kv_heads)
        w = layer.weight
        assert torch.equal(w[:qs], q[r * qs:(r + 1) * qs])
        assert torch.equal(w[qs:qs + kvs], k[kv_head * d:kv_head * d + kvs])
        assert torch.equal(w[qs + kvs:], v[kv_head * d:kv_head * d + kvs])


def test_tensor_parallel_vocab_shards():
    from plinth.model_registry.layers.embedding import LMHead

    full = torch.randn(1003, 8)
    parts = []
    for r in range(2):
        head = LMHead(1003, 8, tp_rank=r, tp_size=2)
        head.weight_loader(head.weight, full)
        parts.append(head.weight)
    assert parts[0].shape == (502, 8)
    assert torch.equal(torch.cat(parts)[:1003], full) and torch.all(parts[1][-1] == 0)


def test_moe_matches_a_per_token_loop():
    from plinth.model_registry.layers.moe import FusedMoE

    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(num_experts=5, top_k=2, hidden_size=8, intermediate_size=6, renormalize=False)
    moe.w13_weight.data = torch.randn(5, 12, 8, generator=g)
    moe.w2_weight.data = torch.randn(5, 8, 6, generator=g)
    x, logits = torch.randn(7, 8, generator=g), torch.randn(7, 5, generator=g)
    out = moe(x, logits)
    probs = torch.softmax(logits.double(), -1)
    for t in range(7):
        top = torch.topk(probs[t], 2)
        ref = torch.zeros(8, dtype=torch.float64)
        for w, e in zip(top.values, top.indices, strict=True):
            gate, up = (moe.w13_weight[e].double() @ x[t].double()).chunk(2)
            ref += w * (moe.w2_weight[e].double() @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out[t].double(), ref, atol=1e-4)


@pytest.mark.parametrize("arch,pp_rank,pp_size", [("MistralForCausalLM", 0, 1), ("MistralForCausalLM", 0, 2),
                                                  ("MistralForCausalLM", 1, 2), ("LlamaForCausalLM", 0, 1),
                                                  ("Qwen3MoeForCausalLM", 0, 1), ("Gemma3ForCausalLM", 0, 1)])
def test_tensor_parallel_layers_leave_each_reduction_to_the_norm_after_it(arch, pp_rank, pp_size):
    """Under TP a layer returns its dense MLP's partial sums and the next norm reduces them (the final norm
    after the last layer); a stage without the final norm, a down-projection with a bias and an MoE block
    reduce their own output; an output projection with a bias keeps its reduction; Gemma 3's norm on each
    block's output needs the reduced sums, so its layers reduce in the projections."""
    _, config_cls, overrides = ARCHS[arch]
    overrides = {k: v for k, v in overrides.items() if k != "layer_types"}
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "num_hidden_layers": 4})
    ctx = ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=TorchSDPABackend(), block_size=4, tp_rank=0, tp_size=2,
                       pp_rank=pp_rank, pp_size=pp_size)
    model = ModelRegistry.resolve(arch)(ctx).model
    built = [layer for layer in model.layers if hasattr(layer, "defer_output")]
    deferred = [layer.defer_output for layer in built]
    assert [layer.reduce_input for layer in built] == [False] + deferred[:-1]
    assert model.reduce_final == (model.norm is not None and deferred[-1])
    if arch == "MistralForCausalLM":
        assert len(built) == 4 // pp_size
        assert deferred == [True] * (len(built) - 1) + [model.norm is not None]
        assert all(layer.fuse_attention_reduce for layer in built)
    elif arch == "LlamaForCausalLM":   # attention_bias and mlp_bias
        assert deferred == [False] * 4 and not any(layer.fuse_attention_reduce for layer in built)
    elif arch == "Gemma3ForCausalLM":
        assert deferred == [False] * 4 and not model.reduce_final
        assert all(isinstance(layer, SandwichDecoderLayer) for layer in built)
    else:   # Qwen3-MoE: layer 1 is dense (mlp_only_layers), the others are MoE
        assert deferred == [False, True, False, False]


@pytest.mark.parametrize("arch", ["Olmo2ForCausalLM", "OlmoeForCausalLM"])
def test_olmo2_refuses_tensor_parallelism(arch):
    """Its q/k norms take every head of a token: a rank holding some of the heads cannot compute them."""
    _, config_cls, overrides = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    ctx = ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=TorchSDPABackend(), block_size=4, tp_rank=0, tp_size=2)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism is not supported"):
        ModelRegistry.resolve(arch)(ctx)


def test_gemma_norm_matches_transformers_in_bfloat16():
    """The stored ``1 + w`` stays float32 in a bfloat16 model: the output is Gemma's reference bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from plinth.model_registry.layers.layernorm import GemmaRMSNorm

    torch.manual_seed(0)
    ref = Gemma3RMSNorm(64, eps=1e-6)
    ref.weight.data = torch.randn(64) * 0.3
    ours = GemmaRMSNorm(64, eps=1e-6)
    ours.weight.weight_loader(ours.weight, ref.weight.data.to(torch.bfloat16))   # as a bf16 checkpoint holds it
    ref.weight.data = ref.weight.data.to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    residual = torch.randn(7, 64).to(torch.bfloat16)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), ref(x))
    out, h = ours(x, residual)
    assert torch.equal(h, x + residual) and torch.equal(out, ref(x + residual))
    # rounding 1 + w to bfloat16 first (what a bfloat16 parameter would hold) gives other bits
    assert not torch.equal((x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16) * ours.weight.to(torch.bfloat16), ref(x))


NEW_NATIVE = ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM",
              "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GptOssForCausalLM",
              "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
              "Glm4MoeForCausalLM", "Dots1ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM",
              "Ernie4_5_MoeForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "StableLmForCausalLM",
              "StableLmParallel", "PhiForCausalLM"]


def save_with_tokenizer(name: str, path) -> tuple[transformers.PreTrainedModel, list[list[int]]]:
    """A random model of ``ARCHS[name]`` with the tests' tokenizer saved in ``path``; the model and prompts."""
    from conftest import make_tokenizer

    arch, config_cls, overrides = ARCHS[name]
    tokenizer = make_tokenizer()
    # eager attention: some transformers releases run Gemma 2 through SDPA, which drops its attention soft cap
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "vocab_size": len(tokenizer),
                                                  "eos_token_id": tokenizer.eos_token_id, "pad_token_id": 0,
                                                  "bos_token_id": tokenizer.bos_token_id},
                                               attn_implementation="eager")
    torch.manual_seed(99)
    hf = follow_config_swiglu(randomize_zero_parameters(getattr(transformers, arch)(config).eval()))
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf, _prompts(config.vocab_size)


def engine_matches_transformers(name: str, path, device: str, **engine_kw) -> None:
    """Greedy tokens of plinth's engine on ``device`` equal transformers' ``generate`` (float32)."""
    import plinth

    hf, prompts = save_with_tokenizer(name, path)
    llm_greedy_matches(plinth.LLM(str(path), dtype="float32", max_model_len=128, **engine_kw), hf.to(device), prompts)


def llm_greedy_matches(llm, hf: transformers.PreTrainedModel, prompts: list[list[int]], max_tokens: int = 12) -> None:
    """``llm``'s greedy tokens for ``prompts`` (``ignore_eos``) equal transformers' argmax at each step (a plain loop:
    ``generate`` with ``min_new_tokens`` would forbid the end-of-sequence token that ``ignore_eos`` keeps)."""
    import plinth

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        plinth.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    device = next(hf.parameters()).device
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_tokens):
                ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]


@pytest.mark.parametrize("name", NEW_NATIVE)
def test_engine_on_the_cpu_path_matches_transformers(name, tmp_path):
    """The whole engine (the CPU platform's attention backend and linear layers, batching, prefix cache) on the
    new native architectures: greedy tokens equal transformers' ``generate``."""
    engine_matches_transformers(name, tmp_path, "cpu")


def test_phi3_fp8_checkpoint_splits_its_scales(tmp_path):
    """An FP8 checkpoint of Phi-3 (per-channel scales on the fused qkv_proj and gate_up_proj): the scales split
    with the rows, and the logits equal transformers' on the dequantized weights."""
    import json

    from safetensors.torch import load_file, save_file

    _, config_cls, overrides = ARCHS["Phi3ForCausalLM"]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(3)
    hf = transformers.Phi3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    state, out = load_file(tmp_path / "model.safetensors"), {}
    for name, w in state.items():
        if name.endswith(".weight") and w.dim() == 2 and (".self_attn." in name or ".mlp." in name):
            scale = w.abs().amax(1).float() / 448.0                   # one per output channel
            q = (w / scale[:, None]).to(torch.float8_e4m3fn)
            out[name], out[name[:-len("weight")] + "weight_scale"] = q, scale
            state[name] = q.float() * scale[:, None]                  # what the reference computes with
        else:
            out[name] = w
    save_file(out, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf.load_state_dict(state)
    import plinth

    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128)
    prompt = _prompts(config.vocab_size)[2]
    got = llm.generate([{"prompt_token_ids": prompt}], plinth.SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0].prompt_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(_hf_logits(hf, prompt).double(), -1)
    diffs = [abs(got[i][t].logprob - ref[i - 1, t].item()) for i, t in enumerate(prompt) if i]
    assert max(diffs) < 1e-4, max(diffs)   # the CPU runs the dequantized weights


def test_mixture_of_experts_with_another_activation_is_refused(tmp_path):
    _, config_cls, overrides = ARCHS["MixtralForCausalLM"]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "hidden_act": "gelu"})
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="SiLU-gated experts; the config's activation .hidden_act. is 'gelu'"):
        _load(str(tmp_path), TorchSDPABackend())


@pytest.mark.parametrize("context", [64, 256])
def test_phi3_longrope_takes_the_factors_of_the_engines_context(tmp_path, context):
    """longrope: the short factors while the engine's context stays within the original 64 positions, the long
    ones beyond (fixed for the run, as llama.cpp does); each equals transformers where transformers uses the
    same factors (prompts shorter, and a prompt longer, than the original context)."""
    _, config_cls, overrides = ARCHS["Phi3ForCausalLM"]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.5, "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [2.0 + 0.7 * i for i in range(4)]}
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, "rope_parameters": rope,
                                                  "max_position_embeddings": 256, "original_max_position_embeddings": 64})
    torch.manual_seed(11)
    hf = transformers.Phi3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    backend = TorchSDPABackend()
    model = _load(str(tmp_path), backend, max_model_len=context)
    PagedDriver(model, backend, block_size=4)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, config.vocab_size, (30 if context == 64 else 90,), generator=g).tolist()
    ids, pos, md = build_metadata([(prompt, 0, list(range(1, 24)))], block_size=4)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, pos, md))
    ref = _hf_logits(hf, prompt)
    assert (ours - ref).abs().max().item() < 1e-4
    # and the other factors would have given other logits
    other = _load(str(tmp_path), backend, max_model_len=256 if context == 64 else 64)
    PagedDriver(other, backend, block_size=4)
    with torch.inference_mode():
        assert (other.compute_logits(other(ids, pos, md)) - ref).abs().max().item() > 1e-2


def _image_text_model(kind: str):
    """A tiny image-and-text model of transformers (its language model's weights made decisive)."""
    if kind == "gemma3":
        # (no final logit cap: Gemma3ForConditionalGeneration does not apply one; Gemma 3's configs have none)
        text = transformers.Gemma3TextConfig(**{**COMMON, **ARCHS["Gemma3ForCausalLM"][2],
                                                "final_logit_softcapping": None})
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                           mm_tokens_per_image=4, image_token_index=1000, boi_token_index=1001,
                                           eoi_token_index=1002)
        cls = transformers.Gemma3ForConditionalGeneration
    else:   # a Llava model over a Llama language model with its own LM head
        text = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": False})
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14,
                                               projection_dim=32)
        config = transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                          image_token_index=1000)
        cls = transformers.LlavaForConditionalGeneration
    torch.manual_seed(21)
    return cls(config).eval()


@pytest.mark.parametrize("kind", ["gemma3", "llava"])
def test_the_language_model_of_an_image_and_text_checkpoint_runs_alone(tmp_path, kind):
    """Gemma 3 (4B and up) and Llava checkpoints: the language model runs natively from its text_config, its
    tensors read under the causal LM's names, the vision tower's skipped; logits equal transformers' on text."""
    hf = _image_text_model(kind)
    hf.save_pretrained(tmp_path)
    source = resolve_model_source(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert source.text_only and source.architecture == ("Gemma3ForCausalLM" if kind == "gemma3" else "LlamaForCausalLM")
    backend = TorchSDPABackend()
    model = _load(str(tmp_path), backend)
    PagedDriver(model, backend, block_size=4)
    prompt = _prompts(COMMON["vocab_size"])[2]
    ids, pos, md = build_metadata([(prompt, 0, [3, 9, 1, 7, 5])], block_size=4)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, pos, md))
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


def test_graph_blocker_names_experts_without_grouped_gemms():
    """Where the experts would read their routing on the host (no grouped GEMMs: CPUs, GPUs before sm90), the
    engine is told not to capture decode graphs; a dense model has no such module."""
    from plinth.model_registry.layers.moe import FusedMoE
    from plinth.worker.setup import graph_blocker

    moe = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedMoE(4, 2, 16, 32, renormalize=True))
    assert graph_blocker(moe, torch.device("cpu"), torch.float32) == "FusedMoE (1)"
    assert graph_blocker(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.device("cpu"), torch.float32) is None


def test_decode_graphs_through_experts_on_the_triton_kernels(monkeypatch):
    """On a CUDA device, experts without grouped GEMMs (float32; FP8; integer codes) are captured in decode graphs of
    every size: the GEMV kernel takes a few rows, the Triton grouped kernel more, neither reads the routing on the
    host. Experts the kernels cannot read (act order) block the graphs; so does a ROCm build for FP8 experts
    (Triton there widens float8_e4m3fnuz)."""
    from test_fp8_experts import _expert_weights, _load_fp8_experts, _moe

    from plinth.kernels import ops
    from plinth.model_registry.layers import moe as moe_module
    from plinth.model_registry.layers.moe import FusedMoE
    from plinth.worker.setup import graph_blocker

    cuda = torch.device("cuda")
    monkeypatch.setattr(moe_module, "_capability", lambda _device: (9, 0))
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    float_experts = FusedMoE(16, 4, 16, 32, renormalize=True)
    fp8 = _moe(8, 2, 48, 64)
    _load_fp8_experts(fp8, None, _expert_weights(8, 48, 64))
    assert float_experts.graph_capturable(cuda, torch.float32) and fp8.graph_capturable(cuda, torch.bfloat16)
    assert not float_experts.graph_capturable(torch.device("cpu"), torch.float32)
    model = torch.nn.Sequential(float_experts, fp8)
    assert graph_blocker(model, cuda, torch.float32) is None
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not fp8.graph_capturable(cuda, torch.bfloat16) and float_experts.graph_capturable(cuda, torch.float32)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with monkeypatch.context() as off:   # PLINTH_FUSED_OPS=0: the per-expert loop, which reads the routing
        off.setattr(ops, "_env_enabled", lambda: False)
        assert not float_experts.graph_capturable(cuda, torch.float32) and graph_blocker(model, cuda, torch.float32)
    monkeypatch.setattr(type(fp8.weight_method), "gemv_args", lambda self, layer, which: None)   # e.g. act order
    assert not fp8.graph_capturable(cuda, torch.bfloat16) and graph_blocker(model, cuda, torch.float32) == "FusedMoE (1)"


def test_qwen2_moe_without_qkv_biases_and_granite_moe_missing_tensor_named_once(tmp_path):
    """A Qwen2-MoE config may turn its q/k/v biases off (``qkv_bias``; they were always expected); a GraniteMoe
    checkpoint missing a stacked expert tensor names it once (every expert's shard comes from it)."""
    from safetensors.torch import load_file, save_file

    from plinth.errors import ModelLoadError

    _, config_cls, overrides = ARCHS["Qwen2MoeForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**COMMON, **overrides}, qkv_bias=False,
                                                                      attn_implementation="eager")).eval()
    assert hf.model.layers[0].self_attn.q_proj.bias is None
    hf.save_pretrained(tmp_path / "q")
    model = _load(str(tmp_path / "q"), TorchSDPABackend())
    prompt = _prompts(hf.config.vocab_size)[2]
    assert (paged_prefill_logits(model, model.ctx.attention_backend, prompt)
            - _hf_logits(hf, prompt)).abs().max().item() < 1e-4
    _, config_cls, overrides = ARCHS["GraniteMoeForCausalLM"]
    transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(**{**COMMON, **overrides})).save_pretrained(
        tmp_path / "g")
    tensors = load_file(tmp_path / "g" / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.input_linear.weight"]
    save_file(tensors, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        _load(str(tmp_path / "g"), TorchSDPABackend())
    assert str(err.value).endswith("checkpoint is missing tensor 'model.layers.1.block_sparse_moe.input_linear.weight'")


def test_qwen2_moe_without_a_shared_expert_matches_transformers(tmp_path):
    """``shared_expert_intermediate_size: 0``: transformers still writes the empty shared projections and their gate
    (which multiplies nothing); they are skipped, and the logits are transformers'."""
    _, config_cls, overrides = ARCHS["Qwen2MoeForCausalLM"]
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(**{**COMMON, **overrides, "shared_expert_intermediate_size": 0},
                                      attn_implementation="eager")
    hf = transformers.Qwen2MoeForCausalLM(cfg).eval()
    assert hf.model.layers[0].mlp.shared_expert.down_proj.weight.numel() == 0
    hf.save_pretrained(tmp_path)
    model = _load(str(tmp_path), TorchSDPABackend())
    assert model.model.layers[0].mlp.shared_expert is None
    prompt = _prompts(hf.config.vocab_size)[2]
    assert (paged_prefill_logits(model, model.ctx.attention_backend, prompt)
            - _hf_logits(hf, prompt)).abs().max().item() < 1e-4


def test_ernie_moe_skips_its_multi_token_prediction_tensors_and_refuses_an_lm_head_bias(tmp_path):
    """ERNIE 4.5 MoE checkpoints carry multi-token-prediction tensors (``mtp*``): skipped, not reported unknown; a
    config with use_bias (which would give the LM head a bias) is refused in one line."""
    from safetensors.torch import load_file, save_file

    arch, config_cls, overrides = ARCHS["Ernie4_5_MoeForCausalLM"]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(0)
    transformers.Ernie4_5_MoeForCausalLM(cfg).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    save_file({**tensors, "model.mtp_block.0.input_layernorm.weight": torch.ones(64),
               "model.mtp_linear_proj.0.weight": torch.ones(64, 128)}, file, metadata={"format": "pt"})
    _load(str(tmp_path), TorchSDPABackend())
    cfg.use_bias = True
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        _load(str(tmp_path), TorchSDPABackend())
