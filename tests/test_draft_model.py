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


def test_bad_drafts_are_refused_at_start(models, tmp_path):
    target, _ = models
    big = save_tiny_model(tmp_path / "big", seed=2, vocab_size=600)
    with pytest.raises(ConfigError, match="draft model's vocabulary"):
        llm_for(target, draft=big)
    with pytest.raises(Exception, match="nothing-here"):
        llm_for(target, draft=tmp_path / "nothing-here")
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
