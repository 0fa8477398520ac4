"""Models with Mamba-2 layers (per-sequence recurrent state): Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``),
Nemotron-H, Falcon-H1 and Mamba-2, against transformers running the same random weights (float32), and the scan against a
float64 step-by-step recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_tokenizer

import plinth
from plinth.config import ConfigError
from plinth.errors import UnsupportedModelError
from plinth.model_registry.layers.mamba import Mamba2Mixer, ssd_scan

MAX_TOKENS = 10

#: name -> config overrides: Granite 4.0-H-like (dense, no RoPE), with routed experts and RoPE, attention only
#: (granite-4.0-micro), every layer Mamba
SHAPES = {
    "dense_nope": dict(num_local_experts=0, position_embedding_type=None,
                       layer_types=["mamba", "attention", "mamba", "mamba"]),
    "moe_rope": dict(num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
                     layer_types=["mamba", "mamba", "attention", "mamba"]),
    "attention_only": dict(num_local_experts=0, position_embedding_type="rope", layer_types=["attention"] * 4),
    "mamba_only": dict(num_local_experts=0, position_embedding_type=None, layer_types=["mamba"] * 4,
                       mamba_conv_bias=False, mamba_proj_bias=True),
}


def _config(tokenizer, **overrides) -> transformers.GraniteMoeHybridConfig:
    base = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16,
                mamba_d_head=16, mamba_n_groups=2, mamba_chunk_size=8, embedding_multiplier=2.0,
                residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=3.0, max_position_embeddings=256,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=0, bos_token_id=tokenizer.bos_token_id)
    return transformers.GraniteMoeHybridConfig(**{**base, **overrides}, attn_implementation="eager")


@torch.no_grad()
def randomize_mamba(hf: transformers.PreTrainedModel) -> None:
    """Decay rates, time-step biases, skips, norms and conv biases away from their constant initial values."""
    g = torch.Generator().manual_seed(3)
    for name, p in hf.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
        elif name.endswith("dt_bias") or name.endswith(".D"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _grouped_gated_norms(hf: transformers.PreTrainedModel) -> None:
    """Older transformers (5.17 among them) normalize GraniteMoeHybrid's and Mamba-2's gated RMSNorm over the whole
    intermediate size, ignoring the groups (its own CUDA path, mamba_ssm's kernels, later transformers and plinth
    normalize each of the ``n_groups`` groups): give such a reference the groups, so that it computes what the
    checkpoint means."""
    import types

    def grouped(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.float()
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.view_as(h).to(dtype)

    for module in hf.modules():
        norm = getattr(module, "norm", None)
        if hasattr(module, "n_groups") and hasattr(module, "intermediate_size") and norm is not None \
                and not hasattr(norm, "group_size"):
            norm.group_size = module.intermediate_size // module.n_groups
            norm.forward = types.MethodType(grouped, norm)


def save_hybrid(path, **overrides) -> transformers.PreTrainedModel:
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(_config(tokenizer, **overrides)).eval()
    _grouped_gated_norms(hf)
    randomize_mamba(hf)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def _prompts(vocab: int, lengths=(1, 5, 19, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (a full forward each step: no cache involved) and their log-probabilities."""
    ids, lps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].double(), -1)
        ids.append(int(logp.argmax()))
        lps.append(float(logp.max()))
    return ids[len(prompt):], lps


def engine_tokens_and_logprobs_match(path, hf) -> None:
    """The engine's greedy tokens and their log-probabilities (float32; a 16-token step budget, so longer prompts
    run in chunks beside other sequences' decodes) equal transformers' for prompts of 1 to 33 tokens."""
    prompts = _prompts(hf.config.vocab_size)
    llm = plinth.LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        tokens, lps = hf_greedy(hf, prompt)
        assert out.outputs[0].token_ids == tokens
        assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    llm.close()


def engine_greedy_matches(path, hf, prompts: list[list[int]], n: int = MAX_TOKENS, **llm_kwargs) -> None:
    """The engine's greedy tokens (float32, ``max_model_len`` 128 unless ``llm_kwargs`` say otherwise) for ``prompts``
    equal transformers'."""
    llm = plinth.LLM(str(path), **{"dtype": "float32", "max_model_len": 128, **llm_kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n)[0] for p in prompts]
    llm.close()


def _greedy(max_tokens: int = MAX_TOKENS, **kw) -> plinth.SamplingParams:
    return plinth.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module", params=list(SHAPES))
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hybrid(path, **SHAPES[request.param])
    prompts = _prompts(hf.config.vocab_size)
    return str(path), hf, prompts, [hf_greedy(hf, p) for p in prompts]


