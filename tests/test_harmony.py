"""gpt-oss's harmony format: the ``gpt_oss`` reasoning and tool-call parsers, alone, streamed, and in the server."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import make_tiny_model
from test_reasoning import stream_split, streamed
from test_tool_calls import MESSAGES, TOOLS

from plinth.entrypoints.openai.harmony import GptOssReasoningParser, GptOssToolParser, Message, messages
from plinth.entrypoints.openai.reasoning_parsers import Split, resolve_reasoning_parser
from plinth.entrypoints.openai.tool_parsers import ParsedCall, Scan, resolve_tool_parser

ANALYSIS = "<|channel|>analysis<|message|>The user asks 2+2.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
CALL_RECIPIENT_FIRST = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz":"UTC"}'


def test_messages_split_headers_and_bodies():
    got = messages(ANALYSIS + FINAL + "<|return|>", final=True)
    assert [(m.channel, m.recipient, m.body, m.ended) for m in got] == [
        ("analysis", None, "The user asks 2+2.", True), ("final", None, "It is 4.", True)]
    call = messages(ANALYSIS + CALL_RECIPIENT_FIRST, final=True)[1]
    assert (call.channel, call.recipient, call.body) == ("commentary", "functions.get_time", '{"tz":"UTC"}')
    assert messages(CALL, final=True)[0].recipient == "functions.get_weather"
    # text outside the format is a message without a header; a header still being written is left out
    assert messages("plain text", final=True) == [Message("", "plain text", True)]
    assert messages(ANALYSIS + "<|start|>assistant<|chan", final=False) == messages(ANALYSIS, final=True)
    # the end of a body that may still become an end token waits
    assert messages("<|channel|>final<|message|>It is 4<|e", final=False)[0].body == "It is 4"
    assert messages("<|channel|>final<|message|>It is 4<|e", final=True)[0].body == "It is 4<|e"


@pytest.mark.parametrize("text, split", [
    (ANALYSIS + FINAL, Split("The user asks 2+2.", "It is 4.")),
    (FINAL, Split("", "It is 4.")),                                   # no thinking
    (ANALYSIS, Split("The user asks 2+2.", "")),                      # thinking only (cut short)
    ("<|channel|>analysis<|message|>still thinking", Split("still thinking", "")),
    ("Just text.", Split("", "Just text.")),                          # not the format: all answer
    (ANALYSIS + CALL, Split("The user asks 2+2.", CALL)),             # a call stays in its markup
    ("<|channel|>commentary<|message|>Checking.<|end|>" + FINAL, Split("", "Checking.\nIt is 4.")),   # preamble: its own line
])
def test_reasoning_parser(text, split):
    assert stream_split(GptOssReasoningParser(), text) == split


def stream_scan(parser, text: str) -> Scan:
    """Scan every prefix as a stream would: the content and the calls only grow."""
    last = Scan("")
    for i in range(len(text) + 1):
        scan = parser.scan(text[:i], final=i == len(text))
        assert scan.content.startswith(last.content) and scan.calls[:len(last.calls)] == last.calls, (text[:i], scan)
        last = scan
    return last


@pytest.mark.parametrize("text, scan", [
    (CALL, Scan("", (ParsedCall("get_weather", '{"city": "Oslo"}'),))),
    ("It is 4." + CALL_RECIPIENT_FIRST, Scan("It is 4.", (ParsedCall("get_time", '{"tz": "UTC"}'),))),
    ("It is 4.", Scan("It is 4.")),
    # not a call after all (no JSON object, a recipient that is no function): the markup is content, verbatim
    ('<|channel|>commentary to=functions.f<|message|>{"a": ', Scan('<|channel|>commentary to=functions.f<|message|>{"a": ')),
    ("<|channel|>commentary to=browser.search<|message|>[1]", Scan("<|channel|>commentary to=browser.search<|message|>[1]")),
    ("<|channel|>commentary to=functions.ping<|message|>", Scan("", (ParsedCall("ping", "{}"),))),
    # the reply's first message naming its recipient before the channel (the prompt ends with <|start|>assistant)
    (CALL_RECIPIENT_FIRST.removeprefix("<|start|>assistant"), Scan("", (ParsedCall("get_time", '{"tz": "UTC"}'),))),
    ("today it is 4.", Scan("today it is 4.")),   # words that only start like a recipient stay the answer
])
def test_tool_parser(text, scan):
    assert stream_scan(GptOssToolParser(TOOLS), text) == scan


@pytest.mark.parametrize("after_call", ["", "<|call|>", "<|end|>"])
def test_both_parsers_together(after_call):
    """As the server chains them: the reasoning parser's answer goes to the tool parser, which finds the call
    whatever follows it (its end token, or the next message only)."""
    split = GptOssReasoningParser().scan(ANALYSIS + CALL, final=True)
    assert split.reasoning == "The user asks 2+2."
    assert GptOssToolParser(TOOLS).scan(split.content, final=True) == Scan(
        "", (ParsedCall("get_weather", '{"city": "Oslo"}'),))
    text = ANALYSIS + "<|start|>assistant" + CALL + after_call + FINAL
    split = stream_split(GptOssReasoningParser(), text)
    assert split.reasoning == "The user asks 2+2."
    assert stream_scan(GptOssToolParser(TOOLS), split.content) == Scan(
        "It is 4.", (ParsedCall("get_weather", '{"city": "Oslo"}'),))


def test_a_reply_that_opens_with_a_recipient_is_a_call():
    """The reply's first header written recipient first, as gpt-oss's template writes past calls: through both
    parsers, streamed, the call and no markup in the answer."""
    text = CALL_RECIPIENT_FIRST.removeprefix("<|start|>assistant") + "<|call|>"
    split = stream_split(GptOssReasoningParser(), text)
    assert split.reasoning == ""
    assert stream_scan(GptOssToolParser(TOOLS), split.content) == Scan("", (ParsedCall("get_time", '{"tz": "UTC"}'),))


def test_an_answer_that_begins_like_a_recipient_is_kept():
    """A final answer whose text begins ``to=``: the reasoning parser passes its body on as plain text, and the tool
    parser keeps it (it took it for the reply's recipient header and dropped it), alone or before a call."""
    answer = "to=be or not to be"
    split = stream_split(GptOssReasoningParser(), ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + answer)
    assert split == Split("The user asks 2+2.", answer)
    assert stream_scan(GptOssToolParser(TOOLS), split.content) == Scan(answer)
    split = stream_split(GptOssReasoningParser(), f"<|channel|>final<|message|>{answer}<|end|><|start|>assistant{CALL}")
    assert stream_scan(GptOssToolParser(TOOLS), split.content) == Scan(
        answer, (ParsedCall("get_weather", '{"city": "Oslo"}'),))


def test_a_reply_cut_inside_a_header_shows_no_markup():
    assert stream_split(GptOssReasoningParser(), ANALYSIS + "<|start|>assistant<|channel|>final") == Split(
        "The user asks 2+2.", "")


PIECES = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "assistant", "analysis", "final", "commentary",
          " to=functions.f", "<|constrain|>", "json", "{}", '{"a": 1}', "<|", "|>", "x", " ", "<"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_parts_only_grow_for_any_text(pieces):
    text = "".join(pieces)
    stream_split(GptOssReasoningParser(), text)
    stream_scan(GptOssToolParser(TOOLS), text)


def test_registered():
    assert resolve_reasoning_parser("gpt_oss") is GptOssReasoningParser
    assert resolve_tool_parser("gpt_oss") is GptOssToolParser


MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]
THINK_AND_ANSWER = ANALYSIS + FINAL
THINK_AND_CALL = ANALYSIS + "<|start|>assistant" + CALL


