"""Reasoning parsers (``--reasoning-parser``): the thinking as ``reasoning_content``, the answer as ``content``,
streamed deltas adding up to the same, tool calls found in the answer only."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import make_tiny_model
from test_tool_calls import MESSAGES, TOOL_TEMPLATE, TOOLS

from plinth.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    Split,
    resolve_reasoning_parser,
)
from plinth.entrypoints.openai.tool_parsers import HermesToolParser, ParserChoiceError


def stream_split(parser, text: str) -> Split:
    """Scan every prefix as a stream would, checking that both parts only grow; the final split."""
    last = Split("", "")
    for i in range(len(text) + 1):
        split = parser.scan(text[:i], final=i == len(text))
        assert split.reasoning.startswith(last.reasoning) and split.content.startswith(last.content), (text[:i], split)
        last = split
    return last


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nThe capital is Paris.\n</think>\n\nParis.", "\nThe capital is Paris.\n", "Paris."),
    ("Paris.", "", "Paris."),                                         # thinking off: all answer
    ("  <think>still thinking", "still thinking", ""),               # never closed: stays thinking
    ("<think></think>Paris", "", "Paris"),
    ("<thinx>Paris", "", "<thinx>Paris"),
    ("The answer is <think>not thinking</think>", "", "The answer is <think>not thinking</think>"),
])
def test_qwen3(text, reasoning, content):
    assert stream_split(Qwen3ReasoningParser(), text) == Split(reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("The capital is Paris.\n</think>\n\nParis.", "The capital is Paris.\n", "Paris."),   # opened by the template
    ("<think>\nHm.</think>Paris", "\nHm.", "Paris"),
    ("still thinking <", "still thinking <", ""),
    ("a < b </thin", "a < b </thin", ""),
])
def test_deepseek_r1(text, reasoning, content):
    assert stream_split(DeepSeekR1ReasoningParser(), text) == Split(reasoning, content)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "x", "Paris"]),
                max_size=10))
def test_parts_only_grow_and_no_text_is_lost(pieces):
    text = "".join(pieces)
    for parser in (Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()):
        split = stream_split(parser, text)
        kept = [c for c in split.reasoning + split.content if not c.isspace()]
        every = iter(c for c in text if not c.isspace())
        assert all(c in every for c in kept)   # kept in order
        # what is gone: at most the two markers and whitespace
        assert sum(not c.isspace() for c in text) - len(kept) in (0, len("<think>"), len("</think>"),
                                                                   len("<think></think>"))


def test_resolve():
    assert resolve_reasoning_parser("qwen3") is Qwen3ReasoningParser and resolve_reasoning_parser(None) is None
    with pytest.raises(ParserChoiceError, match="deepseek_r1, gpt_oss, qwen3"):
        resolve_reasoning_parser("nope")


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-reasoning"))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=1024,
                                                served_model_name="tiny", chat_template=TOOL_TEMPLATE))
    app = build_app(AsyncLLMEngine(engine), tool_parser=HermesToolParser, reasoning_parser=Qwen3ReasoningParser)
    with TestClient(app) as client:
        yield client


def streamed(http, body: dict) -> tuple[str, str, list[dict], str]:
    thinking, content, calls, reason = "", "", [], None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                thinking += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                reason = c["finish_reason"] or reason
    return thinking, content, calls, reason


def test_server_splits_thinking_from_the_answer_and_calls(http):
    """The model is made (by a regex constraint) to think, then answer or call a tool."""
    body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0.7, "seed": 5,
            "guided_regex": "<think>\\n[a-z]{2,8}( [a-z]{2,8}){0,3}\\n</think>\\n\\nIt is [a-z]{3,6}\\."}
    r = http.post("/v1/chat/completions", json=body).json()
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "stop", r
    assert msg["reasoning_content"].startswith("\n") and msg["reasoning_content"].endswith("\n")
    assert "<think>" not in msg["content"] and msg["content"].startswith("It is ")
    assert streamed(http, body)[:2] == (msg["reasoning_content"], msg["content"])
    # include_reasoning false (vLLM's): the same answer, the thinking left out, streamed or not
    hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()["choices"][0]
    assert hidden["message"] == {"role": "assistant", "content": msg["content"]}
    assert streamed(http, {**body, "include_reasoning": False})[:2] == ("", msg["content"])
    # cut off while thinking: no answer, content null (as vLLM's parsers), the thinking so far kept
    cut = {**body, "max_tokens": 24, "guided_regex": "<think>\n[a-z]{2,8}( [a-z]{2,8}){20,30}\n</think>\n\nIt is"}
    choice = http.post("/v1/chat/completions", json=cut).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] and streamed(http, cut)[:2] == (
        choice["message"]["reasoning_content"], "")
    # thinking, then a hermes tool call in the answer
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "temperature": 0.7, "seed": 6,
            "guided_regex": '<think>\\n[a-z]{2,8}\\n</think>\\n\\n<tool_call>\\n\\{"name": "get_weather", '
                            '"arguments": \\{"city": "[a-z]{2,6}"\\}\\}\\n</tool_call>'}
    r = http.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"].strip().isalpha()
    call = choice["message"]["tool_calls"][0]["function"]
    thinking, content, calls, reason = streamed(http, body)
    assert (thinking, content, reason) == (choice["message"]["reasoning_content"], "", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(call["name"], call["arguments"])]
    # no thinking: no reasoning_content key at all
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "guided_regex": "abc"}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "abc"}


# ---------------------------------------------------------------- constraints that start after the thinking

THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-think"), added_tokens=THINK)


def test_after_reasoning_states(think_model):
    """The gate's masks and hand-over on a real llguidance matcher: the grammar's own mask plus ``<think>`` at
    the start, every token while thinking, the grammar's mask again (at its start) after ``</think>``."""
    import numpy as np
    from transformers import AutoTokenizer

    from plinth.core.structured import AfterReasoning, GrammarCompiler, allowed_tokens, reasoning_markers

    tok = AutoTokenizer.from_pretrained(think_model)
    vocab = len(tok)
    markers = reasoning_markers(tok, *THINK, starts_in_thinking=False)
    assert markers is not None and tok.convert_ids_to_tokens([markers.start, markers.end]) == list(THINK)
    assert reasoning_markers(tok, "<thinking>", "</thinking>", False) is None   # not single tokens
    grammar = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    spec = {"regex": "ab|cd"}
    plain = allowed_tokens([grammar.matcher(spec)], vocab)[0]
    eos = tok.eos_token_id
    gate = AfterReasoning(grammar.matcher(spec), markers, vocab, [eos])
    opening = allowed_tokens([gate], vocab)[0]
    assert opening[markers.start] and not plain[markers.start]
    opening[markers.start] = False
    assert np.array_equal(opening, plain)
    assert gate.consume_token(markers.start) and gate.thinking
    thought = tok.encode("x < y, so { } [", add_special_tokens=False)   # text the grammar would refuse
    for t in thought:
        mask = allowed_tokens([gate], vocab)[0]
        assert mask.sum() == vocab - 1 and not mask[eos]   # anything but the end of the reply
        assert gate.consume_token(t) and not gate.is_stopped()
    copy = gate.deep_copy()
    assert gate.consume_token(markers.end) and not gate.thinking
    assert np.array_equal(allowed_tokens([gate], vocab)[0], plain)
    for t in tok.encode("cd", add_special_tokens=False):
        assert gate.consume_token(t)
    assert gate.is_stopped() or allowed_tokens([gate], vocab)[0][tok.eos_token_id]
    assert copy.thinking and allowed_tokens([copy], vocab)[0].sum() == vocab - 1   # the copy kept its own state
    # a first token that is the grammar's: constrained from there on
    direct = AfterReasoning(grammar.matcher(spec), markers, vocab)
    first = tok.encode("ab", add_special_tokens=False)[0]
    assert direct.consume_token(first) and not direct.thinking
    assert not allowed_tokens([direct], vocab)[0][markers.start]
    # a reply that starts in thinking (DeepSeek-R1): everything goes until </think>
    r1 = AfterReasoning(grammar.matcher(spec), reasoning_markers(tok, *THINK, starts_in_thinking=True), vocab)
    assert r1.thinking and allowed_tokens([r1], vocab)[0].all()   # no EOS ids given: nothing masked