def test_engine_matches_transformers(hybrid):
    """Greedy tokens and their log-probabilities equal transformers' for a batch of prompts of 1 to 33 tokens; a
    16-token step budget cuts the longer prompts into chunks (8-position scan chunks inside) and mixes them with
    other sequences' decodes."""
    path, hf, prompts, want = hybrid
    llm = plinth.LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False)
    for out, (tokens, lps) in zip(outs, want, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        got_lps = [next(iter(step.values())).logprob for step in got.logprobs]
        assert got_lps == pytest.approx(lps, abs=2e-4)
    # the prefix cache is on; where the model keeps state (attention-only Granite keeps none) with states kept at
    # block boundaries
    has_mamba = "linear_attention" in hf.config.layer_types
    bm = llm.engine.block_manager
    assert llm.engine.has_recurrent_state is has_mamba and bm.enable_prefix_caching
    assert bm.state_slots == (8 if has_mamba else 0)   # max_num_seqs
    llm.close()


def test_rows_are_reused_and_sequences_kept_apart(hybrid):
    """Two sequences at a time for six requests: rows of the recurrent state pass from finished requests to new
    ones (starting from zero state), and a repeated prompt (from the prefix cache's state) gives the same tokens."""
    path, hf, prompts, want = hybrid
    llm = plinth.LLM(path, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
    order = [3, 0, 2, 1, 3, 0]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[i][0] for i in order]
    llm.close()


def test_preempted_requests_restart_from_zero_state(tmp_path):
    """A KV cache too small for every request at once preempts some; recomputed from position 0, their state starts
    again and the tokens stay transformers'."""
    hf = save_hybrid(tmp_path, **SHAPES["moe_rope"])
    prompts = _prompts(hf.config.vocab_size, (20, 27, 31, 24, 18))
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, block_size=4, num_blocks=24,
                     max_num_batched_tokens=32)
    n = 30
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n)[0] for p in prompts]
    llm.close()


def test_n_samples_share_nothing(tmp_path):
    """``n=3`` greedy samples of one prompt: each sequence has its own state, so all three are transformers'."""
    hf = save_hybrid(tmp_path, **SHAPES["dense_nope"])
    prompt = _prompts(hf.config.vocab_size, (12,))[0]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64)
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(n=3), use_tqdm=False)[0]
    want = hf_greedy(hf, prompt)[0]
    assert [c.token_ids for c in out.outputs] == [want] * 3
    llm.close()


@pytest.mark.parametrize("arch", ["granite", "jamba", "FalconMambaForCausalLM"])
def test_bfloat16_on_the_cpu_path(arch, tmp_path):
    """bfloat16 (the CPU platform's packed GEMMs, Mamba-1's ``x_proj`` and ``dt_proj`` included; the float32 scans
    and states): the first greedy tokens agree with the float32 reference (a near tie may part later ones)."""
    if arch == "granite":
        hf = save_hybrid(tmp_path, **SHAPES["dense_nope"])
    else:
        hf = save_jamba(tmp_path) if arch == "jamba" else save_backbone_model(tmp_path, arch)
    prompts = _prompts(hf.config.vocab_size)
    llm = plinth.LLM(str(tmp_path), dtype="bfloat16", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(3), use_tqdm=False)
    agree = sum(o.outputs[0].token_ids[:2] == hf_greedy(hf, p, 2)[0] for o, p in zip(outs, prompts, strict=True))
    assert agree >= len(prompts) - 1
    llm.close()


def test_speculative_decoding_is_refused(tmp_path):
    save_hybrid(tmp_path, **SHAPES["dense_nope"])
    with pytest.raises(ConfigError, match="speculative decoding is not supported.*Mamba"):
        plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


def test_no_state_slots_turn_the_prefix_cache_off(tmp_path, caplog):
    save_hybrid(tmp_path, **SHAPES["dense_nope"])
    with caplog.at_level("INFO"):
        llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, mamba_cache_slots=0)
    assert llm.engine.block_manager.enable_prefix_caching is False
    assert "prefix cache is off" in caplog.text
    assert llm.engine.runner.model.recurrent_state.slots == 0
    llm.close()
    with pytest.raises(ConfigError, match="mamba_cache_slots must be a non-negative integer"):
        plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, mamba_cache_slots=-1)


def _hits(llm) -> int:
    return llm.engine.block_manager.stats.hit_tokens


