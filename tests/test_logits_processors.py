"""Custom logits processors (plinth.core.logits_processors): installed on the engine, fed each row's tokens so far
and its request's extra_args, run in worker processes too; their refusals and failures end only their requests."""

from __future__ import annotations

import dataclasses
import re
import threading
import types

import pytest
import torch
from engine_driving import drive

from plinth import LLM, SamplingParams
from plinth.config import ConfigError, EngineConfig
from plinth.core.logits_processors import LogitsProcessor, LogitsProcessorError, resolve_processors
from plinth.core.request import SamplingParamsError
from plinth.core.scheduler import RequestRejectedError
from plinth.errors import RequestFailedError

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France, and Berlin is",
    "0123",
    "Caf\u00e9 na\u00efve",
]


class NoRepeat(LogitsProcessor):
    """Bans the token before the one being chosen (the prompt's last for the first output token)."""

    def apply(self, logits, rows):
        for j, row in enumerate(rows):
            logits[j, (row.output_token_ids or row.prompt_token_ids)[-1]] = float("-inf")
        return logits


class Keyed(LogitsProcessor):
    """Applies to the requests whose extra_args hold ``KEY``."""

    KEY = ""

    @classmethod
    def applies_to(cls, params):
        return cls.KEY in (params.extra_args or {})


class BiasFromArgs(Keyed):
    """Adds ``extra_args["bias"]`` ({token id as text: value}) to the logits: what ``logit_bias`` does."""

    KEY = "bias"

    @classmethod
    def validate_params(cls, params):
        bias = params.extra_args["bias"]
        if not isinstance(bias, dict) or not all(str(k).isdigit() for k in bias):
            raise ValueError(f"bias must map token ids to numbers, got {bias!r}")

    def apply(self, logits, rows):
        out = logits.clone()   # a new tensor is taken as well as one changed in place
        for j, row in enumerate(rows):
            for token, value in row.extra_args["bias"].items():
                out[j, int(token)] += value
        return out


class BiasOrBoom(BiasFromArgs):
    """BiasFromArgs that raises when any of its rows asks for "boom" (a failure of the whole call)."""

    def apply(self, logits, rows):
        if any(row.extra_args.get("boom") for row in rows):
            raise RuntimeError("boom")
        return super().apply(logits, rows)


class ForceThenBoom(Keyed):
    """Forces token 7, and raises once 3 tokens are out."""

    KEY = "force"

    def apply(self, logits, rows):
        if any(len(row.output_token_ids) >= 3 for row in rows):
            raise RuntimeError("late")
        logits[:, 7] = 1e4
        return logits


class NaNs(Keyed):
    KEY = "nan"

    def apply(self, logits, rows):
        return torch.full_like(logits, float("nan") if rows[0].extra_args["nan"] else float("-inf"))


class NoInit(Keyed):
    KEY = "noinit"

    def __init__(self, vocab_size, device):
        raise OSError("no such file")


class BadCheck(Keyed):
    KEY = "badcheck"

    @classmethod
    def validate_params(cls, params):
        raise KeyError("nope")

    def apply(self, logits, rows):
        return logits


class AskedOnce(LogitsProcessor):
    """applies_to raises when asked a second time about the same parameters (it is asked once per request, on
    arrival)."""

    asked: set = set()

    @classmethod
    def applies_to(cls, params):
        if id(params) in cls.asked:
            raise RuntimeError("asked twice")
        cls.asked.add(id(params))
        if (params.extra_args or {}).get("bug"):
            raise ValueError("a bug in applies_to")
        return False


class SeesNaN(LogitsProcessor):
    """Notes whether any row it is given holds a NaN (it runs after NaNs)."""

    saw_nan = False

    def apply(self, logits, rows):
        SeesNaN.saw_nan |= bool(torch.isnan(logits).any())
        return logits


class AlwaysBroken(LogitsProcessor):
    def apply(self, logits, rows):
        raise RuntimeError("always")


class Broken(Keyed):
    KEY = "boom"

    def apply(self, logits, rows):
        raise RuntimeError("boom")


class WrongShape(Keyed):
    KEY = "narrow"

    def apply(self, logits, rows):
        return logits[:, :5]


def llm_for(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    kw.setdefault("selection", "off")
    return LLM(str(path), **kw)


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir)