# the reasoning level in the system message, as gpt-oss's template writes it
TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
            "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture
def http(tmp_path, monkeypatch):
    """The server with both gpt_oss parsers, its engine replaced by a script: the reply of the request's
    ``user`` field ("answer" or "call"), grown piece by piece, with the markers (special tokens) in its text only
    when the request keeps special tokens (as the detokenizer would)."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import CompletionOutput, FinishReason, RequestOutput
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.openai.serving import ServerContext

    script = {}

    async def scripted(self, rid, ids, params, priority=0, lora=None, accepted=None, cache_salt=None):
        script["prompt"] = self.front.tokenizer.decode(ids)
        text = script["text"]
        if params.skip_special_tokens:
            for marker in MARKERS:
                text = text.replace(marker, "")
        # the outputs end at these characters (default: every 7th), as a stream's outputs may merge
        cuts = sorted({0, len(text), *(c for c in script.get("cuts", range(0, len(text), 7)) if c < len(text))})
        for i, cut in enumerate(cuts[1:]):
            last = cut == len(text)
            reason = script.get("finish", FinishReason.STOP) if last else None
            yield RequestOutput(rid, None, list(ids), [CompletionOutput(0, text[:cut], list(range(i + 1)),
                                                                        finish_reason=reason)], last)

    monkeypatch.setattr(ServerContext, "generate", scripted)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(make_tiny_model(tmp_path / "m")), dtype="float32",
                                                selection="off", served_model_name="tiny", chat_template=TEMPLATE))
    app = build_app(AsyncLLMEngine(engine), tool_parser=GptOssToolParser, reasoning_parser=GptOssReasoningParser)
    with TestClient(app) as client:
        yield client, script


def test_server_reads_the_channels_and_the_call(http):
    """The parsers keep the special tokens in the text they read (a reply without them would be all answer, markup
    lost), and the client gets the thinking, the answer and the call, streamed or not."""
    client, script = http
    script["text"] = THINK_AND_ANSWER
    body = {"messages": MESSAGES, "max_tokens": 50}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user asks 2+2.", "It is 4.")
    assert streamed(client, body)[:2] == ("The user asks 2+2.", "It is 4.")
    script["text"] = THINK_AND_CALL
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "The user asks 2+2."
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})
    thinking, content, calls, reason = streamed(client, body)
    assert (thinking, content, reason) == ("The user asks 2+2.", "", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(call["name"], call["arguments"])]


def test_reasoning_effort_reaches_the_template(http):
    """OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) are the template's
    ``reasoning_effort``; ``chat_template_kwargs`` says it more precisely; other values are 400s."""
    client, script = http
    script["text"] = FINAL

    def prompt(path: str, body: dict) -> str:
        r = client.post(path, json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        return script["prompt"]

    chat = {"messages": MESSAGES, "max_tokens": 5}
    assert "Reasoning: medium" in prompt("/v1/chat/completions", chat)
    assert "Reasoning: low" in prompt("/v1/chat/completions", {**chat, "reasoning_effort": "low"})
    assert "Reasoning: high" in prompt("/v1/chat/completions", {**chat, "reasoning_effort": "low",
                                                                "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert "Reasoning: high" in prompt("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}})
    for effort in ("xhigh", "max"):   # OpenAI's newer levels pass through as well
        assert f"Reasoning: {effort}" in prompt("/v1/chat/completions", {**chat, "reasoning_effort": effort})
        assert f"Reasoning: {effort}" in prompt("/v1/responses", {"input": "hi", "reasoning": {"effort": effort}})
    r = client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning", r.text


LATE_THINKING = ("<|channel|>analysis<|message|>Think one.<|end|><|start|>assistant<|channel|>commentary"
                 "<|message|>Pre.<|end|><|start|>assistant<|channel|>analysis<|message|>Think two.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>F.")


@pytest.mark.parametrize("cuts", ["every_7", "one_output", "answer_and_late_thinking_merged"])
def test_responses_stream_keeps_thinking_written_after_the_answer_began(http, cuts):
    """Harmony may think again after a preamble: that thinking comes as a second reasoning item after the message
    (streamed, the first was closed when the message opened), streamed or not; nothing is lost, and the events
    validate. Also when one engine output carries the answer's start and the later thinking (outputs merged while
    the client lagged), alone or after the first thinking was streamed."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    client, script = http
    script["text"] = LATE_THINKING
    if cuts == "one_output":
        script["cuts"] = []
    elif cuts == "answer_and_late_thinking_merged":
        script["cuts"] = [LATE_THINKING.index("one.")]
    whole = client.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json()
    assert [(i["type"], (i["content"] or [{}])[0].get("text"), i["status"]) for i in whole["output"]] == [
        ("reasoning", "Think one.", "completed"), ("message", "Pre.\nF.", "completed"),
        ("reasoning", "Think two.", "completed")]   # as streamed (below)
    with client.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
        payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(p) for p in payloads]
    final = events[-1].response
    assert [(i.type, i.content[0].text) for i in final.output] == [
        ("reasoning", "Think one."), ("message", "Pre.\nF."), ("reasoning", "Think two.")]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "reasoning")]