@pytest.mark.parametrize("block_size,budget", [(8, 64), (4, 10)])
def test_prefix_cache_resumes_from_saved_states(hybrid, block_size, budget):
    """Repeated prompts resume from the state saved at the block boundary before their last token, and a next turn
    (a prompt that goes on from an earlier request's prompt and output) from the state saved in its decode: the
    tokens and log-probabilities stay transformers'. A 10-token step budget with 4-token blocks puts the prompt's
    boundary inside a chunk (the scan is split there); 8-token blocks and a whole-prompt step save at chunk ends."""
    path, hf, prompts, want = hybrid
    if "linear_attention" not in hf.config.layer_types:
        pytest.skip("no Mamba layers")
    llm = plinth.LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=block_size,
                     max_num_batched_tokens=budget, mamba_cache_slots=8)   # two for each running request
    reqs = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(reqs, _greedy(logprobs=0), use_tqdm=False)
    assert _hits(llm) == 0
    again = llm.generate(reqs, _greedy(logprobs=0), use_tqdm=False)
    # every prompt of more than one block resumes at the boundary before its last token
    assert _hits(llm) == sum((len(p) - 1) // block_size * block_size for p in prompts)
    for out, (tokens, lps) in zip(first + again, want + want, strict=True):
        assert out.outputs[0].token_ids == tokens
        assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    # a next turn: the longest prompt, its output and 3 more tokens resumes inside the output
    turn = prompts[-1] + want[-1][0] + [5, 6, 7]
    before = _hits(llm)
    out = llm.generate({"prompt_token_ids": turn}, _greedy(logprobs=0), use_tqdm=False)[0]
    done = len(prompts[-1]) + MAX_TOKENS - 1   # the last output token was never computed
    assert _hits(llm) - before == done // block_size * block_size > len(prompts[-1])
    tokens, lps = hf_greedy(hf, turn)
    assert out.outputs[0].token_ids == tokens
    assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    llm.close()


def test_prefix_cache_states_evicted_least_recently_used(tmp_path):
    """Two state slots for five prompts sharing a 16-token head, twice: a hit ends at the deepest block whose state
    is still kept (none once evicted: the prompt is computed again), and the tokens stay transformers'."""
    hf = save_hybrid(tmp_path, **SHAPES["moe_rope"])
    g = torch.Generator().manual_seed(3)
    head = torch.randint(2, hf.config.vocab_size, (16,), generator=g).tolist()
    prompts = [head + torch.randint(2, hf.config.vocab_size, (k,), generator=g).tolist() for k in (9, 3, 12, 6, 1)]
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=2, block_size=8,
                     mamba_cache_slots=2)
    bm = llm.engine.block_manager
    hits = []
    for _ in range(2):
        for p, tokens in zip(prompts, want, strict=True):
            before = _hits(llm)
            assert llm.generate({"prompt_token_ids": p}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids == tokens
            hits.append(_hits(llm) - before)
            assert len(bm._slot_of) <= 2
    # the head's state (saved by the 19-token prompt, the first whose last token's boundary is 16) serves the next
    # prompt, then the least recently used slot goes to a new checkpoint: the head's, until saved again
    assert hits == [0, 0, 16, 0, 16, 16, 0, 16, 0, 16]
    llm.close()


def test_attention_only_granite_keeps_the_prefix_cache(tmp_path):
    """granite-4.0-micro's shape (every layer attention) keeps no state: it runs as any model, prefix cache on."""
    save_hybrid(tmp_path, **SHAPES["attention_only"])
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64)
    assert llm.engine.has_recurrent_state is False and llm.engine.block_manager.enable_prefix_caching is True
    llm.close()


def test_quantized_projections(tmp_path):
    """``--quantization fp8`` (the dequantizing kernel on a CPU) quantizes the Mamba layers' projections too; the
    greedy tokens stay close to the float model's (random weights: a few near ties part)."""
    save_hybrid(tmp_path, **SHAPES["moe_rope"])
    prompts = [{"prompt_token_ids": p} for p in _prompts(300)]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, quantization="fp8")
    quantized = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(8), use_tqdm=False)]
    in_proj = llm.engine.runner.model.model.layers[0].mamba.in_proj
    assert not hasattr(in_proj, "weight") or in_proj.weight.dtype != torch.float32
    llm.close()
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128)
    full = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(8), use_tqdm=False)]
    llm.close()
    assert sum(a[0] == b[0] for a, b in zip(quantized, full, strict=True)) >= 3


def test_a_draft_model_with_mamba_layers_is_refused(tmp_path):
    save_hybrid(tmp_path / "draft", **SHAPES["dense_nope"])
    save_hybrid(tmp_path / "target", **SHAPES["attention_only"])
    with pytest.raises(ConfigError, match="draft model .* has Mamba layers"):
        plinth.LLM(str(tmp_path / "target"), dtype="float32", max_model_len=64,
                   speculative_config={"method": "draft_model", "model": str(tmp_path / "draft"),
                                       "num_speculative_tokens": 2})


def test_uneven_tensor_parallel_splits_are_refused_clearly():
    """The heads must divide over the ranks, and the groups too unless there is one (then it is replicated)."""
    with pytest.raises(UnsupportedModelError, match="cannot be split over 3 tensor-parallel ranks"):
        Mamba2Mixer(64, 8, 16, 16, 2, 4, 8, 1e-6, tp_size=3)
    with pytest.raises(UnsupportedModelError, match="cannot be split over 4 tensor-parallel ranks"):
        Mamba2Mixer(64, 8, 16, 16, 2, 4, 8, 1e-6, tp_size=4)