def test_engine_constrains_the_answer_after_the_thinking(think_model):
    """With ``reasoning_parser`` the reply may think first: a bias makes the model write ``</think>`` at once
    (allowed while thinking, refused by the grammar after it), then the answer matches the regex."""
    from plinth import LLM, SamplingParams

    llm = LLM(str(think_model), dtype="float32", selection="off", reasoning_parser="deepseek_r1")
    end = llm.engine.tokenizer.convert_tokens_to_ids("</think>")
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, logit_bias={end: 100.0},
                            structured_outputs={"regex": "[a-z]{2,6}\\."}, skip_special_tokens=False)
    out = llm.generate(["hello"], params)[0].outputs[0]
    assert out.token_ids[0] == end and out.token_ids.count(end) == 1
    answer = out.text.split("</think>", 1)[1]
    assert re.fullmatch("[a-z]{2,6}\\.", answer), out.text
    assert out.finish_reason == "stop"
    # the reply cannot end while it thinks: a forced EOS is refused until max_tokens
    eos = llm.engine.tokenizer.eos_token_id
    out = llm.generate(["hello"], dataclasses.replace(params, logit_bias={eos: 100.0}, max_tokens=12))[0].outputs[0]
    assert eos not in out.token_ids and out.finish_reason == "length" and len(out.token_ids) == 12
    # without the parser the grammar applies from the first token, so the biased </think> never comes
    plain = LLM(str(think_model), dtype="float32", selection="off", generation_config="none")
    out = plain.generate(["hello"], params)[0].outputs[0]
    assert end not in out.token_ids and re.fullmatch("[a-z]{2,6}\\.", out.text), out.text
    # qwen3: the first token may open the thinking; unbiased sampling either thinks or answers at once
    llm = LLM(str(think_model), dtype="float32", selection="off", reasoning_parser="qwen3")
    for seed in range(6):
        text = llm.generate(["hello"], SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                      structured_outputs={"regex": "[a-z]{2,6}\\."}))[0].outputs[0].text
        assert text.startswith("<think>") or re.fullmatch("[a-z]{2,6}\\.", text), text