@pytest.fixture(scope="module")
def custom(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir, logits_processors=[BiasFromArgs, Broken, WrongShape])


def transformers_no_repeat(path, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of PROMPTS from transformers' generate with the same ban as a transformers LogitsProcessor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList
    from transformers import LogitsProcessor as HFProcessor

    class HFNoRepeat(HFProcessor):
        def __call__(self, input_ids, scores):
            scores[torch.arange(len(input_ids)), input_ids[:, -1]] = float("-inf")
            return scores

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([HFNoRepeat()]))
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True, "max_num_batched_tokens": 8, "max_num_seqs": 2}],
                         ids=["plain", "async-chunked"])
def test_same_tokens_as_transformers_with_the_same_processor(tiny_llama_dir, plain, kw):
    """A processor reading each row's latest token gives transformers' tokens with the same processor (with
    asynchronous scheduling asked for, chunked prefills and a two-row batch too); without it the output repeats."""
    reference = transformers_no_repeat(tiny_llama_dir, 24)
    llm = llm_for(tiny_llama_dir, logits_processors=[NoRepeat], **kw)
    got = tokens(llm.generate(PROMPTS, greedy(24), use_tqdm=False))
    assert got == reference
    free = tokens(plain.generate(PROMPTS, greedy(24), use_tqdm=False))
    assert any(a == b for out in free for a, b in zip(out[:-1], out[1:], strict=True)), "the ban changed nothing"
    assert all(a != b for out in got for a, b in zip(out[:-1], out[1:], strict=True))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_extra_args_reach_only_their_rows(plain, custom):
    """A processor adding extra_args' bias gives exactly what logit_bias gives (greedy, seeded sampling, the raw
    logprobs); requests in the same batch without extra_args get what an engine without processors gives."""
    token = tokens(plain.generate(PROMPTS[:1], greedy(4), use_tqdm=False))[0][2]
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 7}):
        common = dict(max_tokens=12, ignore_eos=True, logprobs=2, **kw)
        by_args = SamplingParams(extra_args={"bias": {str(token): 3.0}}, **common)
        by_bias = SamplingParams(logit_bias={token: 3.0}, **common)
        mixed = custom.generate(PROMPTS, [by_args, SamplingParams(**common)] * 2, use_tqdm=False)
        want = plain.generate(PROMPTS, [by_bias, SamplingParams(**common)] * 2, use_tqdm=False)
        for got, ref in zip(mixed, want, strict=True):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids
            # the same tokens and ranks; the values within float noise (the two engines batch differently)
            for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
                assert {t: p.rank for t, p in a.items()} == {t: p.rank for t, p in b.items()}
                assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=1e-4)
        if kw["temperature"] == 0.0:
            assert token in mixed[0].outputs[0].token_ids, "the bias changed nothing"


def test_validate_params_refuses_the_request(custom):
    with pytest.raises(RequestRejectedError, match="bias must map token ids to numbers") as info:
        custom.engine.add_request("bad", "hello", SamplingParams(extra_args={"bias": {"x": 1}}))
    assert info.value.param == "extra_args"
    assert not custom.engine.has_unfinished_requests()
    with pytest.raises(SamplingParamsError, match="extra_args: must be a mapping with string keys"):
        SamplingParams(extra_args=[1, 2])
    with pytest.raises(SamplingParamsError, match="extra_args"):
        SamplingParams(extra_args={1: "a"})