@pytest.mark.parametrize("groups", [2, 1], ids=["groups_split", "one_group_replicated"])
def test_tensor_parallel_workers_match_transformers(groups, tmp_path):
    """Two tensor-parallel worker processes (CPU, gloo): each rank holds half of the Mamba heads (their rows of
    ``in_proj``, channels of ``conv1d``, ``A_log``/``D``/``dt_bias``, norm and ``out_proj`` columns) and either half
    of the groups or, with one group, all of it, its gated norm's squares all-reduced; the attention and MLP split as
    usual. Greedy tokens equal transformers', also the second time, when the prompts resume from the prefix cache's
    states (every rank restores its share)."""
    from conftest import generate_on_tp_workers

    hf = save_hybrid(tmp_path, **{**SHAPES["moe_rope"], "mamba_n_groups": groups})
    prompts = _prompts(hf.config.vocab_size)
    hits: list[int] = []
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy(), rounds=2,
                                 hits=hits)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p)[0] for p in prompts] * 2
    assert hits == [sum((len(p) - 1) // 4 * 4 for p in prompts)]   # 4-token blocks


@pytest.mark.parametrize("layer_types", [["mamba", "mamba", "attention", "mamba"],
                                         ["mamba", "mamba", "attention", "attention"]],
                         ids=["state_on_both_stages", "second_stage_attention_only"])
def test_pipeline_stages_match_transformers(layer_types, tmp_path):
    """Two pipeline stages in worker processes: each stage keeps the state of its own Mamba layers in the same rows
    (a stage of attention layers keeps none, and does not turn the prefix cache off), restores and saves the prefix
    cache's checkpoints of its layers, and each of a step's micro-batches saves its own. Tokens and log-probabilities
    equal transformers', also when repeated prompts resume from the states saved inside their chunks (10-token steps,
    4-token blocks) and a next turn from the one saved at the end of a decode step."""
    hf = save_hybrid(tmp_path, **{**SHAPES["moe_rope"], "layer_types": layer_types})
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", platform="cpu", pipeline_parallel_size=2,
                     distributed_executor="mp", max_model_len=128, max_num_seqs=4, block_size=4,
                     max_num_batched_tokens=10, mamba_cache_slots=8)
    try:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        outs = [o for _ in range(2) for o in llm.generate(reqs, _greedy(logprobs=0), use_tqdm=False)]
        assert _hits(llm) == sum((len(p) - 1) // 4 * 4 for p in prompts)
        turn = prompts[-1] + want[-1][0] + [5, 6, 7]   # the longest prompt's next turn resumes inside its output
        before = _hits(llm)
        outs.append(llm.generate({"prompt_token_ids": turn}, _greedy(logprobs=0), use_tqdm=False)[0])
        assert _hits(llm) - before == (len(prompts[-1]) + MAX_TOKENS - 1) // 4 * 4 > len(prompts[-1])
    finally:
        llm.close()
    for out, (tokens, lps) in zip(outs, want + want + [hf_greedy(hf, turn)], strict=True):
        assert out.outputs[0].token_ids == tokens
        assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_nemotron_h_on_worker_processes(tp, pp, tmp_path):
    """Nemotron-H with Mamba, attention, MLP and expert blocks on two CPU worker processes, as tensor-parallel ranks
    (the experts' features split) or as two pipeline stages (blocks 0-1 and 2-3); greedy tokens equal
    transformers'."""
    from conftest import generate_on_tp_workers

    hf = save_backbone_model(tmp_path, "NemotronHForCausalLM", layers_block_type=["mamba", "moe", "attention", "mlp"],
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=48)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    hf.save_pretrained(tmp_path)
    prompts = _prompts(hf.config.vocab_size)
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy(), size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p)[0] for p in prompts]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tensor_parallel", "pipeline_stages"])
def test_falcon_h1_on_worker_processes(tp, pp, tmp_path):
    """Falcon-H1 with one Mamba group (replicated; its norm before the gate all-reduced) on two CPU worker processes,
    as tensor-parallel ranks or as two pipeline stages (the final norm, ``final_layernorm``, on the second): greedy
    tokens equal transformers'."""
    from conftest import generate_on_tp_workers

    hf = save_falcon_h1(tmp_path, mamba_n_groups=1, mamba_rms_norm=True, mamba_norm_before_gate=True)
    prompts = _prompts(hf.config.vocab_size)
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy(), size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p)[0] for p in prompts]


