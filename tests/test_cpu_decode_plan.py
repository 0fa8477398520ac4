"""The CPU decode plan runs the module path's kernels in the same order: bit-identical logits and tokens."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from cpu_features import needs_packed_bf16

from plinth import LLM, SamplingParams
from plinth.kernels import cpu_native
from plinth.worker.batching import FlatBatch
from plinth.worker.cpu_decode_plan import CpuDecodePlan
from plinth.worker.model_runner import SeqBatchEntry

pytestmark = pytest.mark.skipif(cpu_native.load_library().library is None,
                                reason=f"native CPU ops unavailable: {cpu_native.load_library().reason}")

PROMPTS = [[5, 17, 99], list(range(20, 61)), list(range(100, 117)), [7] * 9, [1, 2], list(range(200, 290))]


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="bfloat16", block_size=4, attention_backend="cpu_paged", **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with make_llm(tiny_llama_dir) as llm:
        yield llm


def test_plan_is_installed(llm):
    assert isinstance(llm.engine.runner.graphs, CpuDecodePlan)


def _plan_equals_modules(llm: LLM, n: int, tag: str, prompts: list[list[int]] = PROMPTS) -> None:
    """Same decode batch through the plan and through the modules: the same logits, bit for bit (both
    write the same keys and values to the same slots, so the order does not matter)."""
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(prompts[:n]):
        engine.add_request(f"{tag}{n}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    reqs = [engine._seqs[f"{tag}{n}-{i}"].request for i in range(n)]
    for _ in range(12):   # decode until every sequence's next token has a slot in the blocks it holds
        engine.step()
        if all(r.output_token_ids and r.num_computed_tokens < 4 * len(r.block_ids) for r in reqs):
            break
    assert all(r.num_computed_tokens < 4 * len(r.block_ids) for r in reqs)
    entries = [SeqBatchEntry([r.output_token_ids[-1]], r.num_computed_tokens, list(r.block_ids), True) for r in reqs]
    plan = runner.graphs
    via_plan, rows, _ = runner.execute(FlatBatch.from_entries(entries))
    assert rows == list(range(n))
    runner.graphs = None
    try:
        via_modules, _, _ = runner.execute(FlatBatch.from_entries(entries))
    finally:
        runner.graphs = plan
    assert via_plan.dtype == via_modules.dtype == torch.float32
    assert torch.equal(via_plan, via_modules)
    engine.abort_request([f"{tag}{n}-{i}" for i in range(n)])
    while engine.has_unfinished_requests():
        engine.step()


def _python_loop_equals_modules(llm: LLM, ns: tuple[int, ...], tag: str, prompts: list[list[int]]) -> None:
    """:func:`_plan_equals_modules` for each batch size in ``ns`` with the fused native step set aside: the plan's
    Python loop over the same kernels."""
    plan = llm.engine.runner.graphs
    fused, plan.fused_layers = plan.fused_layers, None
    try:
        for n in ns:
            _plan_equals_modules(llm, n, tag, prompts)
    finally:
        plan.fused_layers = fused


@pytest.mark.parametrize("n", [1, 3, 6])
def test_plan_logits_equal_the_module_path(llm, n):
    _plan_equals_modules(llm, n, "p")


@needs_packed_bf16
def test_plan_with_int4_copies_equals_the_module_path(tmp_path_factory, monkeypatch, tiny_llama_dir):
    """A GGUF Q4_1 model keeps 4-bit copies of its layers: steps of up to ``Q4_GEMV_MAX_ROWS`` rows run every
    layer in one native call (the native GEMV on the copies), and the plan's Python loop calls one-row copies
    directly and the layers' own routing otherwise; all bit-identical to the module path."""
    from test_gguf import small_model, write_gguf

    tmp = tmp_path_factory.mktemp("q4plan")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp / "cache"))
    path = write_gguf(tmp / "m.gguf", small_model("llama", True), "llama", gguf.GGMLQuantizationType.Q4_1)
    with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4,
             attention_backend="cpu_paged") as llm:      # the small model's vocabulary is 128: PROMPTS[:3] fit
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan)
        assert all(set(lay.int4_copies) == {"qkv", "o", "gate_up", "down"} for lay in plan.layers)
        assert (plan.fused_layers is not None) == cpu_native.q4_gemv_supported()
        # with AMX tiles the fused step takes any batch (rows past the GEMV's on the AMX panel GEMM)
        amx = cpu_native.q4_amx_supported()
        assert plan.amx == amx
        assert plan.fused_max_rows == (plan.max_size if amx else cpu_native.Q4_GEMV_MAX_ROWS
                                       if cpu_native.q4_gemv_supported() else 0)
        # lengths alike modulo the 4-token block: every sequence then has a free slot at the same steps
        small_vocab = [[(7 * i + j) % 120 + 3 for j in range(3 + 4 * (i % 12))] for i in range(20)]
        # past the int4 row limit the layers' own routing sends rows to the GEMV too; with AMX, past
        # Q4_GEMV_AMX_MAX_ROWS rows to the AMX panel GEMM, in the fused step as in the layers' routing
        for n in (1, 3, 5, 12, 20):
            _plan_equals_modules(llm, n, "q", small_vocab)   # all layers in one native call, where it runs
        _python_loop_equals_modules(llm, (1, 3, 12, 20), "r", small_vocab)