def test_beam_search_replies_keep_the_markers_for_the_parser(http, monkeypatch):
    """A beam's text is decoded with special tokens when the reasoning parser reads them (beams decode without),
    all but the EOS that ended it."""
    from plinth.entrypoints.beam_search import BeamSearchOutput, BeamSequence
    from plinth.entrypoints.openai import serving

    client, _ = http
    tokenizer = client.app.state.ctx.front.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    # a beam that ended on EOS holds it last; its text is no part of the reply
    ids = tokenizer.encode(THINK_AND_ANSWER, add_special_tokens=False) + [client.app.state.ctx.front.eos_token_ids[0]]
    beam = BeamSequence(ids, -1.0, text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason="stop")

    async def fake(front, rid, prompts, params, lora=None, priority=0, cache_salt=None):
        return [BeamSearchOutput(list(prompts[0]), [beam])]

    monkeypatch.setattr(serving, "beam_search_async", fake)   # what ServerContext.beam_search runs
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 20, "use_beam_search": True,
                                                   "n": 1, "best_of": 1}).json()
    msg = r["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user asks 2+2.", "It is 4."), r


def test_thinking_cut_off_by_the_output_limit_is_an_incomplete_item(http):
    """A reply that ran out of tokens while thinking: its reasoning item is ``incomplete`` like the response,
    streamed or not; the response echoes the request's ``tool_choice``."""
    from plinth.core.request import FinishReason

    client, script = http
    script["text"] = "<|channel|>analysis<|message|>Still thinking about"
    script["finish"] = FinishReason.LENGTH
    body = {"model": "tiny", "input": "hi", "tool_choice": "none"}
    whole = client.post("/v1/responses", json=body).json()
    assert whole["status"] == "incomplete" and whole["tool_choice"] == "none"
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "incomplete"), ("message", "incomplete")]
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = payloads[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "incomplete"), ("message", "incomplete")]
    assert final["output"][0]["content"][0]["text"] == "Still thinking about"


