"""DeepSeek-V2/V3: the routing against transformers' routers, the latent cache, checkpoint details and the engine
(the architecture's logits against transformers are in ``test_models.py``, its TP/PP runs in
``test_distributed.py``)."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from test_models import (
    ARCHS,
    COMMON,
    engine_matches_transformers,
    llm_greedy_matches,
    randomize_zero_parameters,
    save_with_tokenizer,
)

from plinth.config import ModelConfig
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source
from plinth.model_registry.models.deepseek import DeepseekExperts, MultiHeadLatentAttention
from plinth.worker.setup import attention_spec


def _ctx(cfg) -> ModelContext:
    return ModelContext(hf_config=cfg, dtype=torch.float32, device=torch.device("cpu"), attention_backend=None,
                        block_size=4)


@pytest.mark.parametrize("version,kw", [
    ("V3", dict(n_group=8, topk_group=3, norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("V3", dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("V2", dict(topk_method="group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0)),
    ("V2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    ("V2", dict(topk_method="greedy", norm_topk_prob=True, routed_scaling_factor=16.0)),   # transformers ignores it
])
def test_routing_matches_transformers_router(version, kw):
    """Experts chosen and their weights equal transformers' router's over many tokens (64 experts in 8 groups)."""
    cfg = getattr(transformers, f"Deepseek{version}Config")(**COMMON, n_routed_experts=64, num_experts_per_tok=6,
                                                            moe_intermediate_size=8, **kw)
    module = importlib.import_module(f"transformers.models.deepseek_{version.lower()}.modeling_deepseek_"
                                     f"{version.lower()}")
    router = getattr(module, f"Deepseek{version}TopkRouter")(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        experts = DeepseekExperts(_ctx(cfg), v3=version == "V3")
        if version == "V3":
            router.e_score_correction_bias.copy_(torch.randn(64, generator=g) * 0.3)
            experts.e_score_correction_bias.copy_(router.e_score_correction_bias)
        x = torch.randn(300, COMMON["hidden_size"], generator=g)
        logits, ref_weights, ref_ids = router(x)
        weights, ids = experts.route(logits)
    ref = [dict(zip(i.tolist(), w.tolist(), strict=True)) for i, w in zip(ref_ids, ref_weights, strict=True)]
    got = [dict(zip(i.tolist(), w.tolist(), strict=True)) for i, w in zip(ids, weights, strict=True)]
    for r, o in zip(ref, got, strict=True):
        assert r.keys() == o.keys()
        assert all(o[e] == pytest.approx(r[e], rel=1e-5, abs=1e-7) for e in r)
    if kw.get("n_group", 1) > 1:   # the groups really restrict the choice: it differs from a top-k over all experts
        choice = logits.sigmoid() + experts.e_score_correction_bias if version == "V3" else logits
        free = choice.topk(6, dim=-1).indices.tolist()
        assert any(set(f) != o.keys() for f, o in zip(free, got, strict=True))


@pytest.mark.parametrize("kw,match", [
    (dict(n_routed_experts=6, n_group=4, topk_group=2), "6 experts in n_group=4"),
    (dict(n_routed_experts=8, n_group=8, topk_group=2), "two best experts"),
    (dict(n_routed_experts=8, n_group=4, topk_group=5), "topk_group=5"),
])
def test_unusable_expert_groups_are_refused(kw, match):
    cfg = transformers.DeepseekV3Config(**COMMON, num_experts_per_tok=2, moe_intermediate_size=8, **kw)
    with pytest.raises(UnsupportedModelError, match=match):
        DeepseekExperts(_ctx(cfg), v3=True)


def test_v2_unknown_routing_is_refused():
    cfg = transformers.DeepseekV2Config(**COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                        topk_method="noaux_tc")
    with pytest.raises(UnsupportedModelError, match="noaux_tc"):
        DeepseekExperts(_ctx(cfg), v3=False)


def _save(name: str, path, **extra):
    arch, config_cls, overrides = ARCHS[name]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides, **extra}, attn_implementation="eager")
    torch.manual_seed(0)
    hf = randomize_zero_parameters(getattr(transformers, arch)(cfg).eval())
    hf.save_pretrained(path)
    return hf


def _load(path):
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend

    source = resolve_model_source(ModelConfig(model=str(path), dtype="float32"))
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=TorchSDPABackend(), block_size=4)
    return load_model(source, ctx)


def test_the_cache_holds_one_latent_head_per_token(tmp_path):
    """Each layer pages kv_lora_rank + qk_rope_head_dim features of one head (40 here), not the expanded keys and
    values of every head (4 x (24 + 12)); selection sees the same shapes."""
    hf = _save("DeepseekV3ForCausalLM", tmp_path)
    model = _load(tmp_path)
    layers = model.attention_layers()
    assert len(layers) == 2 and {(a.num_heads, a.num_kv_heads, a.head_size) for a in layers} == {(4, 1, 40)}
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in model.model.layers)
    spec = attention_spec(hf.config, torch.float32, 4)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (4, 1, 40)


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """V3 checkpoints carry their multi-token-prediction layer after the last decoder layer: it is not loaded (and
    not reported as unknown); a tensor of a real layer missing is still named."""
    from safetensors.torch import load_file, save_file

    _save("DeepseekV3ForCausalLM", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    extra = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.1.")}
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    _load(tmp_path)
    tensors.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate\.e_score_correction_bias"):
        _load(tmp_path)


@pytest.mark.parametrize("name", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_engine_on_the_cpu_path_matches_transformers(name, tmp_path):
    """The whole engine (selection on, batching, prefix cache) on DeepSeek: greedy tokens equal transformers'."""
    engine_matches_transformers(name, tmp_path, "cpu")


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_batched"])
def test_a_backend_that_shares_the_cache_stores_the_latents_once(backend, tmp_path, monkeypatch):
    """With a backend that takes one tensor as both halves of a cache (``shares_kv_cache``: the Triton kernels and
    the torch backends), each latent layer's cache is half the size and the greedy tokens still equal
    transformers'; the memory budget buys twice the blocks."""
    import plinth
    from plinth.attention_backends.torch_batched import TorchBatchedBackend
    from plinth.attention_backends.torch_sdpa import TorchSDPABackend

    cls = {"torch_sdpa": TorchSDPABackend, "torch_batched": TorchBatchedBackend}[backend]
    assert cls.shares_kv_cache

    def cache_of(shared: bool):
        monkeypatch.setattr(cls, "shares_kv_cache", shared)
        engine_matches_transformers("DeepseekV3ForCausalLM", tmp_path / str(shared), "cpu",
                                    attention_backend=backend, selection="off")
        llm = plinth.LLM(str(tmp_path / str(shared)), dtype="float32", max_model_len=128,
                         attention_backend=backend, selection="off", cpu_kv_cache_bytes=1 << 20)
        runner = llm.engine.runner
        return runner.num_blocks, runner.kv_cache_bytes, runner.kv_caches[0]

    blocks, size, cache = cache_of(False)
    shared_blocks, shared_size, shared_cache = cache_of(True)
    assert cache.stride(0) != 0 and shared_cache.stride(0) == 0
    assert shared_cache[0].data_ptr() == shared_cache[1].data_ptr()
    assert shared_blocks == 2 * blocks and shared_size == size