@needs_packed_bf16
@pytest.mark.parametrize("env", [{"PLINTH_CPU_INT4_MAX_ROWS": "12"},
                                 {"PLINTH_CPU_INT8_ACT": "1", "PLINTH_CPU_INT4_MAX_ROWS": "8"}],
                         ids=["int4-rows-12", "int8-inputs"])
def test_fused_amx_step_only_where_the_layers_route_alike(env, tmp_path_factory, monkeypatch, tiny_llama_dir):
    """Where the layers send some rows past 8 elsewhere than the AMX GEMM (their 4-bit copy's own matmul up to a
    raised int4 switch-over, the 8-bit-input GEMM), the fused step does not take them: the plan equals the modules."""
    from test_gguf import small_model, write_gguf

    if not cpu_native.q4_amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    tmp = tmp_path_factory.mktemp("amxroute")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp / "cache"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = write_gguf(tmp / "m.gguf", small_model("llama", True), "llama", gguf.GGMLQuantizationType.Q4_1)
    with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="bfloat16", block_size=4,
             attention_backend="cpu_paged") as llm:
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan) and not plan.amx
        small_vocab = [[(7 * i + j) % 120 + 3 for j in range(3 + 4 * (i % 12))] for i in range(20)]
        for n in (9, 12, 16):
            _plan_equals_modules(llm, n, "a", small_vocab)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [pytest.param("bfloat16", "fp8", marks=needs_packed_bf16),
                                                  ("float32", "bfloat16")])
def test_plan_with_a_narrow_cache_equals_the_module_path(tmp_path_factory, monkeypatch, tiny_llama_dir, dtype,
                                                         kv_cache_dtype):
    """A KV cache narrower than the model (head size 64): FP8 E4M3 under bfloat16 (``kv_cache_dtype="fp8"``),
    bfloat16 under float32 (``kv_cache_dtype="bfloat16"``). The fused native step and the plan's Python loop round
    keys and values into the cache as the module path does and read them through the same decode kernel:
    bit-identical logits."""
    from test_gguf import small_model, write_gguf

    from plinth.attention_backends import cpu_paged

    fp8 = kv_cache_dtype == "fp8"
    if fp8 and not cpu_paged.fp8_decode_available():
        pytest.skip("the CPU paged-attention kernel has no FP8 decode here (AVX512-BF16)")
    if not fp8 and not cpu_paged.f32_bf16_available():
        pytest.skip("the CPU paged-attention kernel reads no bfloat16 cache under float32 queries here (AVX2 builds)")
    tmp = tmp_path_factory.mktemp("narrowplan")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp / "cache"))
    model = small_model("llama", True, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    path = write_gguf(tmp / "m.gguf", model, "llama", gguf.GGMLQuantizationType.Q4_1)
    with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype=dtype, block_size=4, attention_backend="cpu_paged",
             kv_cache_dtype=kv_cache_dtype) as llm:
        assert llm.engine.runner.kv_caches[0].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan)
        assert (plan.fused_layers is not None) == (cpu_native.q4_gemv_supported() if fp8
                                                   else cpu_native.q4_gemv_f32_supported())
        assert plan.fused_layers is None or all(lay.kv_narrow == 1 for lay in plan.fused_layers)
        ran = []   # the plan itself produced the logits (None would hand the batch to the modules)
        real_run = plan.run
        monkeypatch.setattr(plan, "run", lambda *a, **k: ran.append(real_run(*a, **k)) or ran[-1])
        small_vocab = [[(7 * i + j) % 120 + 3 for j in range(3 + 4 * (i % 12))] for i in range(20)]
        for n in (1, 5, 20):
            _plan_equals_modules(llm, n, "f", small_vocab)
        _python_loop_equals_modules(llm, (1, 12), "g", small_vocab)
        assert len(ran) >= 5 and all(r is not None for r in ran)


