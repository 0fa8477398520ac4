"""Llama 4 (``Llama4ForCausalLM``, and the language model of ``Llama4ForConditionalGeneration`` checkpoints) against
transformers running the same random weights (float32), and chunked local attention (the metadata view every backend
runs) against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import transformers
from attention_batches import make_batch, reference_attention
from conftest import make_tokenizer
from test_mamba_models import _greedy, _hits, _prompts, engine_greedy_matches, hf_greedy

import plinth
from plinth.attention_backends.cpu_paged import CpuPagedBackend
from plinth.attention_backends.interface import AttentionSpec, chunked_attention_view
from plinth.attention_backends.torch_batched import TorchBatchedBackend
from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ConfigError
from plinth.errors import ModelLoadError, UnsupportedModelError

#: four layers: chunked RoPE attention with q/k norms on 0 and 2, NoPE full attention on 1 and 3 (queries scaled from
#: position 3 on: floor_scale 4), experts on 1 and 3; 8-position chunks, so prompts and decodes cross boundaries
_TEXT = dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
             interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
             no_rope_layer_interval=2, max_position_embeddings=256)


@torch.no_grad()
def _randomize(hf: transformers.PreTrainedModel) -> None:
    """Routers that prefer experts clearly, norms away from 1, experts of a size that matters."""
    g = torch.Generator().manual_seed(3)
    for name, p in hf.named_parameters():
        if name.endswith("router.weight"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif ".experts." in name:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _text_config(tokenizer, **overrides) -> dict:
    return dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                bos_token_id=tokenizer.bos_token_id, **{**_TEXT, **overrides})


def save_model(path, **overrides) -> transformers.PreTrainedModel:
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**_text_config(tokenizer, **overrides), attn_implementation="eager")
    hf = transformers.Llama4ForCausalLM(cfg).eval()
    _randomize(hf)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def _check(outs, want) -> None:
    for out, (tokens, lps) in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == tokens
        assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)


_SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=8)
_BACKENDS = [b for b in (TorchSDPABackend, TorchBatchedBackend, CpuPagedBackend) if b.check(_SPEC, "cpu")]


@pytest.mark.parametrize("backend", _BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("seqs", [[(50, 1), (31, 1), (6, 1), (32, 1)], [(40, 1), (0, 37), (17, 20), (20, 12)]],
                         ids=["decode", "mixed"])
def test_chunked_view_on_the_cpu_backends(backend, seqs):
    """Each CPU backend through the chunked view (16-position chunks, 8-token blocks shuffled)
    equals a float64 attention masked to each query's chunk: decodes at and past a boundary, prompts and
    continuations that cross one or two."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=8,
                       pad_tokens=0, seed=5)
    # slots no sequence owns hold large values instead of NaN (torch_batched masks the padded keys it gathers,
    # and 0 x NaN is NaN): a backend that attends to one still fails
    batch.kv_cache.nan_to_num_(nan=1e4)
    impl = backend()
    impl.prepare(batch.metadata)
    view = chunked_attention_view(batch.metadata, 16, 8, impl)
    assert chunked_attention_view(batch.metadata, 16, 8, impl) is view   # made once per step
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, view, scale=0.125)
    want = reference_attention(batch, 0.125, None, chunk=16)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    # without the view the same call attends to whole sequences: the check above can fail
    whole = reference_attention(batch, 0.125, None)
    assert not torch.allclose(whole, want, atol=1e-3)
    with pytest.raises(ValueError, match="not a multiple of the 12-token blocks"):
        chunked_attention_view(batch.metadata, 16, 12)


def test_engine_matches_transformers(tmp_path):
    """Greedy tokens and their log-probabilities equal transformers' for prompts of 1 to 33 tokens (16 tokens a
    step, 4-token blocks, so prompt chunks and decodes cross the 8-position attention chunks), then again with every
    prompt from the prefix cache."""
    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
                     block_size=4)
    model = llm.engine.runner.model
    assert [layer.self_attn.attn.attention_chunk for layer in model.model.layers] == [8, None, 8, None]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):
        _check(llm.generate(reqs, _greedy(logprobs=0), use_tqdm=False), want)
    assert _hits(llm) == sum((len(p) - 1) // 4 * 4 for p in prompts)
    llm.close()


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_batched"])
def test_other_cpu_backends(backend, tmp_path):
    """The torch backends run the chunked layers too (the engine's default on this machine is covered above)."""
    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size, (19, 33))
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=4,
                     attention_backend=backend)
    _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False),
           [hf_greedy(hf, p) for p in prompts])
    llm.close()


def test_without_qk_norm_and_temperature(tmp_path):
    """Maverick's settings: no q/k norms (the RoPE then fuses into backends that take it), no temperature tuning,
    experts on every layer, NoPE layers listed explicitly; and a config whose ``moe_layers`` is empty (every layer
    dense)."""
    for name, overrides in (("maverick", dict(use_qk_norm=False, attn_temperature_tuning=False,
                                              interleave_moe_layer_step=1, no_rope_layers=[1, 1, 0, 1])),
                            ("dense", dict(moe_layers=[]))):
        hf = save_model(tmp_path / name, **overrides)
        assert hf.config.moe_layers == ([0, 1, 2, 3] if name == "maverick" else [])
        prompts = _prompts(hf.config.vocab_size, (5, 33))
        llm = plinth.LLM(str(tmp_path / name), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                         block_size=4)
        _check(llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False),
               [hf_greedy(hf, p) for p in prompts])
        llm.close()