@pytest.mark.parametrize("name", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_bfloat16_on_the_cpu_keeps_the_expansion_weights(name, tmp_path):
    """bfloat16 on the CPU: the linear layers get packed copies and give their own weights back; the latent
    expansion (read by the attention itself) keeps its weight, and greedy tokens follow transformers' float32 ones
    (the first two of each prompt: bfloat16 rounding may part them later)."""
    import plinth

    hf, prompts = save_with_tokenizer(name, tmp_path)
    llm = plinth.LLM(str(tmp_path), dtype="bfloat16", max_model_len=128)
    model = llm.engine.runner.model
    assert all(layer.self_attn.kv_b_proj.weight.numel() > 0 for layer in model.model.layers)
    llm_greedy_matches(llm, hf, prompts, max_tokens=2)


def test_lora_is_refused_in_one_line(tmp_path):
    """DeepSeek's latent attention declares no LoRA-adaptable layers: --enable-lora fails at start-up, naming why."""
    import plinth
    from plinth.config import ConfigError

    save_with_tokenizer("DeepseekV2ForCausalLM", tmp_path)
    with pytest.raises(ConfigError, match="DeepseekV2ForCausalLM declares no layers that take LoRA adapters"):
        plinth.LLM(str(tmp_path), dtype="float32", enable_lora=True)