@pytest.mark.parametrize("args, message", [
    ({"boom": True}, "logits processor Broken failed: RuntimeError: boom"),
    ({"narrow": True}, r"logits processor WrongShape failed: LogitsProcessorError: apply returned \(1, 5\), not a "
                       r"tensor of shape \(1, \d+\)"),
], ids=["raises", "wrong-shape"])
def test_a_failing_processor_ends_only_its_requests(plain, custom, args, message):
    """The request whose processor failed ends with the error; the call's other requests finish as usual (their
    outputs travel with the error), and the engine serves the next call."""
    params = [greedy(), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, extra_args=args),
              greedy(), greedy()]
    with pytest.raises(RequestFailedError, match="1 of 4 request") as info:
        custom.generate(PROMPTS, params, use_tqdm=False)
    outs = info.value.outputs
    assert [o.error is not None for o in outs] == [False, True, False, False]
    assert re.search(message, outs[1].error)
    assert all(c.finish_reason == "abort" for c in outs[1].outputs)
    want = tokens(plain.generate(PROMPTS, greedy(), use_tqdm=False))
    assert [tokens([o])[0] for i, o in enumerate(outs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert tokens(custom.generate(PROMPTS, greedy(), use_tqdm=False)) == want
    bm = custom.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_speculative_decoding_with_a_processor(tiny_llama_dir):
    """Drafts are verified against the processed logits: the same tokens as without speculation."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
               "0123456789 0123456789 0123456789 01"]
    spec = llm_for(tiny_llama_dir, logits_processors=[NoRepeat],
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    base = llm_for(tiny_llama_dir, logits_processors=[NoRepeat])
    assert tokens(spec.generate(prompts, greedy(32), use_tqdm=False)) == \
        tokens(base.generate(prompts, greedy(32), use_tqdm=False))
    assert spec.engine.stats()["speculative"]["num_accepted_tokens"] > 0


def test_names_and_references(tiny_llama_dir):
    """Processors given as a class, 'module:Class', 'module.Class' or a name a plugin registers; a bad one is
    refused before the model loads, naming what is registered."""
    from plinth.plugins import get_plugin_manager, reset_plugin_manager

    here = __name__
    assert resolve_processors([NoRepeat, f"{here}:NoRepeat", f"{here}.BiasFromArgs"]) == (NoRepeat, NoRepeat,
                                                                                        BiasFromArgs)
    plugin = types.ModuleType("no_repeat_plugin")
    plugin.PLINTH_PLUGIN_API = "1.0"
    from plinth.hookspecs import hookimpl

    plugin.plinth_logits_processors = hookimpl(lambda: {"no-repeat": f"{here}:NoRepeat"})
    try:
        get_plugin_manager().register_module(plugin, "no_repeat_plugin")
        assert resolve_processors(["no-repeat"]) == (NoRepeat,)
        with pytest.raises(LogitsProcessorError, match=r"'nope' is not registered \(registered: no-repeat\)"):
            LLM("/nonexistent/model", logits_processors=["nope"])
    finally:
        reset_plugin_manager()
    with pytest.raises(LogitsProcessorError, match="'json:dumps' is not a subclass of "):
        resolve_processors(["json:dumps"])
    with pytest.raises(LogitsProcessorError, match="'no_such_module:X'"):
        resolve_processors(["no_such_module:X"])
    with pytest.raises(ConfigError, match="logits_processors must be a list"):
        EngineConfig.from_kwargs(logits_processors=[3])
    with pytest.raises(ConfigError, match="task 'embed' samples no tokens"):
        EngineConfig.from_kwargs(logits_processors=["x:Y"], task="embed")
    assert EngineConfig.from_kwargs(logits_processors="a:B").model.logits_processors == ("a:B",)


def test_cli_flag(tiny_llama_dir):
    import argparse

    from plinth.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "generate")
    args = parser.parse_args([str(tiny_llama_dir), "--logits-processors", f"{__name__}:NoRepeat", "x.y:Z"])
    assert engine_kwargs(args)["logits_processors"] == [f"{__name__}:NoRepeat", "x.y:Z"]


def test_tensor_parallel_worker_processes_run_them(tiny_llama_dir, processes):
    """With TP=2 worker processes the output rank builds the processors from their references and samples with
    them: the same tokens as in one process; a failure there ends only its request."""
    from plinth.core.engine import LLMEngine
    from plinth.distributed.executor_mp import MultiprocExecutor

    names = [f"{__name__}:NoRepeat", f"{__name__}:Broken"]
    # the CPU worker processes (a machine with one GPU has no second device for TP=2)
    one = tokens(llm_for(tiny_llama_dir, logits_processors=names, platform="cpu").generate(PROMPTS, greedy(),
                                                                                           use_tqdm=False))
    config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off", block_size=4,
                                      tensor_parallel_size=2, distributed_executor="mp", logits_processors=names,
                                      platform="cpu")
    engine = LLMEngine(config, executor_factory=lambda c: MultiprocExecutor(c, processes))
    try:
        with pytest.raises(RequestRejectedError, match="extra_args must be picklable, as the engine's worker"):
            engine.add_request("lock", "hello", greedy(extra_args={"lock": threading.Lock()}))
        reqs = [(0, f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
        reqs.append((1, "boom", PROMPTS[0], greedy(extra_args={"boom": 1})))
        done = drive(engine, reqs, {}, 500)
    finally:
        engine.shutdown()
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == one
    assert "Broken failed: RuntimeError: boom" in done["boom"].error
    assert not processes.broken


def test_server_takes_vllm_xargs(tiny_llama_dir):
    from starlette.testclient import TestClient

    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off",
                                                served_model_name="tiny",
                                                logits_processors=[f"{__name__}:BiasFromArgs", f"{__name__}:Broken"]))
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(AsyncLLMEngine(engine))) as client:
        free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        biased = client.post("/v1/completions", json={**body, "logit_bias": {"40": 4}}).json()["choices"][0]["text"]
        assert biased != free
        got = client.post("/v1/completions", json={**body, "vllm_xargs": {"bias": {"40": 4}}})
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == biased
        chat_body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        by_bias = client.post("/v1/chat/completions", json={**chat_body, "logit_bias": {"40": 4}}).json()
        by_args = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 8,
                                                     "temperature": 0, "vllm_xargs": {"bias": {"40": 4}}}).json()
        assert by_args["output"][0]["content"][0]["text"] == by_bias["choices"][0]["message"]["content"]
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}],
                                                          "vllm_xargs": {"bias": {"x": 1}}})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "vllm_xargs"   # the body's name
        failed = client.post("/v1/completions", json={**body, "vllm_xargs": {"boom": 1}})
        assert failed.status_code == 500
        assert "logits processor Broken failed: RuntimeError: boom" in failed.json()["error"]["message"]
        stream = client.post("/v1/completions", json={**body, "stream": True, "vllm_xargs": {"boom": 1}})
        assert "Broken failed" in stream.text
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == free


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir) -> LLM:
    return llm_for(tiny_llama_dir, logits_processors=[BiasOrBoom, ForceThenBoom, NaNs, NoInit, BadCheck])


def test_one_rows_failure_does_not_end_the_other_rows_of_the_call(plain, guarded):
    """A processor that raises for one row of its call is called again row by row: only that row's request ends;
    the other rows it processes get what they would alone."""
    token = tokens(plain.generate(PROMPTS[:1], greedy(4), use_tqdm=False))[0][2]
    good = greedy(extra_args={"bias": {str(token): 3.0}})
    bad = greedy(extra_args={"bias": {}, "boom": True})
    with pytest.raises(RequestFailedError, match="1 of 3") as info:
        guarded.generate(PROMPTS[:3], [good, bad, good], use_tqdm=False)
    outs = info.value.outputs
    assert outs[0].error is None and outs[2].error is None and "BiasOrBoom failed: RuntimeError: boom" in outs[1].error
    want = tokens(plain.generate(PROMPTS[:3], greedy(logit_bias={token: 3.0}), use_tqdm=False))
    assert tokens(outs)[0] == want[0] and tokens(outs)[2] == want[2]


@pytest.mark.parametrize("args, message, kept", [
    ({"force": 1}, "ForceThenBoom failed: RuntimeError: late", [7, 7, 7]),
    ({"nan": True}, "NaNs failed: apply returned a row with a NaN, a \\+inf or no finite logit", []),
    ({"nan": False}, "NaNs failed: apply returned a row with a NaN, a \\+inf or no finite logit", []),
    ({"noinit": 1}, "NoInit could not be made: OSError: no such file", []),
], ids=["late-raise", "nan", "all-inf", "constructor"])
def test_failures_keep_only_processed_tokens_and_the_engine(plain, guarded, args, message, kept):
    """The failing step's token (drawn without the processor) is dropped; a constructor that raises, NaN or
    all -inf rows fail their requests alone; the engine serves the next call."""
    with pytest.raises(RequestFailedError) as info:
        guarded.generate(PROMPTS[:2], [greedy(), greedy(extra_args=args)], use_tqdm=False)
    failed = info.value.outputs[1]
    assert re.search(message, failed.error) and failed.outputs[0].token_ids == kept
    assert tokens(info.value.outputs[:1]) == tokens(plain.generate(PROMPTS[:1], greedy(), use_tqdm=False))
    assert tokens(guarded.generate(PROMPTS[:1], greedy(), use_tqdm=False)) == \
        tokens(plain.generate(PROMPTS[:1], greedy(), use_tqdm=False))
    bm = guarded.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_a_processor_bug_in_validation_is_a_failure_not_a_refusal(guarded):
    with pytest.raises(RequestFailedError, match="BadCheck failed on this request: KeyError: 'nope'"):
        guarded.engine.add_request("x", "hello", greedy(extra_args={"badcheck": 1}))
    assert not guarded.engine.has_unfinished_requests()


def test_beam_search_rounds_skip_the_processors(tiny_llama_dir, plain):
    from plinth import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=6)
    with_them = llm_for(tiny_llama_dir, logits_processors=[NoRepeat, Broken, WrongShape, NoInit])
    got = with_them.beam_search(PROMPTS[:2], params)
    want = plain.beam_search(PROMPTS[:2], params)
    assert [[b.token_ids for b in o.sequences] for o in got] == [[b.token_ids for b in o.sequences] for o in want]


def test_generate_files_report_failed_rows_and_rerun_them(tiny_llama_dir, tmp_path, capsys):
    import json

    from plinth.entrypoints.cli import main

    rows = [{"id": "ok", "prompt": "Hello", "max_tokens": 4},
            {"id": "bad", "prompt": "Hello", "max_tokens": 4, "extra_args": {"boom": 1}},
            {"id": "check", "prompt": "Hello", "max_tokens": 4, "extra_args": {"badcheck": 1}}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(tiny_llama_dir), "--dtype", "float32", "--selection", "off", "--input", str(inp),
            "--output", str(out), "--logits-processors", f"{__name__}:Broken", f"{__name__}:BadCheck"]
    assert main([*argv, "--bad-rows", "skip"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["ok"]
    err = capsys.readouterr().err
    assert "row 2: logits processor Broken failed: RuntimeError: boom" in err
    assert "row 3: logits processor BadCheck failed on this request: KeyError: 'nope'" in err
    assert main(argv) == 2   # the rerun tries the failed rows again (--bad-rows fail: the first stops the run)
    assert "2 rows to run, 1 already done" in capsys.readouterr().err
    assert main(["generate", str(tiny_llama_dir), "--dtype", "float32", "--selection", "off", "--prompt", "Hi",
                 "--logits-processors", f"{__name__}:AlwaysBroken", "--max-tokens", "3"]) == 1
    assert "prompt 1: logits processor AlwaysBroken failed: RuntimeError: always" in capsys.readouterr().err


def test_applies_to_is_asked_once_and_its_bugs_are_failures(tiny_llama_dir, plain):
    llm = llm_for(tiny_llama_dir, logits_processors=[AskedOnce])
    own = [greedy() for _ in PROMPTS]   # each request its own parameters: each asked about once
    assert tokens(llm.generate(PROMPTS, own, use_tqdm=False)) == tokens(plain.generate(PROMPTS, greedy(),
                                                                                       use_tqdm=False))
    with pytest.raises(RequestFailedError, match="AskedOnce failed on this request: ValueError: a bug"):
        llm.engine.add_request("bug", "hello", greedy(extra_args={"bug": 1}))   # a bug, not a refusal


def test_a_failed_rows_nan_reaches_neither_later_processors_nor_the_sampler(tiny_llama_dir):
    llm = llm_for(tiny_llama_dir, logits_processors=[NaNs, SeesNaN])
    SeesNaN.saw_nan = False
    with pytest.raises(RequestFailedError, match="NaNs failed"):
        llm.generate(PROMPTS[:2], [greedy(), greedy(extra_args={"nan": True})], use_tqdm=False)
    assert not SeesNaN.saw_nan


def test_rows_cross_to_worker_processes_without_being_walked():
    """pack_tensors leaves a row's token lists alone (they pickle as they are): walking them cost ~80 ms a step
    for 64 rows of 2,500 tokens."""
    from plinth.core.logits_processors import ProcessorRow
    from plinth.core.sampling_batch import SamplingBatch
    from plinth.distributed.messages import pack_tensors, unpack_tensors

    row = ProcessorRow("r", list(range(2500)), list(range(100)), {"a": 1})
    batch = dataclasses.replace(SamplingBatch.plain_greedy(1, torch.device("cpu")), custom=(((0,), (row,)),))
    assert pack_tensors(batch).custom[0][1][0] is row
    assert unpack_tensors(pack_tensors(batch), torch.device("cpu")).custom[0][1][0] is row
