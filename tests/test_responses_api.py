"""``POST /v1/responses``: OpenAI's Responses API (stateless, text), read back through the ``openai`` SDK's own
types (the published format): the same text as the chat route for the same conversation, every streamed event in
order with its sequence number, the deltas adding up to the final text, ``incomplete`` at ``max_output_tokens``,
JSON schemas, and clear 400s for what is not supported."""

from __future__ import annotations

import json

import pytest
from server_utils import make_tiny_model

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-responses"))
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off",
                                                served_model_name="tiny"))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        yield http


def sdk(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


GREEDY = {"temperature": 0, "max_output_tokens": 12}


def test_a_response_equals_the_chat_reply(client):
    """Instructions and a conversation: the reply's text is the chat route's for the same messages."""
    out = sdk(client).responses.create(model="tiny", instructions="Be brief.", temperature=0, max_output_tokens=12,
                                       input=[{"role": "user", "content": "Hello world!"},
                                              {"role": "assistant", "content": [{"type": "output_text",
                                                                                 "text": "Hi."}]},
                                              {"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": "How are you today?"}]}])
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"},
                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you today?"}]}).json()
    assert out.object == "response" and out.model == "tiny" and out.id.startswith("resp")
    from openai.types.responses import (
        Response,  # the raw body validates against the SDK's model (required fields)
    )

    raw = client.post("/v1/responses", json={"model": "tiny", "input": "Hello world!", **GREEDY}).json()
    assert Response.model_validate(raw).output[0].content[0].type == "output_text"
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    if chat["choices"][0]["finish_reason"] == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    # text parts are joined as the chat route joins them (by line breaks)
    parts = client.post("/v1/responses", json={"model": "tiny", **GREEDY, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "you"}]}]})
    joined = client.post("/v1/chat/completions", json={"model": "tiny", "temperature": 0, "max_tokens": 12,
                                                       "messages": [{"role": "user", "content": "Hello\nyou"}]})
    assert parts.json()["usage"]["input_tokens"] == joined.json()["usage"]["prompt_tokens"]
    assert parts.json()["output"][0]["content"][0]["text"] == joined.json()["choices"][0]["message"]["content"]


def test_incomplete_at_max_output_tokens(client):
    """vLLM's sampling fields pass through (ignore_eos keeps EOS from ending it early): the output limit makes the
    response and its message incomplete."""
    out = sdk(client).responses.create(model="tiny", input="The quick brown fox", temperature=0, max_output_tokens=24,
                                       extra_body={"ignore_eos": True})
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 24 and out.output[0].status == "incomplete"
    # min_tokens, also passed through, is checked against the limit as on the chat route
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_a_failure_mid_stream_ends_with_the_error_events(client, monkeypatch):
    """An engine failure after the first outputs: the API's error event, then response.failed (both validate as
    the SDK's event types); an aborted request is cancelled, not completed."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from plinth.entrypoints.openai.serving import ServerContext

    real = ServerContext.generate

    async def failing(self, *args, **kwargs):
        n = 0
        async for out in real(self, *args, **kwargs):
            yield out
            n += 1
            if n == 2:
                raise RuntimeError("the device fell over")

    monkeypatch.setattr(ServerContext, "generate", failing)
    body = {"model": "tiny", "input": "Paris is the capital of", "max_output_tokens": 40, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    kinds = [adapter.validate_python(p).type for p in payloads]
    assert "error" in kinds and kinds[-1] == "response.failed"
    assert payloads[-1]["response"]["status"] == "failed"
    assert "device fell over" not in json.dumps(payloads)   # an unexpected error's text stays in the server log


def test_an_aborted_request_is_cancelled_alike_streamed_or_not(client, monkeypatch):
    """A request the engine aborts (at shut-down): status ``cancelled`` with the same error object, streamed (in
    ``response.failed``, the API having no cancelled event) or not."""
    from plinth.core.request import CompletionOutput, FinishReason, RequestOutput
    from plinth.entrypoints.openai.serving import ServerContext

    async def aborted(self, rid, prompt, params, priority=0, lora=None, accepted=None, cache_salt=None):
        yield RequestOutput(rid, None, list(prompt), [CompletionOutput(0, "Hel", [], finish_reason=None)], False)
        yield RequestOutput(rid, None, list(prompt), [CompletionOutput(0, "Hello", [], finish_reason=FinishReason.ABORT)], True)

    monkeypatch.setattr(ServerContext, "generate", aborted)
    body = {"model": "tiny", "input": "hi"}
    plain = client.post("/v1/responses", json=body).json()
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert last["type"] == "response.failed"
    assert plain["status"] == last["response"]["status"] == "cancelled"
    assert plain["error"] == last["response"]["error"] == {"code": "server_error",
                                                           "message": "the request was cancelled"}
    assert plain["output"][0]["content"][0]["text"] == last["response"]["output"][0]["content"][0]["text"] == "Hello"

def test_stream_events(client):
    """Every event parses as the SDK's event types, in the API's order, numbered from 0; the deltas add up to
    the final text, which equals the non-streamed response's."""
    body = {"model": "tiny", "input": "Paris is the capital of", **GREEDY}
    plain = sdk(client).responses.create(**body)
    events = list(sdk(client).responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    assert final.status == plain.status
    # the raw stream: an `event:` line names each `data:` payload's type, and there is no [DONE]
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert not any("[DONE]" in line for line in lines)
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    assert all(e.startswith("event: ") and json.loads(d[6:])["type"] == e[7:] for e, d in pairs)
    # and each payload validates (strictly: every required field, the right types) as the SDK's event union
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_python(json.loads(d[6:])).type for _, d in pairs] == [e[7:] for e, _ in pairs]


