"""SamplingParams.output_kind (vLLM's RequestOutputKind) on the async engine: deltas that add up to the cumulative
outputs, or the final output alone."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from plinth import LLM, RequestOutputKind, SamplingParams
from plinth.core.request import SamplingParamsError

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is"]


def params(kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=20, logprobs=2, prompt_logprobs=1,
                          stop=["e"], output_kind=kind)


def collect(llm: LLM, kind: RequestOutputKind, lag: float = 0.0) -> list[list]:
    from plinth.core.async_engine import AsyncLLMEngine

    front = AsyncLLMEngine(llm.engine)

    async def one(i: int) -> list:
        outs = []
        async for out in front.generate(f"r{i}", PROMPTS[i], params(kind)):
            outs.append(out)
            await asyncio.sleep(lag)   # a slow reader: outputs it missed are merged into the next one
        return outs

    async def main() -> list[list]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 120)

    try:
        return asyncio.run(main())
    finally:
        front.shutdown()


def same_logprobs(a: list, b: list) -> bool:
    """The same tokens at every position, their logprobs within 1e-4."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", selection="off", max_num_seqs=2)


@pytest.fixture(scope="module")
def finals(llm) -> list:
    return [outs[-1] for outs in collect(llm, RequestOutputKind.CUMULATIVE)]


@pytest.mark.parametrize("lag", [0.0, 0.02], ids=["prompt-reader", "slow-reader"])
def test_deltas_add_up_to_the_cumulative_output(llm, finals, lag):
    streams = collect(llm, RequestOutputKind.DELTA, lag)
    for outs, final in zip(streams, finals, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[0].prompt_logprobs == final.prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outs[1:])
        for want in final.outputs:
            parts = [c for o in outs for c in o.outputs if c.index == want.index]
            assert "".join(c.text for c in parts) == want.text
            assert [t for c in parts for t in c.token_ids] == want.token_ids
            # (values within float noise: the two runs batch the requests at different moments)
            assert same_logprobs([p for c in parts for p in c.logprobs], want.logprobs)
            assert parts[-1].finish_reason == want.finish_reason and parts[-1].stop_reason == want.stop_reason
            assert parts[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
            assert all(c.token_ids or c.text or c.finished for c in parts)   # nothing empty is handed out


def test_final_only_yields_the_final_output(llm, finals):
    streams = collect(llm, RequestOutputKind.FINAL_ONLY)
    assert [len(outs) for outs in streams] == [1, 1]
    for (out,), final in zip(streams, finals, strict=True):
        assert out.finished and [c.token_ids for c in out.outputs] == [c.token_ids for c in final.outputs]
    assert [c.text for c in out.outputs] == [c.text for c in final.outputs]
    assert all(same_logprobs(a.logprobs, b.logprobs) for a, b in zip(out.outputs, final.outputs, strict=True))


def test_offline_calls_return_final_outputs_and_bad_kinds_are_refused(llm, finals):
    got = llm.generate(PROMPTS, params(RequestOutputKind.DELTA), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in f.outputs] for f in finals]
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(SamplingParamsError, match="output_kind: must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_outputs_do_not_share_the_engines_logprobs_list(llm):
    """An output handed out keeps its logprobs as they were (the engine's own list grows with later tokens), so a
    delta never carries logprobs of tokens it does not hold."""
    from plinth.core.async_engine import _Delta

    engine = llm.engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = out
    c = first.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) < 6
    delta = _Delta()
    grown = dataclasses.replace(first, outputs=[dataclasses.replace(c, logprobs=c.logprobs + [{}])])
    assert len(delta.next(grown).outputs[0].logprobs) == len(c.token_ids)