def test_greedy_tokens_equal_with_the_plan_off(llm, tiny_llama_dir, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with_plan = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setenv("PLINTH_CPU_DECODE_PLAN", "0")
    with make_llm(tiny_llama_dir) as plain:
        assert plain.engine.runner.graphs is None
        without = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert with_plan == without
    assert len({tuple(t) for t in with_plan}) > 2


def test_models_it_does_not_serve_run_the_modules(tiny_llama_dir, monkeypatch):
    with LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4, attention_backend="torch_batched") as other:
        assert other.engine.runner.graphs is None           # the plan calls the cpu_paged kernel
    monkeypatch.setenv("PLINTH_CPU_NATIVE_OPS", "0")
    cpu_native._env_enabled.cache_clear()
    try:
        with LLM(str(tiny_llama_dir), dtype="float32", block_size=4, attention_backend="cpu_paged") as fp32:
            assert fp32.engine.runner.graphs is None        # no native ops: the modules' torch code
    finally:
        cpu_native._env_enabled.cache_clear()


def test_no_plan_with_the_fused_ops_off(tiny_llama_dir, monkeypatch):
    """``PLINTH_FUSED_OPS=0`` sends the modules to the torch code: the plan (native ops) is not built then."""
    from plinth.kernels import ops

    monkeypatch.setenv("PLINTH_FUSED_OPS", "0")
    ops._env_enabled.cache_clear()
    try:
        for dtype in ("float32", "bfloat16"):
            with LLM(str(tiny_llama_dir), dtype=dtype, block_size=4, attention_backend="cpu_paged") as llm:
                assert llm.engine.runner.graphs is None
    finally:
        ops._env_enabled.cache_clear()


def test_float32_model_plan_equals_the_module_path(tiny_llama_dir):
    """float32 models (the default on CPUs without native bfloat16) run the plan too: the native float32
    RMSNorm, RoPE and SiLU-and-mul, the float32 attention kernel, the layers' own GEMMs."""
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=4, attention_backend="cpu_paged") as llm:
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan) and plan.dtype == torch.float32
        assert plan.fused_layers is None                    # no 4-bit copies: the plan's Python loop
        for n in (1, 3, 6):
            _plan_equals_modules(llm, n, "f")


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_packed_bf16)])
@pytest.mark.parametrize("name", ["SmolLM3ForCausalLM", "GraniteForCausalLM", "Qwen3ForCausalLM"])
def test_plan_of_nope_layers_multipliers_and_qk_norms_equals_the_module_path(name, dtype, tmp_path):
    """SmolLM3's layers without RoPE, Granite's embedding and residual multipliers (its logit scaling is the
    model's own ``compute_logits``) and Qwen3's per-head q/k norms in the plan's Python loop: bit-identical to the
    module path."""
    from test_models import save_with_tokenizer

    save_with_tokenizer(name, tmp_path)
    with LLM(str(tmp_path), dtype=dtype, block_size=4, attention_backend="cpu_paged") as llm:
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan) and plan.fused_layers is None
        if name == "SmolLM3ForCausalLM":
            assert [lay.rope for lay in plan.layers] == [True, False, False, True]
        elif name == "Qwen3ForCausalLM":
            assert all(lay.q_norm is not None and lay.k_norm is not None for lay in plan.layers)
        else:
            assert plan.embed_scale == 6.0 and {lay.residual_multiplier for lay in plan.layers} == {0.5}
        for n in (1, 3):
            _plan_equals_modules(llm, n, "m")


@pytest.mark.parametrize("name", ["GemmaForCausalLM", "Gemma3ForCausalLM"])
def test_plan_of_gemma_equals_the_module_path(name, tmp_path):
    """Gemma's scaled embeddings, (1 + w) norms and tanh-GeLU gate, and Gemma 3's norms on the block outputs, per-head
    q/k norms and sliding layers with their own RoPE, in the plan's Python loop of a float32 model: bit-identical to
    the module path. (In a bfloat16 model Gemma's norms compute in float32: no plan.)"""
    from test_models import save_with_tokenizer

    save_with_tokenizer(name, tmp_path)
    with LLM(str(tmp_path), dtype="float32", block_size=4, attention_backend="cpu_paged") as llm:
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan) and plan.fused_layers is None
        assert all(lay.act is not None for lay in plan.layers) and plan.embed_scale != 1.0
        if name == "Gemma3ForCausalLM":
            assert [lay.local_rope for lay in plan.layers] == [True, False, True]
            assert all(lay.attn_out_norm is not None and lay.q_norm is not None for lay in plan.layers)
        for n in (1, 3):
            _plan_equals_modules(llm, n, "g")