def test_json_schema_format(client):
    """A schema's text: with free whitespace a random model may pad until it runs out of tokens, so the schema asks
    for compact JSON (its ``x-guidance`` options); then the whole object fits well inside the token budget."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    out = sdk(client).responses.create(model="tiny", input="Name a city as JSON.", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                        "strict": True}})
    assert out.status == "completed"
    value = json.loads(out.output_text)
    assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 8
    assert out.output_text.startswith('{"city":')     # no whitespace where the grammar allows none


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "tools are not supported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"background": True}, "background", "background"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input",
     "'function_call_output' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "this model takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input",
     "only text and input_image parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role 'tool'"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input", "role ['user']"),   # not a string (was a 500)
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"conversation": "conv_1"}, "conversation", "conversations are not stored"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt templates"),
    ({"top_logprobs": 3}, "top_logprobs", "use /v1/chat/completions"),
    ({"include": ["message.output_text.logprobs"]}, "include", "use /v1/chat/completions"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "text.format type 'grammar'"),
    ({"text": {"format": "json"}}, "text", "text.format must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"max_output_tokens": 10 ** 7}, "max_output_tokens", "max_output_tokens is 10000000"),
    ({"max_output_tokens": 3.0}, "max_output_tokens", "integer"),   # a wrong JSON type is refused, not converted
    ({"temperature": "0"}, "temperature", "number"),
    ({"model": "other"}, "model", "does not exist"),
    # the chat field names become the Responses API's, but not inside what the user wrote
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/messages_max_tokens"}}}}}}, "text",
     "'/$defs/messages_max_tokens'"),
])
def test_unsupported_requests_are_400s(client, body, param, message):
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_chat_field_names_in_messages_become_the_responses_apis():
    from plinth.entrypoints.openai.serving_responses import _responses_wording

    assert _responses_wording("max_tokens must be at least 1") == "max_output_tokens must be at least 1"
    assert _responses_wording("messages[0]: only text parts") == "input[0]: only text parts"
    assert (_responses_wording("response_format: bad regex 'response_format(' (max_tokens)")
            == "text: bad regex 'response_format(' (max_output_tokens)")
    assert _responses_wording('"messages_max_tokens" of messages_max') == '"messages_max_tokens" of messages_max'
    assert _responses_wording("the template's messages need 'x'") == "the template's input need 'x'"


def test_the_thinking_is_a_reasoning_item(tmp_path, monkeypatch):
    """With a reasoning parser, the thinking comes as a reasoning output item before the message (streamed as
    reasoning_text events), the answer as the message's text."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import CompletionOutput, FinishReason, RequestOutput
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.openai.reasoning_parsers import resolve_reasoning_parser
    from plinth.entrypoints.openai.serving import ServerContext

    pieces = ["<think>", "<think>let me", "<think>let me think</think>", "<think>let me think</think>\n\nAnswer",
              "<think>let me think</think>\n\nAnswer!"]

    prompts = []

    async def scripted(self, rid, ids, params, priority=0, lora=None, accepted=None, cache_salt=None):   # outputs without an engine
        prompts.append(list(ids))
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(rid, None, list(ids), [CompletionOutput(0, text, list(range(i + 1)),
                                                                        finish_reason=FinishReason.STOP if last else None)],
                                last)

    monkeypatch.setattr(ServerContext, "generate", scripted)
    model = make_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off",
                                                served_model_name="tiny"))
    app = build_app(AsyncLLMEngine(engine), reasoning_parser=resolve_reasoning_parser("qwen3"))
    with TestClient(app) as http:
        raw = http.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json()
        out = Response.model_validate(raw)
        assert [item.type for item in out.output] == ["reasoning", "message"]
        assert out.output[0].content[0].text == "let me think" and out.output_text == "Answer!"   # as chat's content
        # the reply's items sent back as the next turn's input: the reasoning item is left out of the conversation
        again = http.post("/v1/responses", json={"model": "tiny", "input": [
            {"role": "user", "content": "hi"}, *raw["output"], {"role": "user", "content": "more"}]})
        assert again.status_code == 200, again.text
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer!"},
            {"role": "user", "content": "more"}]})
        assert chat.status_code == 200 and prompts[-1] == prompts[-2]
        with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
            payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(p) for p in payloads]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "let me think"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Answer!"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Answer!"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]


