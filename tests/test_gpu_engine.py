"""Engine-level checks on a CUDA GPU (skipped elsewhere): the Triton backend and CUDA-graph replay give
the same greedy tokens as the reference backend, eager execution, and transformers."""

from __future__ import annotations

import pytest
import torch

from plinth import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is",
    "Large language models generate text one token at a time. Continuous batching keeps",
    "0123",
    "Caf\u00e9 na\u00efve",
] * 3
MAX_TOKENS = 24


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(model_dir, **kw) -> tuple[list[list[int]], LLM]:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 16)
    llm = LLM(str(model_dir), **kw)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).cuda().eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_triton_with_graphs_matches_transformers(tiny_llama_dir, reference):
    tokens, llm = run(tiny_llama_dir, attention_backend="triton")
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    assert tokens == reference


def test_graph_replay_equals_eager(tiny_llama_dir):
    for dtype in ("float32", "bfloat16"):
        graphs, _ = run(tiny_llama_dir, attention_backend="triton", dtype=dtype)
        eager, llm = run(tiny_llama_dir, attention_backend="triton", dtype=dtype, enforce_eager=True)
        assert llm.engine.runner.graphs is None
        assert graphs == eager, dtype


def test_reference_backend_on_gpu(tiny_llama_dir, reference):
    tokens, _ = run(tiny_llama_dir, attention_backend="torch_sdpa")
    assert tokens == reference


def test_preemption_and_chunked_prefill_on_gpu(tiny_llama_dir, reference):
    tokens, llm = run(tiny_llama_dir, attention_backend="triton", num_blocks=24, block_size=4,
                      enable_prefix_caching=False, max_num_batched_tokens=16)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert tokens == reference


def test_prefix_cache_on_gpu(tiny_llama_dir, reference):
    tokens, llm = run(tiny_llama_dir, attention_backend="triton", block_size=4)
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    assert llm.engine.block_manager.stats.hit_tokens > 0
    assert tokens == again == reference


def test_kv_cache_sizing_respects_memory_fraction():
    """The KV cache fills the configured fraction of device memory, and a busy run stays within it."""
    import numpy as np

    fraction = 0.3
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", gpu_memory_utilization=fraction,
              max_model_len=4096, max_num_seqs=64)
    total = torch.cuda.get_device_properties(0).total_memory
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(512, 2048, 64)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    peak = torch.cuda.max_memory_reserved(0)
    assert peak <= fraction * total, (peak / 2**30, fraction * total / 2**30)
    # and the cache takes most of what is left (not a token amount)
    assert llm.engine.runner.kv_cache_bytes > 0.5 * (fraction * total - 16.1e9)
    del llm
    torch.cuda.empty_cache()


def test_async_scheduling_on_gpu(tiny_llama_dir, reference):
    """One step in flight (the default on a GPU): graphs, eager steps, preemption with chunked prefill,
    and early stops give the synchronous engine's tokens."""
    for kw in (dict(), dict(enforce_eager=True),
               dict(num_blocks=24, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16)):
        tokens, llm = run(tiny_llama_dir, attention_backend="triton", **kw)
        assert llm.engine.async_scheduling, kw
        assert tokens == reference, kw
    sync = LLM(str(tiny_llama_dir), dtype="float32", attention_backend="triton", async_scheduling=False)
    assert not sync.engine.async_scheduling
    stop_id = reference[1][5]
    for params in (SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]),
                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
        a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        s = [o.outputs[0].token_ids for o in sync.generate(PROMPTS, params, use_tqdm=False)]
        assert a == s
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("name", ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                                  "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                                  "GptOssForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                                  "Glm4MoeForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM"])
def test_newer_architectures_on_triton_with_graphs_match_transformers(name, tmp_path):
    """Gemma's norms and scaled embeddings, Gemma 2's attention-logit soft cap in the Triton kernels, Gemma 3's
    sandwich norms, sliding layers with their own RoPE and final soft cap, Phi-3's partial rotary (the Triton
    backend then rotates outside its kernel), SmolLM3's layers without RoPE (the fused decode kernel then rotates
    nothing), Granite's multipliers, gpt-oss's sinks in the Triton kernels and its biased experts, mixture-of-experts layers
    in the captured decode graphs (grouped GEMMs): greedy tokens equal transformers' on the GPU."""
    from test_models import engine_matches_transformers

    engine_matches_transformers(name, tmp_path, "cuda", attention_backend="triton")


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("name", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_deepseek_latent_attention_on_the_gpu_matches_transformers(name, backend, tmp_path, monkeypatch):
    """DeepSeek's latent attention and its routing on the GPU, decode graphs where the experts allow them: greedy
    tokens equal transformers'. With selection, a one-head cache of 40 features (a torch backend); with the Triton
    kernels, 48 (their sizes are multiples of 16), stored once."""
    from test_models import ARCHS, engine_matches_transformers

    kw = {}
    if backend is not None:
        monkeypatch.setitem(ARCHS[name][2], "kv_lora_rank", 40)
        kw = dict(attention_backend=backend, selection="off")
    engine_matches_transformers(name, tmp_path, "cuda", **kw)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [3, 37])
