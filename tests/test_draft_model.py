"""Speculative decoding with a draft model (``speculative_config={"model": ..., "num_speculative_tokens": k}``):
the target's outputs are exactly those without drafts (greedy and seeded), whatever the draft model says; a draft
that is the target itself has every draft accepted; the draft's KV follows preemption, the prefix cache, chunked
prompts and the context limit; bad drafts are refused at start."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model

from plinth import LLM, SamplingParams
from plinth.config import ConfigError

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "0123 0123 0123 0123",
           "a b c a b c a b"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = save_tiny_model(root / "target", seed=0)
    # a smaller draft of another architecture and shape (its own attention shapes), the same tokenizer
    other = save_tiny_model(root / "other", arch="qwen2", seed=1, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return target, other


def llm_for(path, draft=None, k=3, **kw):
    spec = {"speculative_config": {"model": str(draft), "num_speculative_tokens": k}} if draft is not None else {}
    return LLM(str(path), dtype="float32", selection="off", block_size=4, **spec, **kw)


class Outputs(list):
    """Each prompt's samples as (tokens, logprobs); equal when the tokens are, and the logprobs within 1e-4 (a GPU's
    GEMMs round a step of several rows apart from one of one row, at ~1e-6)."""

    def __eq__(self, other):
        return len(self) == len(other) and all(
            len(a) == len(b) and all(ta == tb and all(abs(x - y) < 1e-4 for x, y in zip(la, lb, strict=True))
                                     for (ta, la), (tb, lb) in zip(a, b, strict=True))
            for a, b in zip(self, other, strict=True))


def outputs(llm, params, prompts=PROMPTS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return Outputs([[(c.token_ids, [next(iter(p.values())).logprob for p in c.logprobs or []]) for c in o.outputs]
                    for o in outs])


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_the_target_alone(models, params):
    target, other = models
    want = outputs(llm_for(target), params)
    own = llm_for(target, draft=target)
    assert outputs(own, params) == want
    stats = own.engine.stats()["speculative"]
    if params is GREEDY:   # the target drafting for itself: every draft accepted, 1 + k tokens a step
        assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] > 3
    small = llm_for(target, draft=other)
    assert outputs(small, params) == want
    assert small.engine.draft.num_proposed > 0 and small.engine.stats()["speculative"]["acceptance_rate"] < 1.0
    # after a prompt's first catch-up, the tokens accepted since go as rows of one decode step (decode plan, graphs)
    assert own.engine.draft.row_passes > 0


def test_preemption_prefix_cache_chunked_prompts_and_the_context_limit(models):
    target, _ = models
    prompts = PROMPTS + [PROMPTS[1] + " and Rome is", "x " * 22]
    want = outputs(llm_for(target, max_model_len=64), GREEDY, prompts)
    # few blocks (requests preempted and computed again), a small step budget (prompts in chunks), the prefix
    # cache (the second round's prompts hit blocks computed in the first), outputs that run into max_model_len
    llm = llm_for(target, draft=target, k=5, max_model_len=64, num_blocks=24, max_num_batched_tokens=16,
                  max_num_seqs=4)
    for _ in range(2):
        assert outputs(llm, GREEDY, prompts) == want
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["speculative"]["acceptance_rate"] > 0.9   # (drafts past a preempted request's blocks are redone)


def test_a_draft_with_fewer_tokens_or_a_shorter_context(models, tmp_path):
    """A target whose vocabulary has ids the draft lacks (its outputs use them), and a draft of learned positions
    shorter than the target's context: the draft never sees an id or a position it does not have."""
    import torch
    import transformers
    from conftest import decisive_weights, make_tokenizer

    target, other = models
    wide = save_tiny_model(tmp_path / "wide", seed=0, vocab_size=400)   # ids 300-399: padding rows of the tokenizer
    want = outputs(llm_for(wide), GREEDY)
    assert any(t >= 300 for prompt in want for tokens, _ in prompt for t in tokens)
    assert outputs(llm_for(wide, draft=other), GREEDY) == want
    tok = make_tokenizer()
    torch.manual_seed(0)
    gpt2 = decisive_weights(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=32, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)).eval())
    gpt2.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2]   # 60+ tokens: past the draft's 32 positions
    want = outputs(llm_for(target, max_model_len=128), GREEDY, prompts)
    assert outputs(llm_for(target, draft=tmp_path / "gpt2", max_model_len=128), GREEDY, prompts) == want


def test_a_failing_draft_turns_drafting_off(models, monkeypatch):
    """Drafts are an optimization: a draft pass that fails is logged and the engine goes on without drafts."""
    from plinth.core.draft_model import DraftProposer

    target, other = models
    want = outputs(llm_for(target), GREEDY)
    llm = llm_for(target, draft=other)

    def broken(self, first):
        raise RuntimeError("the draft's device fell over")

    monkeypatch.setattr(DraftProposer, "propose_all", broken)
    assert outputs(llm, GREEDY) == want
    assert llm.engine.draft.failed


def test_bad_drafts_are_refused_at_start(models, tmp_path):
    target, _ = models
    big = save_tiny_model(tmp_path / "big", seed=2, vocab_size=600)
    with pytest.raises(ConfigError, match="draft model's vocabulary"):
        llm_for(target, draft=big)
    with pytest.raises(Exception, match="nothing-here"):
        llm_for(target, draft=tmp_path / "nothing-here")
    import json
    import shutil

    quantized = tmp_path / "quantized"
    shutil.copytree(target, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"checkpoint is quantized \(fp8\): a draft model loads unquantized"):
        llm_for(target, draft=quantized)
    with pytest.raises(ConfigError, match="runs in one process"):
        llm_for(target, draft=target, tensor_parallel_size=2, distributed_executor="mp", platform="cpu")
    with pytest.raises(ConfigError, match="needs the draft model"):
        LLM(str(target), speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_sleep_mode_sleeps_the_draft_too(models):
    target, _ = models
    want = outputs(llm_for(target), GREEDY)
    llm = llm_for(target, draft=target, enable_sleep_mode=True)
    assert outputs(llm, GREEDY) == want
    draft = llm.engine.draft.runner
    llm.sleep()
    assert draft.asleep and draft.kv_caches == []
    llm.wake_up()
    assert not draft.asleep and outputs(llm, GREEDY) == want
    assert llm.engine.stats()["speculative"]["acceptance_rate"] == 1.0


def test_the_draft_cache_fits_the_kv_budget_and_presets_draft(models, tmp_path):
    """The draft's scratch blocks come out of the KV-cache budget (with the draft's per-block bytes); a preset name
    drafts with random weights of its shape whatever the target loads from; a missing draft path says it is the
    draft's."""
    from plinth.errors import ModelLoadError

    target, other = models
    budget = 1 << 20
    llm = llm_for(target, draft=other, cpu_kv_cache_bytes=budget, platform="cpu")   # (the CPU's budget in bytes)
    engine = llm.engine
    total = engine.runner.kv_cache_bytes + engine.draft.runner.kv_cache_bytes
    assert total <= budget, (engine.runner.kv_cache_bytes, engine.draft.runner.kv_cache_bytes)
    wide = save_tiny_model(tmp_path / "wide", seed=0, vocab_size=1024)   # the tiny-llama preset's vocabulary
    with_preset = llm_for(wide, draft="tiny-llama")
    assert outputs(with_preset, GREEDY) == outputs(llm_for(wide), GREEDY)
    assert with_preset.engine.draft.num_proposed > 0
    with pytest.raises(ModelLoadError, match="the draft model .speculative_config's model.: model path"):
        llm_for(target, draft="/nonexistent-draft")
