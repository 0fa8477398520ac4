"""Reasoning parsers (``--reasoning-parser``): the thinking as ``reasoning_content``, the answer as ``content``,
streamed deltas adding up to the same, tool calls found in the answer only."""

from __future__ import annotations

import json

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
    with pytest.raises(ParserChoiceError, match="deepseek_r1, qwen3"):
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