def test_unknown_parser_and_plain_tokenizer(tmp_path, caplog):
    from plinth import LLM
    from plinth.entrypoints.openai.tool_parsers import ParserChoiceError

    model = make_tiny_model(tmp_path / "plain")
    with pytest.raises(ParserChoiceError, match="deepseek_r1, gpt_oss, qwen3"):
        LLM(str(model), dtype="float32", selection="off", reasoning_parser="nope")
    with caplog.at_level("WARNING"):
        llm = LLM(str(model), dtype="float32", selection="off", reasoning_parser="qwen3")
    assert "not single tokens" in caplog.text and llm.engine._reasoning is None


def test_server_structured_answer_after_thinking(think_model):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(think_model), dtype="float32", selection="off",
                                                served_model_name="tiny", reasoning_parser="deepseek_r1"))
    end = engine.tokenizer.convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}   # no padding
    with TestClient(build_app(AsyncLLMEngine(engine), reasoning_parser=DeepSeekR1ReasoningParser)) as http:
        body = {"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 60, "temperature": 0.8,
                "seed": 4, "logit_bias": {str(end): 100},
                "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert not choice["message"].get("reasoning_content")
        assert isinstance(json.loads(choice["message"]["content"])["city"], str)


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                     "</think>{% endif %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_earlier_replys_thinking_reaches_the_template(tmp_path, field):
    """An assistant message sent back with its thinking (``reasoning_content`` as plinth's replies give it, or
    vLLM's ``reasoning``) reaches the chat template as ``reasoning_content`` (and ``reasoning``), as the template
    of a model that thinks between tool calls reads it; the prompt equals transformers' rendering."""
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model_dir = make_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", served_model_name="tiny",
                                                chat_template=THINKING_TEMPLATE))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", field: "I should answer a"},
                {"role": "user", "content": "more"}]
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        ids = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    reference = [{**m, "reasoning_content": m.pop(field)} if field in m else m for m in map(dict, messages)]
    text = tokenizer.apply_chat_template(reference, tokenize=False, add_generation_prompt=True,
                                         chat_template=THINKING_TEMPLATE)
    assert "<think>I should answer a</think>" in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