def test_mamba2_on_worker_processes_and_int4(tmp_path):
    """Mamba-2 has no attention heads in its config: the parallel layout and int4's group size do without them. Two
    tensor-parallel worker processes, and two pipeline stages (the second reads the tied embeddings into its own LM
    head), give transformers' greedy tokens; ``--quantization int4`` runs (its group divides the Mamba layers'
    ``out_proj`` input too)."""
    from conftest import generate_on_tp_workers

    hf = save_backbone_model(tmp_path, "Mamba2ForCausalLM", n_groups=1)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p)[0] for p in prompts]
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy())
    assert [o.outputs[0].token_ids for o in got] == want
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy(), size=1, pp=2)
    assert [o.outputs[0].token_ids for o in got] == want
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, quantization="int4")
    assert len(llm.generate({"prompt_token_ids": prompts[1]}, _greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    llm.close()


def _fp8_granite(src, out) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint (``quant_method: fp8``, per-row scales) of a Granite 4.0-H checkpoint: every projection of
    its layers (Mamba, attention, the shared MLP's fused ``input_linear``); the dequantized tensors returned."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors, deq = load_file(str(out / "model.safetensors")), {}
    for name in [n for n in tensors if ".layers." in n and n.endswith(("_proj.weight", "_linear.weight"))]:
        w = tensors[name]
        scale = w.abs().amax(1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
        deq[name] = tensors[name].float() * scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config))
    return deq


def test_fp8_checkpoint_and_its_tensor_parallel_refusal(tmp_path):
    """An FP8 Granite 4.0-H checkpoint (the shared MLP's fused ``input_linear`` and its row scales split into gate
    and up) gives transformers' greedy tokens on the dequantized weights. Its packed tensors load through the
    method's own row cuts, not the Mamba layer's parts, so splitting it over ranks is refused instead of loading
    the wrong rows."""
    from conftest import generate_on_tp_workers

    hf = save_hybrid(tmp_path / "float", **SHAPES["dense_nope"])
    deq = _fp8_granite(tmp_path / "float", tmp_path / "fp8")
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in deq.items():
            params[name].copy_(w)
    prompts = _prompts(hf.config.vocab_size)
    engine_greedy_matches(tmp_path / "fp8", hf, prompts, max_model_len=64)
    with pytest.raises(UnsupportedModelError, match="quantized ahead of time cannot split its Mamba layers"):
        generate_on_tp_workers(tmp_path / "fp8", [{"prompt_token_ids": prompts[0]}], _greedy(4))


def test_nemotron_h_keeps_its_own_lm_head_and_skips_prediction_layers(tmp_path):
    """transformers' Nemotron-H never ties its LM head to the embeddings, whatever ``tie_word_embeddings`` says;
    a checkpoint's multi-token-prediction tensors (``mtp.*``) are skipped."""
    from safetensors.torch import load_file, save_file

    hf = save_backbone_model(tmp_path, "NemotronHForCausalLM", tie_word_embeddings=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert not torch.equal(tensors["lm_head.weight"], tensors["backbone.embeddings.weight"])
    tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    engine_greedy_matches(tmp_path, hf, _prompts(hf.config.vocab_size))


def test_a_state_larger_than_free_memory_is_refused_clearly(tmp_path):
    """The state for ``max_num_seqs`` sequences is checked against the device's free memory before it is taken."""
    from plinth.config import EngineConfig
    from plinth.worker.setup import allocate_recurrent_state

    hf = save_hybrid(tmp_path, **SHAPES["dense_nope"])
    del hf
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    per_seq = model.recurrent_state_bytes(1)

    class Tight:
        def free_memory(self, index: int = 0) -> int:
            return 100 * per_seq

    config = EngineConfig.from_kwargs(model=str(tmp_path), max_num_seqs=256)
    with pytest.raises(ConfigError, match="state for 256 sequences .* lower --max-num-seqs"):
        allocate_recurrent_state(model, config, Tight(), torch.device("cpu"))
    # the rows fit; the default prefix-cache states (one per sequence) do not fit half the free memory: fewer
    each = model.recurrent_state_bytes(1, 1) - model.recurrent_state_bytes(1)   # one state
    model.recurrent_state = None
    allocate_recurrent_state(model, EngineConfig.from_kwargs(model=str(tmp_path), max_num_seqs=60), Tight(),
                             torch.device("cpu"))
    assert model.recurrent_state.rows == 60
    assert model.recurrent_state.slots == int((50 * per_seq - model.recurrent_state_bytes(60)) // each) == 39
    # asked for explicitly, too many is refused
    model.recurrent_state = None
    with pytest.raises(ConfigError, match="--mamba-cache-slots 150 .* more than"):
        allocate_recurrent_state(model, EngineConfig.from_kwargs(model=str(tmp_path), max_num_seqs=60,
                                                                 mamba_cache_slots=150), Tight(), torch.device("cpu"))
    llm.close()


def test_decode_rows_update_in_place_only_as_a_span():
    """The decode step updates the scan state in place only where its rows are consecutive (else it gathers and
    scatters them)."""
    from plinth.model_registry.layers.mamba import _span

    assert _span([3, 4, 5, 9], 3) == (3, 6) and _span([3, 4, 5], 3) == (3, 6)
    assert _span([4, 3, 5], 3) is None and _span([0, 2], 2) is None and _span(None, 2) is None and _span([], 0) is None


def _scan_reference(x, dt, a, b, c, state):
    """The recurrence one position at a time, float64: ``h = exp(dt a) h + dt x b^T``, ``y = h c``."""
    ys = []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(ys), state


@pytest.mark.parametrize("length,chunk", [(1, 8), (7, 8), (8, 8), (21, 8), (21, 1), (40, 16)])
def test_chunked_scan_matches_the_recurrence(length, chunk):
    g = torch.Generator().manual_seed(length * 31 + chunk)
    h, p, n = 3, 4, 5
    x = torch.randn(length, h, p, generator=g, dtype=torch.float64)
    dt = torch.rand(length, h, generator=g, dtype=torch.float64) * 0.5
    a = -torch.rand(h, generator=g, dtype=torch.float64) * 2
    b = torch.randn(length, h, n, generator=g, dtype=torch.float64)
    c = torch.randn(length, h, n, generator=g, dtype=torch.float64)
    s0 = torch.randn(h, p, n, generator=g, dtype=torch.float64)
    y, s = ssd_scan(x, dt, a, b, c, s0, chunk)
    y_ref, s_ref = _scan_reference(x, dt, a, b, c, s0)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def save_backbone_model(path, arch: str, **overrides) -> transformers.PreTrainedModel:
    """A random ``NemotronHForCausalLM`` (Mamba, MLP and attention blocks) or ``Mamba2ForCausalLM`` (tied
    embeddings) with the tests' tokenizer."""
    tokenizer = make_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                  bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    if arch == "NemotronHForCausalLM":
        cfg = transformers.NemotronHConfig(**{**common, **dict(
            intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
            mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
            layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba"]), **overrides},
            attn_implementation="eager")
        hf = transformers.NemotronHForCausalLM(cfg).eval()
    elif arch in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        config_class = transformers.MambaConfig if arch == "MambaForCausalLM" else transformers.FalconMambaConfig
        cfg = config_class(**{**common, **dict(state_size=8, expand=2, conv_kernel=4, num_hidden_layers=3,
                                               time_step_rank=8, use_conv_bias=True, use_bias=False,
                                               residual_in_fp32=False)}, **overrides)
        hf = getattr(transformers, arch)(cfg).eval()
    else:
        cfg = transformers.Mamba2Config(**{**common, **dict(
            num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2, chunk_size=8, num_hidden_layers=3,
            tie_word_embeddings=True), **overrides})
        hf = transformers.Mamba2ForCausalLM(cfg).eval()
        _grouped_gated_norms(hf)   # (Mamba-2's gated norm in older transformers ignores the groups too)
    randomize_mamba(hf)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def save_falcon_h1(path, **overrides) -> transformers.PreTrainedModel:
    """A random ``FalconH1ForCausalLM`` with every muP multiplier away from 1, biases where the config allows."""
    tokenizer = make_tokenizer()
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                  mamba_n_groups=2, mamba_chunk_size=8, mamba_d_ssm=128, embedding_multiplier=1.5,
                  lm_head_multiplier=0.7, key_multiplier=1.3, attention_in_multiplier=0.8,
                  attention_out_multiplier=1.2, ssm_in_multiplier=0.9, ssm_out_multiplier=1.1,
                  ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7], mlp_multipliers=[1.4, 0.6], attention_bias=True,
                  mlp_bias=True, mamba_proj_bias=True, projectors_bias=True, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=0, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    hf = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{**fields, **overrides},
                                                                      attn_implementation="eager")).eval()
    randomize_mamba(hf)
    with torch.no_grad():   # without the gated norm the Mamba branch's output is tiny at this init: make it count
        for layer in hf.model.layers:
            layer.mamba.out_proj.weight.mul_(400.0)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


@pytest.mark.parametrize("norm", ["gate", "norm_gate", "gate_norm"])
def test_falcon_h1_matches_transformers(norm, tmp_path):
    """Falcon-H1 (Mamba and attention side by side in every layer, the muP multipliers folded into the weights) with
    each of its output-gate variants (``mamba_rms_norm`` off; on, before or after the gate): greedy tokens and
    log-probabilities equal transformers', chunked prefill included."""
    hf = save_falcon_h1(tmp_path, mamba_rms_norm=norm != "gate", mamba_norm_before_gate=norm == "norm_gate")
    engine_tokens_and_logprobs_match(tmp_path, hf)


def test_lora_is_refused_where_it_would_miss_folded_multipliers(tmp_path):
    """Falcon-H1's attention multipliers live in its base weights: an adapter's product would miss them, so LoRA is
    refused at start-up."""
    save_falcon_h1(tmp_path)
    with pytest.raises(ConfigError, match="no layers that take LoRA adapters"):
        plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, enable_lora=True)


@pytest.mark.parametrize("arch", ["NemotronHForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM",
                                  "FalconMambaForCausalLM"])
def test_backbone_models_match_transformers(arch, tmp_path):
    """Nemotron-H (Mamba, squared-ReLU MLP and RoPE-less attention blocks), Mamba-2 and Mamba / Falcon-Mamba
    (Mamba-1 mixers; no attention at all: the KV blocks only count positions): greedy tokens and log-probabilities
    equal transformers', chunked prefill included; six requests two at a time reuse state rows."""
    hf = save_backbone_model(tmp_path, arch)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False)
    for out, (tokens, lps) in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == tokens
        assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    llm.close()
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=2)
    order = [3, 0, 2, 1, 3, 0]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[i][0] for i in order]
    llm.close()