@pytest.mark.parametrize("int8", [False, True])
def test_float32_gguf_plan_runs_every_layer_natively(int8, tmp_path_factory, monkeypatch, tiny_llama_dir):
    """A float32 Q4_1 GGUF model on a CPU without native bfloat16 keeps 4-bit copies that take float32 rows
    (the native float32 GEMV): steps of up to the layers' row limit run every layer in one native call
    (``plinth_decode_layers_f32``), bit-identical to the module path, as is the plan's Python loop. With
    8-bit inputs (the default there) every GEMM of a decode step quantizes its rows to 8 bits
    (``plinth_decode_layers_f32q8``, any batch size), still bit-identical to the modules, which take the 8-bit
    GEMM in decode steps too (and never for a prompt)."""
    from test_gguf import small_model, write_gguf

    from plinth.platforms.cpu import platform as cpu_platform

    if not cpu_native.q4_gemv_f32_supported():
        pytest.skip("the float32 panel GEMV needs AVX2/FMA/F16C")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16", lambda: False)
    if not int8:
        monkeypatch.setenv("PLINTH_CPU_INT8_ACT", "0")
    else:
        monkeypatch.delenv("PLINTH_CPU_INT8_ACT", raising=False)   # the default: float32 prompts
    q8_rows: list[int] = []   # rows of every 8-bit GEMM call from Python (the module path)
    real_q8 = cpu_native.Q4GemmF32Q8.__call__
    monkeypatch.setattr(cpu_native.Q4GemmF32Q8, "__call__", lambda self, x: (q8_rows.append(x.shape[0]),
                                                                            real_q8(self, x))[1])
    tmp = tmp_path_factory.mktemp("q4plan32")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp / "cache"))
    path = write_gguf(tmp / "m.gguf", small_model("llama", False), "llama", gguf.GGMLQuantizationType.Q4_1)
    calls = []
    real = cpu_native.decode_layers
    monkeypatch.setattr(cpu_native, "decode_layers",
                        lambda *a, **k: (calls.append((a[1].rows, k.get("int8_inputs"))), real(*a, **k))[1])
    with LLM(str(path), tokenizer=str(tiny_llama_dir), dtype="float32", block_size=4,
             attention_backend="cpu_paged") as llm:
        plan = llm.engine.runner.graphs
        assert isinstance(plan, CpuDecodePlan) and plan.dtype == torch.float32
        # PLINTH_CPU_INT4_MAX_ROWS; with 8-bit inputs every row count takes the copies' GEMM
        assert plan.fused_layers is not None and plan.fused_max_rows == (sys.maxsize if int8 else 4)
        assert plan.int8_inputs == int8
        copy = llm.engine.runner.model.model.layers[0].mlp.down_proj.linear_method.int4
        assert (copy.gemm_q8 is not None) == int8
        small_vocab = [[(7 * i + j) % 120 + 3 for j in range(3 + 4 * i)] for i in range(6)]
        llm.generate([small_vocab[5]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert not q8_rows and not calls    # a prompt (23 rows) and its logits: float32 rows only
        for n in (1, 3, 4, 6):    # past the row limit the layers take their float32 GEMM (the plan's loop)
            _plan_equals_modules(llm, n, "g", small_vocab)
        assert sorted(set(calls)) == [(n, int8) for n in ((1, 3, 4, 6) if int8 else (1, 3, 4))], calls
        assert (6 in q8_rows) == int8       # the module path of a 6-row decode step took the 8-bit GEMM
        _python_loop_equals_modules(llm, (1, 3), "h", small_vocab)


def test_run_declines_batches_it_does_not_take(llm):
    plan = llm.engine.runner.graphs
    assert plan.run(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((0, 1), np.int32)) is None
    too_many = plan.max_size + 1
    assert plan.run(np.zeros(too_many, dtype=np.int64), np.zeros(too_many, dtype=np.int64),
                    np.ones((too_many, 1), np.int32)) is None


def test_plan_of_biased_projections_equals_the_module_path(tmp_path):
    """A Llama with biases on every projection (``attention_bias``, ``mlp_bias``) in bfloat16: the plan adds each
    bias where the module path does (o_proj and down_proj, row-parallel, take theirs inside the GEMM on one rank),
    so the logits are bit-identical."""
    import transformers
    from conftest import decisive_weights, make_tokenizer

    tokenizer = make_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   attention_bias=True, mlp_bias=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = decisive_weights(transformers.LlamaForCausalLM(cfg).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with make_llm(tmp_path) as llm:
        assert isinstance(llm.engine.runner.graphs, CpuDecodePlan)
        for n in (1, 3):
            _plan_equals_modules(llm, n, "b")