@pytest.mark.parametrize("finish", ["answered", "cut_off", "no_thinking", "empty"])
def test_usage_counts_the_reasoning_tokens(tmp_path, monkeypatch, finish):
    """``usage.output_tokens_details.reasoning_tokens``: the output tokens that wrote the thinking (its markers
    included), streamed or not; all of them for a reply cut off while thinking; none for a reply without thinking,
    even one that opens with white space or is empty (only the EOS)."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import CompletionOutput, FinishReason, RequestOutput
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.openai.reasoning_parsers import resolve_reasoning_parser
    from plinth.entrypoints.openai.serving import ServerContext

    model = make_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), dtype="float32", selection="off",
                                                served_model_name="tiny"))
    tok = engine.tokenizer
    thinking = tok.encode("<think>the sky is blue</think>", add_special_tokens=False)
    answer = tok.encode("Blue." if finish == "answered" else "", add_special_tokens=False)
    if finish == "cut_off":
        thinking = thinking[:-3]
    if finish in ("no_thinking", "empty"):
        thinking = []
        answer = (tok.encode("\n\n Hello world", add_special_tokens=False) if finish == "no_thinking"
                  else [engine.eos_token_ids[0]])
    ids = thinking + answer
    text = tok.decode(ids, skip_special_tokens=True)
    if thinking:
        assert text.startswith("<think>the sky") and text.endswith("Blue." if finish == "answered" else "")

    async def scripted(self, rid, prompt, params, priority=0, lora=None, accepted=None, cache_salt=None):
        reason = FinishReason.STOP if finish == "answered" else FinishReason.LENGTH
        yield RequestOutput(rid, None, list(prompt), [CompletionOutput(0, text, ids, finish_reason=reason)], True)

    monkeypatch.setattr(ServerContext, "generate", scripted)
    app = build_app(AsyncLLMEngine(engine), reasoning_parser=resolve_reasoning_parser("qwen3"))
    with TestClient(app) as http:
        usage = http.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json()["usage"]
        with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
            last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert usage["output_tokens"] == len(ids)
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(thinking)
    assert last["response"]["usage"] == usage


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_fields_that_cannot_be_written_back_are_400s(client, stream):
    """``instructions``, ``metadata``, ``user``, ``text``, ``truncation`` come back in the response as sent: a lone
    UTF-16 surrogate (valid JSON, not encodable as UTF-8) in one of them is a 400 naming it, before anything runs (not
    a 500, not a stream cut off after its headers)."""
    for field, value in (("instructions", '"\\ud800"'), ("metadata", '{"k": "\\ud800"}'), ("user", '"\\ud800"'),
                         ("truncation", '"\\ud800"'),
                         ("text", '{"format": {"type": "text"}, "verbosity": "\\ud800"}')):
        raw = (f'{{"input": "hi", "max_output_tokens": 2, "stream": {json.dumps(stream)}, "{field}": {value}}}')
        r = client.post("/v1/responses", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (field, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "not valid Unicode" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_fields_with_numbers_json_cannot_carry_are_400s(client, stream):
    """``NaN`` and ``Infinity`` (which the body's parser takes) in an echoed field cannot be written back as standard
    JSON: a 400 naming the field, not a 500 (or a stream of events that are not JSON)."""
    for value in ('{"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer"}, "strict": NaN}}',
                  '{"format": {"type": "text"}, "extra": [Infinity]}'):
        raw = f'{{"input": "hi", "max_output_tokens": 2, "stream": {json.dumps(stream)}, "text": {value}}}'
        r = client.post("/v1/responses", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (value, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == "text" and "NaN or Infinity" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_values_a_client_would_refuse_are_400s(client, stream):
    """``truncation``, ``text.verbosity`` and a json_schema ``text.format`` come back in the response: values the
    API does not define (which the SDK's response model refuses) are 400s naming the field; defined ones are echoed."""
    for extra, param, message in [({"truncation": "bogus"}, "truncation", "truncation must be one of auto, disabled"),
                                  ({"text": {"verbosity": "loud"}}, "text", "text.verbosity must be one of"),
                                  ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
                                   "text", "needs a name")]:
        r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": stream, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "truncation": "auto",
                                           "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert r.status_code == 200 and r.json()["truncation"] == "auto" and r.json()["text"]["verbosity"] == "low"