@pytest.mark.parametrize("latent", [None, 24], ids=["experts", "latent_experts"])
def test_nemotron_h_mixture_of_experts_blocks(latent, tmp_path):
    """Nemotron 3's blocks: a float32 router with corrected sigmoid routing in groups, squared-ReLU experts (inside
    latent projections where ``moe_latent_size`` is set) and a shared expert; greedy tokens and log-probabilities
    equal transformers'."""
    hf = save_backbone_model(tmp_path, "NemotronHForCausalLM", layers_block_type=["mamba", "moe", "attention", "moe"],
                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, moe_latent_size=latent)
    with torch.no_grad():   # the router starts at zeros (every expert tied): random rows choose
        g = torch.Generator().manual_seed(4)
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    hf.save_pretrained(tmp_path)
    engine_tokens_and_logprobs_match(tmp_path, hf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"])
def test_gpu_engine_matches_transformers(arch, tmp_path):
    """On a GPU, float32: greedy tokens equal transformers' for prompts of 1 to 33 tokens (a 1-token prompt's first
    step is a decode row that starts its state), three at a time (decode graphs padded to 4: the padding rows write
    the state's scratch row) and again one after another (rows passing between requests). Granite's decode steps
    replay CUDA graphs; Nemotron-H's expert blocks loop over experts on the host, so it decodes eagerly."""
    from plinth.worker.cuda_graphs import DecodeGraphRunner

    if arch == "NemotronHForCausalLM":
        hf = save_backbone_model(tmp_path, arch, layers_block_type=["mamba", "moe", "attention", "mlp"],
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 moe_shared_expert_intermediate_size=48)
    else:
        hf = save_hybrid(tmp_path, **SHAPES["dense_nope"])
    prompts = _prompts(hf.config.vocab_size)[:3] + _prompts(hf.config.vocab_size, (1,))
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
                     gpu_memory_utilization=0.3)
    assert isinstance(llm.engine.runner.graphs, DecodeGraphRunner) is (arch == "GraniteMoeHybridForCausalLM")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:3]
    for prompt, tokens in zip(prompts[::-1], want[::-1], strict=True):
        assert llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids == tokens
    # the second time, each prompt of more than one block resumed from the prefix cache's state
    assert llm.engine.block_manager.stats.hit_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    graphs = llm.engine.runner.graphs
    if isinstance(graphs, DecodeGraphRunner):
        # a state grown to new memory (as when a step needs more rows than allocated): the graphs, captured on the
        # old memory, are dropped and decode runs eagerly, with the same tokens
        assert graphs.graphs
        llm.engine.runner.model.allocate_recurrent_state(32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], _greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want[:3]
        assert not graphs.graphs
    llm.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sleep_frees_the_states_without_a_host_copy(tmp_path):
    """Sleep mode frees the Mamba states (rows and prefix-cache states) with no host copy; after waking (states
    zeroed, decode graphs captured again) the tokens are transformers' again."""
    hf = save_hybrid(tmp_path, **SHAPES["dense_nope"])
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=8, enable_sleep_mode=True,
                     gpu_memory_utilization=0.3)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(reqs, _greedy(), use_tqdm=False)] == want
    runner = llm.engine.runner
    state = runner.model.recurrent_state
    llm.sleep(level=1)
    assert state.ssm.untyped_storage().nbytes() == 0 and state.saved_ssm.untyped_storage().nbytes() == 0
    assert runner._offloaded.host_bytes == runner._offloaded.nbytes - state.nbytes
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(reqs, _greedy(), use_tqdm=False)] == want
    llm.close()