def test_reasoning_tokens_stop_where_the_later_thinking_ends(tmp_path, monkeypatch):
    """``reasoning_tokens`` of a reply that thinks again after a preamble counts that thinking up to where the answer
    goes on, not the answer after it: two replies that differ only in their final answer's length count the same,
    more than the same reply without the later thinking and less than every token before the final answer."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import CompletionOutput, FinishReason, RequestOutput
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.openai.serving import ServerContext

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(make_tiny_model(tmp_path / "m")), dtype="float32",
                                                selection="off", served_model_name="tiny", chat_template=TEMPLATE))
    tok = engine.tokenizer
    script = {}

    async def scripted(self, rid, prompt, params, priority=0, lora=None, accepted=None, cache_salt=None):
        ids = tok.encode(script["text"], add_special_tokens=False)
        yield RequestOutput(rid, None, list(prompt), [CompletionOutput(0, tok.decode(ids), ids,
                                                                       finish_reason=FinishReason.STOP)], True)

    monkeypatch.setattr(ServerContext, "generate", scripted)
    app = build_app(AsyncLLMEngine(engine), tool_parser=GptOssToolParser, reasoning_parser=GptOssReasoningParser)
    head = LATE_THINKING.removesuffix("F.")
    early = LATE_THINKING[:LATE_THINKING.index("<|start|>assistant<|channel|>commentary")]
    counts = {}
    with TestClient(app) as client:
        for name, text in [("short", head + "F."), ("long", head + "F. And a much longer final answer than that."),
                           ("no_late", early + "<|start|>assistant<|channel|>final<|message|>F.")]:
            script["text"] = text
            usage = client.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json()["usage"]
            counts[name] = usage["output_tokens_details"]["reasoning_tokens"]
    assert counts["short"] == counts["long"] > counts["no_late"] > 0
    assert counts["short"] < len(tok.encode(head, add_special_tokens=False))


PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
WEATHER_CALL = CALL + "<|call|>"
WEATHER_CALL_RECIPIENT_FIRST = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>'


@pytest.mark.parametrize("text, scan", [
    (ANALYSIS + "<|start|>assistant" + WEATHER_CALL + FINAL, Scan("It is 4.", (ParsedCall("get_weather", '{"city": "Oslo"}'),))),
    (PREAMBLE + WEATHER_CALL + FINAL, Scan("Checking.\nIt is 4.", (ParsedCall("get_weather", '{"city": "Oslo"}'),))),
    # markup that makes no call (no JSON object, a recipient that is no function, a call cut short) is dropped
    ("<|channel|>commentary to=browser.search<|message|>[1]<|end|>" + FINAL, Scan("It is 4.")),
    ('It is 4.<|channel|>commentary to=functions.f<|message|>{"a": ', Scan("It is 4.")),
    ("It is 4.", Scan("It is 4.")),
])
def test_call_reader_leaves_no_markup(text, scan):
    """The reader a reply without the gpt_oss tool parser takes the reasoning parser's call messages out with: the
    calls, and content without markup, streamed or not."""
    from plinth.entrypoints.openai.harmony import GptOssCallReader

    split = stream_split(GptOssReasoningParser(), text)
    assert stream_scan(GptOssCallReader(TOOLS), split.content) == scan


WEATHER = {"type": "function", "function": {"name": "get_weather"}}
CHOICES = {"no_tools": {}, "none": {"tools": TOOLS, "tool_choice": "none"},
           "required": {"tools": TOOLS, "tool_choice": "required"},
           "named": {"tools": TOOLS, "tool_choice": WEATHER}}


def _reply(client, body: dict) -> tuple[str | None, str | None, list[tuple[str, dict]], str]:
    """A chat reply's thinking, content, calls (name, decoded arguments) and finish reason."""
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    msg = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]
    return msg.get("reasoning_content"), msg["content"], calls, choice["finish_reason"]