def test_grouped_experts_equal_the_per_expert_loop_and_replay_in_a_graph(bias, tokens):
    """The experts' device paths, the per-slot GEMV kernel (3 tokens x top 2 of 8 experts) and the grouped GEMMs
    (sm90+, bfloat16; 37 tokens), against the per-expert loop on the same weights, with biases and gpt-oss's
    activation; then captured in a CUDA graph and replayed on new inputs (no host read of the routing). float32
    experts are captured too (the GEMV kernel, or the Triton grouped kernel for more rows)."""
    dtype = torch.bfloat16
    from plinth.model_registry.layers.moe import FusedMoE

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped GEMMs need compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)

    def act(gate, up):
        return (up.clamp(-1, 1) + 1) * gate * torch.sigmoid(gate)

    moe = FusedMoE(8, 2, 64, 96, renormalize=True, bias=bias, activation=act if bias else None).cuda()
    for p in moe.parameters():
        p.data = (torch.randn(p.shape, generator=g, device="cuda") * 0.1).to(dtype)
    x = torch.randn(tokens, 64, generator=g, device="cuda").to(dtype)
    logits = torch.randn(tokens, 8, generator=g, device="cuda")
    assert moe.uses_gemv(x) == (tokens == 3) and moe.uses_grouped_gemm(x) and moe.graph_capturable(x.device, dtype)
    grouped = moe(x, logits)
    moe.uses_grouped_gemm = moe.uses_gemv = moe.uses_grouped_kernel = lambda _x: False
    loop = moe(x, logits)
    del moe.uses_grouped_gemm, moe.uses_gemv, moe.uses_grouped_kernel
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)
    assert not moe.uses_grouped_gemm(x.float()) and moe.graph_capturable(x.device, torch.float32)
    static_x, static_logits = x.clone(), logits.clone()
    moe(static_x, static_logits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static_x, static_logits)
    static_x.copy_(torch.randn(tokens, 64, generator=g, device="cuda").to(dtype))
    static_logits.copy_(torch.randn(tokens, 8, generator=g, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, moe(static_x, static_logits), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["fp8-block", "fp8-channel", "gptq"])
def test_quantized_experts_on_the_gpu_match_transformers(kind, tmp_path):
    """Quantized experts through the whole engine on the GPU (kernel selection, the FP8 experts' GEMV for decode
    rows, widening per chosen expert for prefill, CUDA graphs where the experts allow them): greedy tokens equal
    transformers' on the weights the checkpoint decodes to; decode steps replay graphs through the experts' Triton
    kernels (``gptq`` here has act order, which the kernels cannot read)."""
    import transformers
    from test_fp8_experts import fp8_checkpoint
    from test_int_experts import _reference
    from test_models import _prompts, llm_greedy_matches, save_with_tokenizer
    from test_quantization_awq_gptq import gptq_checkpoint

    save_with_tokenizer("Qwen3MoeForCausalLM", tmp_path / "float")
    if kind == "gptq":
        path, deq = gptq_checkpoint(tmp_path / "float", tmp_path / "q", 4, 32, True, True, "gptq")
        ref = _reference(tmp_path / "float", deq, tmp_path / "ref")
    else:
        path, ref_dir = fp8_checkpoint(tmp_path / "float", tmp_path / "q", kind.removeprefix("fp8-"))
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    assert torch.device(llm.engine.device).type == "cuda"
    assert (llm.engine.runner.graphs is None) == (kind == "gptq")
    llm_greedy_matches(llm, ref.cuda(), _prompts(ref.config.vocab_size))


@pytest.mark.parametrize("path", ["kernel", "widened"])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_experts_on_widened_grouped_gemms(block, path):
    """FP8 experts in bfloat16 on a 9.0+ GPU: a prefill-sized step (token copies above the expert count) takes the
    Triton grouped kernel (widening weight tiles in registers), or the grouped GEMMs over runs of widened experts;
    each equals the per-expert loop."""
    from test_fp8_experts import _expert_weights, _load_fp8_experts, _moe

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped GEMMs need compute capability 9.0")
    moe = _moe(8, 2, 256, 512)
    _load_fp8_experts(moe, block, _expert_weights(8, 256, 512, seed=4))
    moe = moe.cuda()
    moe.fp8_scales = {k: type(v)(v.scale.cuda(), v.rows, v.cols) for k, v in moe.fp8_scales.items()}
    moe.widen_chunk_elements = 3 * 256 * 512 * 2
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(40, 256, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(40, 8, generator=g, device="cuda")
    assert moe.uses_widened_grouped_gemm(x) and moe.uses_grouped_kernel(x) and not moe.uses_gemv(x)
    if path == "widened":
        moe.uses_grouped_kernel = lambda _x: False
    got = moe(x, logits)
    moe.uses_widened_grouped_gemm = moe.uses_grouped_kernel = lambda _x: False   # the per-expert loop
    loop = moe(x, logits)
    exact = moe(x.float(), logits)   # the loop in float32 on the same widened weights
    # the kernel computes silu(gate) * up in float32 (the loop rounds it to bfloat16 twice): at least as close
    got_err, loop_err = (got.float() - exact).abs().max(), (loop.float() - exact).abs().max()
    assert got_err <= 1.25 * loop_err + 1e-3, (got_err, loop_err)
    assert (got.float() - exact).norm() / exact.norm() < 2e-2   # bfloat16's rounding, relative RMS


@pytest.mark.parametrize("group", [128, 32])
def test_int4_experts_on_the_grouped_kernel(group):
    """4-bit experts (groups of 128, which cover a 64-wide K tile, and of 32, which do not) in bfloat16 on the Triton
    grouped kernel (a prefill-sized step) equal the per-expert loop on the same codes."""
    from plinth.model_registry.layers.moe import FusedMoE
    from plinth.quantization.int_experts import IntExpertMethod
    from plinth.quantization.quantizers import quantize_int_rtn

    class Int4:
        @staticmethod
        def float_weights(weight):
            return quantize_int_rtn(weight, 4, group)

    g = torch.Generator().manual_seed(group)
    with torch.device("cuda"):
        moe = FusedMoE(8, 2, 256, 512, renormalize=True)
    moe.load_state_dict({"w13_weight": torch.randn(8, 1024, 256, generator=g) * 0.05,
                         "w2_weight": torch.randn(8, 256, 512, generator=g) * 0.05})
    method = IntExpertMethod(Int4(), from_checkpoint=False)
    method.create_weights(moe)
    moe.weight_method = method
    method.process_weights_after_loading(moe)
    x = torch.randn(40, 256, generator=g).cuda().to(torch.bfloat16)
    logits = torch.randn(40, 8, generator=g).cuda()
    assert moe.uses_grouped_kernel(x)
    got = moe(x, logits)
    moe.uses_widened_grouped_gemm = moe.uses_grouped_kernel = lambda _x: False   # the per-expert loop
    exact = moe(x.float(), logits)
    assert (got.float() - exact).norm() / exact.norm() < 2e-2   # bfloat16's rounding, relative RMS