@pytest.mark.parametrize("arch", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_mamba1_prefix_cache_and_tensor_parallel_workers(arch, tmp_path):
    """Mamba-1 mixers resume from the prefix cache's states (a boundary inside a chunk: the scan split there; a next
    turn) and split their channels over two tensor-parallel worker processes: the tokens stay transformers'."""
    from conftest import generate_on_tp_workers

    hf = save_backbone_model(tmp_path, arch)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4, block_size=4,
                     max_num_batched_tokens=10, mamba_cache_slots=8)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(reqs, _greedy(), use_tqdm=False)] == want
    assert _hits(llm) == sum((len(p) - 1) // 4 * 4 for p in prompts)
    turn = prompts[-1] + want[-1] + [5, 6, 7]
    before = _hits(llm)
    out = llm.generate({"prompt_token_ids": turn}, _greedy(), use_tqdm=False)[0]
    assert _hits(llm) - before > len(prompts[-1]) and out.outputs[0].token_ids == hf_greedy(hf, turn)[0]
    llm.close()
    got = generate_on_tp_workers(tmp_path, reqs, _greedy())
    assert [o.outputs[0].token_ids for o in got] == want


def test_selective_scan_matches_the_recurrence():
    """Mamba-1's chunked scan against a float64 step-by-step recurrence, from a nonzero state, with chunks that do
    not divide the length."""
    from plinth.model_registry.layers.mamba import selective_scan

    g = torch.Generator().manual_seed(0)
    length, d, n = 13, 6, 4
    x, dt = torch.randn(length, d, generator=g), torch.rand(length, d, generator=g)
    a = -torch.rand(d, n, generator=g) * 3
    b, c = torch.randn(length, n, generator=g), torch.randn(length, n, generator=g)
    state = torch.randn(d, n, generator=g)
    h, want = state.double(), []
    for t in range(length):
        h = torch.exp(dt[t, :, None].double() * a.double()) * h + (dt[t] * x[t]).double()[:, None] * b[t].double()
        want.append(h @ c[t].double())
    for chunk in (1, 4, 5, 13):
        y, end = selective_scan(x, dt, a, b, c, state, chunk)
        assert torch.allclose(y.double(), torch.stack(want), atol=1e-5)
        assert torch.allclose(end.double(), h, atol=1e-5)


def save_jamba(path, **overrides) -> transformers.PreTrainedModel:
    """A random ``JambaForCausalLM``: attention on layers 1 and 3, experts on layers 1 and 3 (dense MLPs on 0 and 2)."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.JambaConfig(**{**dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False), **overrides},
        attn_implementation="eager")
    hf = transformers.JambaForCausalLM(cfg).eval()
    randomize_mamba(hf)
    with torch.no_grad():   # routers that prefer experts clearly (random ones give near ties)
        g = torch.Generator().manual_seed(5)
        for name, p in hf.named_parameters():
            if name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def test_jamba_matches_transformers(tmp_path):
    """Jamba (Mamba-1 layers with weighted inner norms, RoPE-less attention, dense and expert feed-forward blocks
    with unrenormalised top-k weights): greedy tokens and log-probabilities equal transformers' with chunked
    prefill; the prefix cache's states, two tensor-parallel worker processes and two pipeline stages give the same
    tokens."""
    from conftest import generate_on_tp_workers

    hf = save_jamba(tmp_path)
    reqs, want = twice_through_the_prefix_cache(tmp_path, hf)
    got = generate_on_tp_workers(tmp_path, reqs, _greedy())
    assert [o.outputs[0].token_ids for o in got] == [w[0] for w in want]
    got = generate_on_tp_workers(tmp_path, reqs, _greedy(), size=1, pp=2)   # two pipeline stages
    assert [o.outputs[0].token_ids for o in got] == [w[0] for w in want]


def twice_through_the_prefix_cache(path, hf) -> tuple[list[dict], list[tuple[list[int], list[float]]]]:
    """Greedy tokens and log-probabilities equal transformers' for prompts of 1 to 33 tokens (float32, 16 tokens a
    step, 4-token blocks), twice: the second time every prompt longer than a block resumes from the prefix cache's
    states. Returns the requests and transformers' ``(tokens, log-probabilities)``."""
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p) for p in prompts]
    llm = plinth.LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
                     block_size=4)
    assert llm.engine.runner.model.has_recurrent_state
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):
        outs = llm.generate(reqs, _greedy(logprobs=0), use_tqdm=False)
        for out, (tokens, lps) in zip(outs, want, strict=True):
            assert out.outputs[0].token_ids == tokens
            assert [next(iter(s.values())).logprob for s in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    assert _hits(llm) == sum((len(p) - 1) // 4 * 4 for p in prompts)
    llm.close()
    return reqs, want


def test_a_grown_state_keeps_its_rows():
    """Growing the state (a step needing more rows than allocated) keeps every row's states, zeroes the new rows and
    moves the scratch row to the end."""
    from plinth.model_registry.layers.mamba import RecurrentState

    state = RecurrentState(2, 3, (4, 2), (2, 3, 5), torch.float32, torch.device("cpu"), slots=1)
    state.conv.normal_()
    state.ssm.normal_()
    conv, ssm = state.conv[:, :3].clone(), state.ssm[:, :3].clone()
    state.grow(7)
    assert state.rows == 7 and state.scratch_row == 7 and state.conv.shape[1] == state.ssm.shape[1] == 8
    assert torch.equal(state.conv[:, :3], conv) and torch.equal(state.ssm[:, :3], ssm)
    assert not state.conv[:, 3:].any() and not state.ssm[:, 3:].any()


def test_a_failed_step_leaves_no_unwritten_state_in_the_prefix_cache(tmp_path):
    """A step that fails before its saves ran: the checkpoints it was to write are dropped (one would have gone to
    another prompt's cached block whose state was never kept, which a later request would then have resumed from);
    the later request's tokens are transformers'."""
    hf = save_hybrid(tmp_path, **SHAPES["mamba_only"])
    g = torch.Generator().manual_seed(7)
    p1, other = (torch.randint(3, hf.config.vocab_size, (12,), generator=g).tolist() for _ in range(2))
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, block_size=4, mamba_cache_slots=2)
    engine = llm.engine
    llm.generate({"prompt_token_ids": other}, _greedy(2), use_tqdm=False)
    llm.generate({"prompt_token_ids": p1}, _greedy(2), use_tqdm=False)
    real = engine.executor.execute

    def failing(*args, **kwargs):
        raise RuntimeError("device error")

    engine.executor.execute = failing
    with pytest.raises(RuntimeError, match="device error"):
        # shares p1's first block, whose state is not kept: computes it again, planning its checkpoint there
        llm.generate({"prompt_token_ids": p1[:4] + [11]}, _greedy(2), use_tqdm=False)
    engine.executor.execute = real
    prompt = p1[:4] + [21, 22, 23]
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)[0]
    llm.close()