def test_image_text_checkpoint_runs_its_language_model(tmp_path):
    """A ``Llama4ForConditionalGeneration`` checkpoint (``language_model.*`` tensors, a vision tower) runs its
    language model alone: text prompts give transformers' tokens."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, projector_input_dim=64, projector_output_dim=64, vision_output_dim=64,
                  pixel_shuffle_ratio=0.5)
    cfg = transformers.Llama4Config(text_config=_text_config(tokenizer), vision_config=vision,
                                    attn_implementation="eager")
    hf = transformers.Llama4ForConditionalGeneration(cfg).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine_greedy_matches(tmp_path, hf, _prompts(len(tokenizer), (5, 19)), 8, block_size=4)


def test_tensor_parallel_workers_match_transformers(tmp_path):
    """Two tensor-parallel worker processes (one KV head each, the experts' features split): transformers' tokens."""
    from conftest import generate_on_tp_workers

    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy())
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p)[0] for p in prompts]


def test_pipeline_stages_match_transformers(tmp_path):
    """Two pipeline stages in worker processes (each sets its NoPE layers' query scales from the positions):
    transformers' tokens."""
    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", pipeline_parallel_size=2,
                     distributed_executor="mp", block_size=4, max_model_len=128)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p)[0] for p in prompts]


def test_bfloat16_and_fp8_on_the_cpu_path(tmp_path):
    """bfloat16 and ``--quantization fp8`` (the experts too): the first token's top-3 log-probabilities lie within
    0.02 (bfloat16) and 0.06 (FP8) of transformers' float32 ones for the same tokens. (Greedy tokens are no test here:
    the random model's top two log-probabilities lie 0.01-0.07 apart.)"""
    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        want = [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].double(), -1) for p in prompts]
    for kwargs, tol in ((dict(dtype="bfloat16"), 0.02), (dict(dtype="float32", quantization="fp8"), 0.06)):
        llm = plinth.LLM(str(tmp_path), max_model_len=128, block_size=4, **kwargs)
        if "quantization" in kwargs:
            experts = llm.engine.runner.model.model.layers[1].mlp.experts
            assert experts.weight_method is not None or experts.w13_weight.dtype != torch.float32
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(1, logprobs=3), use_tqdm=False)
        for out, ref in zip(outs, want, strict=True):
            top = out.outputs[0].logprobs[0]
            assert len(top) >= 3
            assert max(abs(lp.logprob - float(ref[t])) for t, lp in top.items()) < tol, kwargs
        llm.close()


def test_unsupported_settings_are_refused_clearly(tmp_path):
    """Two experts per token, a KV block size that does not divide the attention chunk (before any weight loads),
    quantized experts stored stacked, and unknown layer types fail at load with messages that say so."""
    save_model(tmp_path / "k2", num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=2"):
        plinth.LLM(str(tmp_path / "k2"), dtype="float32", max_model_len=128, block_size=4)
    save_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="chunked_attention layers: attention in chunks of 8 tokens, which the "
                                          "16-token KV blocks do not divide"):
        plinth.LLM(str(tmp_path / "m"), dtype="float32", max_model_len=128, block_size=16)
    # quantized experts stored stacked (their scales beside them, or 8-bit stacked tensors)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    name = "model.layers.1.feed_forward.experts.down_proj"
    for extra in ({f"{name}_scale": torch.ones(4, 1, 64)}, {name: tensors[name].to(torch.float8_e4m3fn)}):
        save_file({**tensors, **extra}, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match="experts.*stacked.*plinth reads stacked experts in floating point"):
            plinth.LLM(str(tmp_path / "m"), dtype="float32", max_model_len=128, block_size=4)
    save_model(tmp_path / "t", layer_types=["chunked_attention", "sliding_attention", "full_attention",
                                            "full_attention"])
    with pytest.raises(UnsupportedModelError, match="layer types \\['sliding_attention'\\]"):
        plinth.LLM(str(tmp_path / "t"), dtype="float32", max_model_len=128, block_size=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_matches_transformers(tmp_path):
    """On a GPU, float32: greedy tokens equal transformers' three at a time (decode graphs, which capture the chunked
    view of their steps) and again one after another from the prefix cache."""
    from plinth.worker.cuda_graphs import DecodeGraphRunner

    hf = save_model(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
                     block_size=8, gpu_memory_utilization=0.3)
    assert isinstance(llm.engine.runner.graphs, DecodeGraphRunner)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:3]
    for prompt, tokens in zip(prompts[::-1], want[::-1], strict=True):
        assert llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert _hits(llm) > 0
    llm.close()
