"""The engine's per-step host path end to end on a tiny Llama: flat batches with the persistent block
table and kept sampling tensors give the tokens of the general path (entries rebuilt from the
requests, sampling parameters rebuilt every step), through preemption and prefix-cache hits;
``detokenize=False``; streamed outputs are snapshots."""

from __future__ import annotations

import pytest

from plinth import LLM, SamplingParams
from plinth.core.request import SamplingParamsError
from plinth.core.sampler import SamplingBatch
from plinth.worker.batching import FlatBatch

PROMPTS = [
    "The quick brown fox",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is",
    "Continuous batching keeps",
    "0123",
]


def _params() -> list[SamplingParams]:
    """Penalties (kept output counts), seeds, min_tokens, top-k/top-p and greedy rows side by side."""
    return [
        SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.4, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3, max_tokens=26, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.8, seed=3, min_tokens=5, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=11, frequency_penalty=-0.5, max_tokens=22, ignore_eos=True),
    ]


def _general_path(llm: LLM) -> None:
    """Make the engine hand its executor plain entry lists and rebuild sampling parameters each step."""
    engine = llm.engine
    execute = engine.executor.execute

    def as_entries(batch, make_batch):
        assert isinstance(batch, FlatBatch)
        return execute(list(batch), make_batch)

    engine.executor.execute = as_entries
    engine._sampling.build = lambda reqs, device: SamplingBatch.from_requests(reqs, engine.vocab_size, device)


def _run(llm: LLM) -> list[tuple[list[int], str, list]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text,
             [sorted(p) for p in o.outputs[0].logprobs] if o.outputs[0].logprobs else None) for o in outs]


@pytest.fixture(scope="module")
def general(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    _general_path(llm)
    return _run(llm)


@pytest.mark.parametrize("num_blocks", [None, 26])
def test_flat_path_equals_the_general_path(tiny_llama_dir, general, num_blocks):
    kw = {"num_blocks": num_blocks} if num_blocks else {}
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, max_num_batched_tokens=16, **kw)
    first = _run(llm)
    second = _run(llm)                                    # the prompts again: prefix-cache hits
    assert first == second == general
    engine = llm.engine
    assert engine.block_manager.stats.hit_blocks > 0
    assert engine._sampling.num_rebuilds <= 30            # kept while the batch holds the same requests (of ~70 steps)
    if num_blocks:
        assert engine.scheduler.stats().num_preemptions > 0
    engine.step()                                         # reports the last finished ids: their rows go
    assert engine._batch_builder.block_table.num_rows_in_use == 0


def test_detokenize_false_keeps_the_tokens_and_skips_the_text(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_text = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    without = llm.generate(PROMPTS[:2], greedy.clone(detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text
        assert b.outputs[0].text == ""
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(stop=["fox"], detokenize=False)


def test_sampling_params_are_checked_when_the_request_arrives(tiny_llama_dir):
    """Values set after a SamplingParams was built are checked when its request arrives (n = 0 never finishing
    before), something else than a SamplingParams is a TypeError naming it, and a bad stop is refused when built."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for field, value in (("n", 0), ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                         ("stop_token_ids", "x")):
        bad = params.clone()
        setattr(bad, field, value)
        with pytest.raises(SamplingParamsError, match=field):
            llm.generate(PROMPTS[:2], bad, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .or one per prompt., got dict"):
        llm.generate(PROMPTS[:1], {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="stop: must be a list, got int"):
        SamplingParams(stop=5)
    with pytest.raises(SamplingParamsError, match="stop: must be valid Unicode text"):
        SamplingParams(stop=["ok", "\ud800"])   # (what JSON's lone surrogate escape decodes to: it could never match)
    for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
        with pytest.raises(SamplingParamsError, match=f"{field}: must be true or false, got 'no'"):
            SamplingParams(**{field: "no"})   # a truthy string would have meant True
    for prompts in (None, 5):
        with pytest.raises(TypeError, match="prompts must be a prompt"):
            llm.generate(prompts, params, use_tqdm=False)
    assert SamplingParams(stop_token_ids=7).stop_token_ids == [7]
    out = llm.generate(PROMPTS[:1], params.clone(logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    # each log-probability's decoded_token is the token's text (vLLM's), not its vocabulary entry ("Ġthe")
    tokenizer = llm.get_tokenizer()
    assert all(lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False)
               for pos in out.logprobs for tid, lp in pos.items())


def test_streamed_outputs_are_snapshots(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"s{i}", p, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append((len(out.outputs[0].token_ids), out.outputs[0].token_ids,
                                                        out.outputs[0].text))
    final = {o.request_id: o.outputs[0] for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)}
    for i in range(3):
        history = seen[f"s{i}"]
        assert [n for n, _, _ in history] == list(range(1, 11))
        assert all(len(ids) == n for n, ids, _ in history)     # not grown by later steps
        texts = [t for _, _, t in history]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
        assert history[-1][1] == final[f"llm-{i}"].token_ids and texts[-1] == final[f"llm-{i}"].text