def test_a_checkpoint_evicted_in_the_step_that_saves_it_is_not_written_twice(tmp_path):
    """A decode's rolling checkpoint lands on another (finished) request's cached block with the same tokens; a
    request admitted in the same step evicts that block and takes a slot: each slot gets one save, and a later
    prompt resuming from the new request's checkpoint gets transformers' tokens."""
    hf = save_hybrid(tmp_path, **SHAPES["mamba_only"])
    g = torch.Generator().manual_seed(5)
    p = torch.randint(3, hf.config.vocab_size, (9,), generator=g).tolist()
    c = torch.randint(3, hf.config.vocab_size, (30,), generator=g).tolist()
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64, block_size=4, num_blocks=12, max_num_seqs=4,
                     max_num_batched_tokens=64, mamba_cache_slots=3)
    engine, bm = llm.engine, llm.engine.block_manager
    plans = []
    take = bm.take_state_plan
    bm.take_state_plan = lambda: plans.append(take()) or plans[-1]
    llm.generate({"prompt_token_ids": p}, _greedy(8), use_tqdm=False)
    engine.add_request("A", p, _greedy(8))
    for _ in range(3):
        engine.step()
    engine.add_request("C", c, _greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    for _, saves in plans:
        slots = [slot for planned in saves.values() for _, slot in planned]
        assert len(slots) == len(set(slots)), saves
    prompt = c[:28] + [7, 8, 9]
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)[0]
    llm.close()


@pytest.mark.parametrize("arch", ["granite", "MambaForCausalLM"])
def test_a_shared_system_prompt_keeps_its_state(arch, tmp_path):
    """Prompts that share a 20-token head (a system prompt) and go on differently: the second finds the head's keys
    and values cached without a state there, so it saves one at the end of those blocks (16 tokens, 8-token blocks;
    its one prompt chunk scanned in three parts, with the save before its last token); the third resumes from it.
    Tokens are transformers' (Mamba-2 and Mamba-1 mixers)."""
    hf = save_hybrid(tmp_path, **SHAPES["dense_nope"]) if arch == "granite" else save_backbone_model(tmp_path, arch)
    g = torch.Generator().manual_seed(11)
    head = torch.randint(2, hf.config.vocab_size, (20,), generator=g).tolist()
    prompts = [head + torch.randint(2, hf.config.vocab_size, (k,), generator=g).tolist() for k in (9, 5, 12)]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, block_size=8)
    hits = []
    for p in prompts:
        before = _hits(llm)
        assert llm.generate({"prompt_token_ids": p}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids == \
            hf_greedy(hf, p)[0]
        hits.append(_hits(llm) - before)
    assert hits == [0, 0, 16]
    llm.close()