def _streamed_reply(client, body: dict) -> tuple[str | None, str | None, list[tuple[str, dict]], str]:
    """:func:`_reply` from the streamed deltas (each call's argument deltas joined)."""
    thinking, content, deltas, reason = streamed(client, body)
    calls: dict[int, list] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], [None, ""])
        entry[0] = d["function"].get("name") or entry[0]
        entry[1] += d["function"].get("arguments") or ""
    return (thinking or None, content or None, [(name, json.loads(args)) for name, args in calls.values()], reason)


@pytest.mark.parametrize("call", [WEATHER_CALL, WEATHER_CALL_RECIPIENT_FIRST])
@pytest.mark.parametrize("answer", ["", FINAL])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_call_messages_without_the_gpt_oss_tool_parser_show_no_markup(http, choice, answer, call):
    """A call message where the gpt_oss tool parser does not read the reply (no tools, tool choice "none",
    "required" or a named function): a call where the tool choice makes calls, dropped where it makes none, and the
    final answer kept; never markup in the content or the arguments; streamed (every character its own output) as
    not streamed."""
    client, script = http
    thinking = ANALYSIS if call == WEATHER_CALL else ""
    script["text"] = thinking + ("<|start|>assistant" if thinking else "") + call + answer
    body = {"messages": MESSAGES, "max_tokens": 50, **CHOICES[choice]}
    whole = _reply(client, body)
    weather = [("get_weather", {"city": "Oslo"})]
    expected = {"no_tools": ("It is 4." if answer else None, [], "stop"),
                "none": ("It is 4." if answer else None, [], "stop"),
                "required": (None, weather, "tool_calls"),
                "named": (None, weather, "stop")}[choice]
    assert whole == ("The user asks 2+2." if thinking else None, *expected)
    script["cuts"] = range(len(script["text"]))
    assert _streamed_reply(client, body) == whole


def test_responses_show_no_call_markup(http):
    """/v1/responses (no tools): a call message is no part of the message, streamed or not; thinking after the call
    and before the answer is thinking before the message."""
    client, script = http
    later = "<|start|>assistant<|channel|>analysis<|message|>Sunny.<|end|>"
    script["text"] = ANALYSIS + "<|start|>assistant" + WEATHER_CALL + later + FINAL
    body = {"model": "tiny", "input": "hi"}
    whole = client.post("/v1/responses", json=body).json()
    items = [(i["type"], i["content"][0]["text"]) for i in whole["output"]]
    assert items == [("reasoning", "The user asks 2+2.\nSunny."), ("message", "It is 4.")]
    for cuts in ([], range(len(script["text"]))):
        script["cuts"] = cuts
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        final = payloads[-1]["response"]
        assert [(i["type"], i["content"][0]["text"]) for i in final["output"]] == items
