"""Models with gated DeltaNet layers: Qwen3-Next (``Qwen3NextForCausalLM``), Qwen3.5 (``Qwen3_5ForCausalLM``, and
the language model of a ``Qwen3_5ForConditionalGeneration`` checkpoint) and Qwen3.5-MoE, against transformers running
the same random weights (float32), and the chunked scan against a float64 step-by-step recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_tokenizer
from test_mamba_models import (
    _greedy,
    _hits,
    _prompts,
    engine_greedy_matches,
    hf_greedy,
    twice_through_the_prefix_cache,
)

import plinth
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.layers.gated_delta import GatedDeltaNetMixer, gated_delta_scan

#: a hybrid of four layers (DeltaNet, gated attention, DeltaNet, DeltaNet), two key heads read by four value heads
_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


@torch.no_grad()
def _randomize(hf: transformers.PreTrainedModel) -> None:
    """Decay rates, time-step biases and norms away from their initial constants; routers that prefer experts
    clearly (random small ones give near ties)."""
    g = torch.Generator().manual_seed(3)
    for name, p in hf.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):   # a plain weight
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif "norm" in name:                              # the (1 + w) norms' w
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g))


def save_model(path, arch: str, **overrides) -> transformers.PreTrainedModel:
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                  bos_token_id=tokenizer.bos_token_id, **_TEXT)
    if arch == "Qwen3NextForCausalLM":   # experts on layers 0, 1 and 3, a dense MLP on layer 2
        cfg = transformers.Qwen3NextConfig(**{**common, **_EXPERTS, "mlp_only_layers": [2], **overrides},
                                           attn_implementation="eager")
    elif arch == "Qwen3_5ForCausalLM":
        cfg = transformers.Qwen3_5TextConfig(**{**common, **overrides}, attn_implementation="eager")
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**{**common, **_EXPERTS, **overrides}, attn_implementation="eager")
    hf = getattr(transformers, arch)(cfg).eval()
    _randomize(hf)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


def _recurrence(q, k, v, g, beta, state):
    """The gated delta rule one position at a time, in float64."""
    s, out = state.double(), []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t].double())[:, None, None]
        write = (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double())) * beta[t].double()[:, None]
        s = s + k[t].double()[:, :, None] * write[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(out), s


@pytest.mark.parametrize("length,chunk,at_once", [(1, 64, 32), (7, 8, 32), (8, 8, 32), (37, 16, 32), (37, 1, 32),
                                                  (130, 64, 32), (37, 4, 2), (300, 8, 32)])
def test_chunked_scan_matches_the_recurrence(length, chunk, at_once):
    """The chunked form (the chunks' triangular solves batched ``at_once`` chunks at a time, the state passed from
    chunk to chunk) equals the step-by-step rule, outputs and final state, from a nonzero state, for lengths that
    fill chunks exactly, leave a remainder, fit in one, or span several batches of chunks."""
    g = torch.Generator().manual_seed(length * 100 + chunk)
    heads, dk, dv = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 2
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    want_out, want_state = _recurrence(q, k, v, decay, beta, state)
    out, end = gated_delta_scan(q, k, v, decay, beta, state, chunk, at_once)
    assert out.shape == (length, heads, dv) and end.shape == (heads, dk, dv)
    assert torch.allclose(out.double(), want_out, atol=2e-5)
    assert torch.allclose(end.double(), want_state, atol=2e-5)


@pytest.mark.parametrize("span", [False, True], ids=["gathered", "span"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_decode_step_matches_the_rule(span, native, monkeypatch):
    """The decode step (the native CPU kernel, and the torch ops that run where it is not built, rows gathered and
    scattered or a span updated in place) against the float64 rule: outputs, the step's rows updated, the other rows
    untouched."""
    from plinth.kernels import cpu_native
    from plinth.model_registry.layers.gated_delta import gated_delta_step

    if native and not cpu_native.gated_delta_step_enabled(torch.zeros(1)):
        pytest.skip("the native CPU kernels are not built here")
    if not native:
        monkeypatch.setattr(cpu_native, "gated_delta_step_enabled", lambda state: False)

    g = torch.Generator().manual_seed(int(span))
    rows = torch.tensor([2, 3, 4]) if span else torch.tensor([4, 1, 2])
    heads, kd, vd = 3, 16, 24
    ssm = torch.randn(6, heads, kd, vd, generator=g)
    before = ssm.clone()
    q, k = (torch.nn.functional.normalize(torch.randn(3, heads, kd, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(3, heads, vd, generator=g)
    decay, beta = -torch.rand(3, heads, generator=g), torch.rand(3, heads, generator=g)
    out = gated_delta_step(ssm, rows, q, k, v, decay, beta, (2, 5) if span else None)
    want_out, want_state = [], []
    for i, r in enumerate(rows.tolist()):
        o, s = _recurrence(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], before[r])
        want_out.append(o[0])
        want_state.append(s)
    torch.testing.assert_close(out.double(), torch.stack(want_out), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm[rows].double(), torch.stack(want_state), atol=1e-5, rtol=1e-5)
    others = [i for i in range(6) if i not in rows.tolist()]
    assert torch.equal(ssm[others], before[others])


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_transformers(arch, tmp_path):
    """Greedy tokens and their log-probabilities equal transformers' for prompts of 1 to 33 tokens with chunked
    prefill (16 tokens a step); run again, every prompt longer than a block resumes from the prefix cache's states
    (4-token blocks: checkpoints inside chunks) with the same tokens. The checkpoint's multi-token-prediction
    tensors (``mtp.*``) are skipped."""
    from safetensors.torch import load_file, save_file

    hf = save_model(tmp_path, arch)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(256, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    twice_through_the_prefix_cache(tmp_path, hf)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_image_text_checkpoint_runs_its_language_model(tied, tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint (``model.language_model.*``, a vision tower, a multimodal
    RoPE with interleaved sections) runs its language model alone: text prompts give transformers' tokens. Tied by
    the top-level flag (the text config's saying otherwise), its file has no LM head: the embeddings serve."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    text = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                bos_token_id=tokenizer.bos_token_id, **_TEXT,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                         num_heads=2, out_hidden_size=64),
                                     tie_word_embeddings=tied, attn_implementation="eager")
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine_greedy_matches(tmp_path, hf, _prompts(len(tokenizer), (5, 19)), 8)


def test_stacked_expert_tensors(tmp_path):
    """Experts stored stacked, as transformers holds them (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``: Qwen3.5-MoE checkpoints' layout), load as the per-expert tensors do; a
    stacked tensor of the wrong rank is refused by name."""
    from safetensors.torch import save_file

    hf = save_model(tmp_path, "Qwen3_5MoeForCausalLM")
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    engine_greedy_matches(tmp_path, hf, _prompts(hf.config.vocab_size))
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][0]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.experts.down_proj: expected \[experts"):
        plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128)


@pytest.mark.parametrize("arch,tp,pp", [("Qwen3NextForCausalLM", 2, 1), ("Qwen3_5ForCausalLM", 2, 1),
                                        ("Qwen3NextForCausalLM", 1, 2)])
def test_worker_processes_match_transformers(arch, tp, pp, tmp_path):
    """Two tensor-parallel worker processes (one key head and its two value heads each; Qwen3.5's q/k/v rows cut out
    of one tensor, Qwen3-Next's per-key-head rows in one range), or two pipeline stages (each keeping its DeltaNet
    layers' state): transformers' tokens."""
    from conftest import generate_on_tp_workers

    hf = save_model(tmp_path, arch)
    prompts = _prompts(hf.config.vocab_size)
    got = generate_on_tp_workers(tmp_path, [{"prompt_token_ids": p} for p in prompts], _greedy(), size=tp, pp=pp)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p)[0] for p in prompts]


def test_bfloat16_and_fp8_on_the_cpu_path(tmp_path):
    """bfloat16 (the CPU platform's packed GEMMs; the float32 scans and states) and ``--quantization fp8`` (the
    DeltaNet projections quantized too): the first greedy tokens agree with the float32 reference (a near tie may
    part later ones)."""
    hf = save_model(tmp_path, "Qwen3NextForCausalLM")
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p, 2)[0] for p in prompts]
    for kwargs in (dict(dtype="bfloat16"), dict(dtype="float32", quantization="fp8")):
        llm = plinth.LLM(str(tmp_path), max_model_len=128, **kwargs)
        if "quantization" in kwargs:
            proj = llm.engine.runner.model.model.layers[0].mamba.in_proj_qkvz
            assert not hasattr(proj, "weight") or proj.weight.dtype != torch.float32
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(2), use_tqdm=False)
        agree = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want, strict=True))
        assert agree >= len(prompts) - 1, kwargs
        llm.close()


def test_bad_shapes_are_refused_clearly():
    """Key heads that do not divide over the ranks, value heads that are not a multiple of the key heads, and
    checkpoint tensors of the wrong shapes fail with messages that say so."""
    with pytest.raises(UnsupportedModelError, match="2 key heads cannot be split over 4 tensor-parallel ranks"):
        GatedDeltaNetMixer(64, 2, 4, 16, 8, 4, 1e-6, tp_size=4)
    with pytest.raises(ModelLoadError, match="5 value heads do not divide into 2 key heads"):
        GatedDeltaNetMixer(64, 2, 5, 16, 8, 4, 1e-6)
    mixer = GatedDeltaNetMixer(64, 2, 4, 16, 8, 4, 1e-6)
    with pytest.raises(ModelLoadError, match=r"norm: expected \(8,\)"):
        mixer.norm.weight.weight_loader(mixer.norm.weight, torch.ones(32))
    with pytest.raises(ModelLoadError, match="one value per value head"):
        mixer.A_log.weight_loader(mixer.A_log, torch.ones(2))
    with pytest.raises(ModelLoadError, match="conv1d: expected 96 channels"):
        mixer.conv1d.weight.weight_loader(mixer.conv1d.weight, torch.ones(64, 1, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_gpu_engine_matches_transformers(arch, tmp_path):
    """On a GPU, float32: greedy tokens equal transformers' three at a time (decode graphs padded to 4 rows for
    Qwen3.5; Qwen3-Next's expert loop decodes eagerly) and again one after another from the prefix cache."""
    from plinth.worker.cuda_graphs import DecodeGraphRunner

    hf = save_model(tmp_path, arch)
    prompts = _prompts(hf.config.vocab_size)[:3] + _prompts(hf.config.vocab_size, (1,))
    want = [hf_greedy(hf, p)[0] for p in prompts]
    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
                     gpu_memory_utilization=0.3)
    if arch == "Qwen3_5ForCausalLM":
        assert isinstance(llm.engine.runner.graphs, DecodeGraphRunner)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:3]
    for prompt, tokens in zip(prompts[::-1], want[::-1], strict=True):
        assert llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert _hits(llm) == sum((len(p) - 1) // 16 * 16 for p in prompts)
    llm.close()
