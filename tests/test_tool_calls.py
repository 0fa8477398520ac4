"""Tool calling on /v1/chat/completions: tools shown to the template, forced and required calls constrained
to the tools' schemas, "auto" calls found by the --tool-call-parser, streamed deltas that add up to the
non-streamed reply.

Forced and required calls are checked with ``jsonschema`` against the tools' own schemas; parsers against
hand-written outputs in each model family's published format, and for their streaming contract on every
prefix of those outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import make_tiny_model, running_server

from plinth.entrypoints.openai.tool_parsers import (
    DeepSeekV3ToolParser,
    Glm45ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    Qwen3CoderToolParser,
    complete_array_elements,
    resolve_tool_parser,
)
from plinth.entrypoints.openai.tools import ToolCallTracker, tool_mode

# ChatML with the tools in a system message and earlier calls as <tool_call> blocks (hermes format)
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions; write each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if think is false %}<think></think>
{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# an "auto" reply the random model is made to write (guided_regex), in hermes format
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}\n</tool_call>'


# ------------------------------------------------------------------------------------------------ parsers

HERMES_TEXT = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def prefixes_scan(parser, text: str) -> tuple[str, list[ParsedCall]]:
    """Scan every prefix of ``text`` as a stream would, checking that content and calls only grow; the
    concatenated content deltas and the calls in order, after the final scan."""
    content, calls = "", []
    for i in range(len(text) + 1):
        scan = parser.scan(text[:i], final=i == len(text))
        assert scan.content.startswith(content), (text[:i], scan.content, content)
        assert list(scan.calls[:len(calls)]) == calls
        content, calls = scan.content, list(scan.calls)
    return content, calls


def test_hermes_parser_finds_calls_and_keeps_every_other_character():
    parser = HermesToolParser(TOOLS)
    content, calls = prefixes_scan(parser, HERMES_TEXT)
    assert content == "I will look that up."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "days": 2}'), ParsedCall("get_time", '{"zone": "CET"}')]
    # text on both sides of a call, joined by a line break; whitespace next to the call dropped
    content, calls = prefixes_scan(parser, 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>  Done.')
    assert (content, [c.name for c in calls]) == ("Sure.\nDone.", ["f"])
    # markup that is no call is content, verbatim; so is plain text (trailing whitespace included)
    for text in ('Look: <tool_call>{not json}</tool_call> ok', "<tool_call>[1, 2]</tool_call>", "plain text \n",
                 '<tool_call>{"arguments": {}}</tool_call>', "a <tool_ca", "<tool_call>"):
        assert prefixes_scan(parser, text) == (text, [])
    # cut short inside a block: a complete JSON call still counts; anything else is content
    assert prefixes_scan(parser, 'x <tool_call>{"name": "f", "arguments": {"a": 1}}')[1] == [ParsedCall("f", '{"a": 1}')]
    assert prefixes_scan(parser, 'x <tool_call>{"name": "f", "argu') == ('x <tool_call>{"name": "f", "argu', [])
    # one instance fed a text that does not continue the last one starts over (nothing carried over)
    assert parser.scan("plain", final=True).calls == () and parser.scan(HERMES_TEXT[:HERMES_TEXT.index("</tool_call>") + 12], final=False).calls == (
        ParsedCall("get_weather", '{"city": "Paris", "days": 2}'),)
    # arguments written as a JSON string, and "parameters" for "arguments"
    assert prefixes_scan(parser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == [
        ParsedCall("f", '{"a": 1}')]
    assert prefixes_scan(parser, '<tool_call>{"name": "f", "parameters": {"b": 2}}</tool_call>')[1] == [
        ParsedCall("f", '{"b": 2}')]


def test_arguments_nested_deeper_than_the_parser_goes_are_no_call():
    """A model that writes arguments nested past Python's recursion limit gives no call (the text stays content),
    not an error."""
    from plinth.entrypoints.openai.tool_parsers import ArrayScanner

    deep = "[" * 5000 + "]" * 5000
    for parser, text in (
            (HermesToolParser, f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'),
            (HermesToolParser, f'<tool_call>{{"name": "f", "arguments": "{deep}"}}</tool_call>'),
            (Llama3JsonToolParser, f'{{"name": "f", "parameters": {{"a": {deep}}}}}'),
            (MistralToolParser, f'[TOOL_CALLS][{{"name": "f", "arguments": {{"a": {deep}}}}}]'),
            (MistralToolParser, f'[TOOL_CALLS]f[ARGS]{{"a": {deep}}}')):
        assert parser(TOOLS).scan(text, final=True).calls == ()
    assert ArrayScanner().feed('[{"a": ' + deep + '}') == []   # (tool_choice "required" streams)


def test_llama3_json_and_mistral_parsers():
    llama = Llama3JsonToolParser(TOOLS)
    assert prefixes_scan(llama, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        "", [ParsedCall("get_time", '{"zone": "UTC"}'), ParsedCall("get_weather", '{"city": "Oslo"}')])
    assert prefixes_scan(llama, '{"name": "f", "parameters": {}}') == ("", [ParsedCall("f", "{}")])
    for text in ("It is sunny.", '{"city": "Paris"}', '{"name": "f", "parameters": {}} and more', "<|pyth"):
        assert prefixes_scan(llama, text) == (text, [])
    mistral = MistralToolParser(TOOLS)
    assert MistralToolParser.keeps_special_tokens
    assert prefixes_scan(mistral, 'Let me check. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]') == (
        "Let me check.", [ParsedCall("get_time", '{"zone": "UTC"}')])
    for text in ("[TOOL_CALLS] nonsense", "no calls [TOOL_", '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
                 '[TOOL_CALLS]get_time[ARGS]{"zone": ', "[TOOL_CALLS]get_time[ARGS][1]"):
        assert prefixes_scan(mistral, text) == (text, [])
    # the newer tokenizers' form (Mistral Small 3.2, Magistral, Devstral): NAME[ARGS]{...} after each marker
    assert prefixes_scan(mistral, 'Sure.[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]'
                                  '{"city": "Oslo"}') == (
        "Sure.", [ParsedCall("get_time", '{"zone": "UTC"}'), ParsedCall("get_weather", '{"city": "Oslo"}')])
    assert prefixes_scan(mistral, "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}") == (
        "", [ParsedCall("get_time", "{}")])


def test_llama3_json_parser_takes_a_semicolon_after_the_last_call():
    """Llama 3's calls may each end with ``;``: a trailing one (and whitespace) after the last call still leaves
    the calls, while other text after it, or a ``;`` with nothing before it, is content."""
    llama = Llama3JsonToolParser(TOOLS)
    assert prefixes_scan(llama, '{"name": "f", "parameters": {"a": 1}};') == ("", [ParsedCall("f", '{"a": 1}')])
    assert prefixes_scan(llama, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Oslo"}} ;\n') == (
        "", [ParsedCall("get_time", '{"zone": "UTC"}'), ParsedCall("get_weather", '{"city": "Oslo"}')])
    for text in ('{"name": "f", "parameters": {}};;', '{"name": "f", "parameters": {}}; more', ";", "; "):
        assert prefixes_scan(llama, text) == (text, [])


def test_glm45_and_qwen3_coder_parsers_type_bare_values_by_the_schema():
    """GLM-4.5's ``<arg_key>``/``<arg_value>`` pairs and Qwen3-Coder's ``<parameter=...>`` elements: bare-text values
    are strings where the tool's schema says so (``"2"`` for a string stays ``"2"``), JSON values elsewhere."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}}}}}]
    glm = Glm45ToolParser(tools)
    text = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>code</arg_key>\n<arg_value>75</arg_value>\n"
            "</tool_call>")
    assert prefixes_scan(glm, text) == ("Let me check.", [ParsedCall("get_weather",
                                                                     '{"city": "Paris", "days": 2, "code": "75"}')])
    assert prefixes_scan(Glm45ToolParser(tools), "<tool_call>get_time</tool_call>") == ("", [ParsedCall("get_time", "{}")])
    # a name that starts with a digit is a valid OpenAI tool name
    assert prefixes_scan(Glm45ToolParser(tools), "<tool_call>2fa_verify\n<arg_key>code</arg_key>\n<arg_value>1"
                                                 "</arg_value>\n</tool_call>") == ("", [ParsedCall("2fa_verify",
                                                                                                  '{"code": 1}')])
    for bad in ("<tool_call>two words</tool_call>", "<tool_call>f<arg_key>a</arg_key>junk</tool_call>"):
        assert prefixes_scan(Glm45ToolParser(tools), bad) == (bad, [])
    coder = Qwen3CoderToolParser(tools)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>\nDone.")
    assert prefixes_scan(coder, text) == ("Done.", [ParsedCall("get_weather", '{"city": "New York", "days": 3}')])
    multi_line = "<tool_call>\n<function=f>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>"
    assert prefixes_scan(Qwen3CoderToolParser(tools), multi_line)[1] == [ParsedCall("f", '{"body": "line 1\\nline 2"}')]
    assert prefixes_scan(Qwen3CoderToolParser(tools), "<tool_call>{json}</tool_call>") == ("<tool_call>{json}</tool_call>", [])
    crlf = "<tool_call>\r\n<function=f>\r\n<parameter=a>\r\nwin\r\n</parameter>\r\n</function>\r\n</tool_call>"
    assert prefixes_scan(Qwen3CoderToolParser(tools), crlf)[1] == [ParsedCall("f", '{"a": "win"}')]
    # a body that is no function name (a hermes-style JSON call) is content for glm45
    hermes_like = '<tool_call>{"name":"f","arguments":{}}</tool_call>'
    assert prefixes_scan(Glm45ToolParser(tools), hermes_like) == (hermes_like, [])
    # a parameter whose </parameter> the model left out ends where the next one (or the function's end) begins
    unclosed = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n"
                "</tool_call>")
    assert prefixes_scan(Qwen3CoderToolParser(tools), unclosed)[1] == [
        ParsedCall("get_weather", '{"city": "Paris", "days": 2}')]
    # a GLM value on lines of its own loses the line breaks around it
    own_lines = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>\nParis\n</arg_value>\n</tool_call>"
    assert prefixes_scan(Glm45ToolParser(tools), own_lines)[1] == [ParsedCall("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("schema, raw, value", [
    ({"type": "string"}, "123", "123"), ({"type": ["null", "string"]}, "123", "123"),
    ({"type": ["null", "string"]}, "null", None), ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "7", "7"),
    ({"enum": ["123", "456"]}, "123", "123"), ({"enum": [1, 2]}, "2", 2), ({"type": "integer"}, "42", 42),
    ({"type": "object"}, '{"a": [1]}', {"a": [1]}), ({"type": "boolean"}, "true", True), (True, "123", 123),
    ({"type": "array"}, "not json", "not json"),
    # schemas a request may send with tool_choice "auto" (not compiled): no information, not an error
    ({"anyOf": 5}, "7", 7), ({"oneOf": True}, "7", 7), ({"anyOf": [{"type": "string"}, {"enum": "x"}]}, "null", "null"),
])
def test_bare_values_follow_the_schema(schema, raw, value):
    """How glm45 and qwen3_coder type a bare value: by the property's schema (type lists, anyOf/oneOf branches, string
    enums, nullable strings; a boolean schema is no type information)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {"x": schema}}}}]
    assert Glm45ToolParser(tools).typed_value("f", "x", raw) == value


def test_bare_values_without_json_text_stay_strings():
    """A bare value that Python's JSON reader takes but that has no JSON text (``NaN``, ``Infinity``, a number out of
    float range) is the text itself, a string: the call is kept (it became content, markup and all)."""
    for raw in ("NaN", "Infinity", "-Infinity", "1e400"):
        assert Glm45ToolParser([]).typed_value("f", "x", raw) == raw
        coder = f"<tool_call>\n<function=f>\n<parameter=x>\n{raw}\n</parameter>\n</function>\n</tool_call>"
        assert prefixes_scan(Qwen3CoderToolParser(TOOLS), coder) == ("", [ParsedCall("f", json.dumps({"x": raw}))])
        glm = f"<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"
        assert prefixes_scan(Glm45ToolParser(TOOLS), glm) == ("", [ParsedCall("f", json.dumps({"x": raw}))])


def test_deepseek_and_kimi_parsers():
    """DeepSeek-V3/R1 (fenced JSON after ``function<｜tool▁sep｜>NAME``) and V3.1 (``NAME<｜tool▁sep｜>JSON``) sections of
    calls, and Kimi K2's ``functions.NAME:INDEX`` calls; a section without valid calls is content."""
    ds = DeepSeekV3ToolParser(TOOLS)
    assert DeepSeekV3ToolParser.keeps_special_tokens and KimiK2ToolParser.keeps_special_tokens
    v3 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
          '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    want = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"zone": "UTC"}')]
    assert prefixes_scan(ds, v3) == ("Checking.", want)
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
           '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert prefixes_scan(DeepSeekV3ToolParser(TOOLS), v31) == ("", want)
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{zone}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert prefixes_scan(DeepSeekV3ToolParser(TOOLS), broken) == (broken, [])
    kimi = ('I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
            '<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|><|tool_calls_section_end|>')
    assert prefixes_scan(KimiK2ToolParser(TOOLS), kimi) == ("I will check.", [
        ParsedCall(c.name, c.arguments, f"functions.{c.name}:{i}") for i, c in enumerate(want)])
    # the header is the call's id: Kimi's template writes it back in later turns
    tracker = ToolCallTracker(tool_mode(TOOLS, "auto", None, KimiK2ToolParser))
    _, deltas = tracker.update(kimi, final=True)
    assert [d["id"] for d in deltas] == ["functions.get_weather:0", "functions.get_time:1"]
    cut = '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone": "U'
    assert prefixes_scan(KimiK2ToolParser(TOOLS), cut) == (cut, [])


def test_call_ids_of_one_reply_are_unique():
    """A Kimi K2 reply that writes the same ``functions.NAME:INDEX`` header twice: the second call gets an id of its
    own (two calls with one id cannot be told apart by the tool messages that answer them)."""
    call = ('<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{{"zone": "{}"}}<|tool_call_end|>')
    kimi = f'<|tool_calls_section_begin|>{call.format("UTC")}{call.format("CET")}<|tool_calls_section_end|>'
    for final in (True, False):
        tracker = ToolCallTracker(tool_mode(TOOLS, "auto", None, KimiK2ToolParser))
        _, deltas = tracker.update(kimi, final=final)
        ids = [d["id"] for d in deltas]
        assert ids[0] == "functions.get_time:0" and ids[1].startswith("call_") and len(set(ids)) == 2
        assert [c["id"] for c in tracker.message_calls()] == ids


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "{", "}", " ",
                          "\n", "text", "<tool", "_call>", '"', "[TOOL_CALLS]", "[", "]", ";", "<|python_tag|>",
                          "f\n<arg_key>a</arg_key><arg_value>1</arg_value>", "<function=f>", "<parameter=a>", "</parameter>",
                          "</function>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                          "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>",
                          "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>", "<|tool_call_end|>",
                          "<|tool_calls_section_end|>"])


@settings(max_examples=150, deadline=None)
@given(st.lists(PIECES, max_size=12))
def test_every_parser_only_grows_its_content_and_calls_and_loses_no_text(pieces):
    """The streaming contract on arbitrary mixes of markup and text: content and calls only grow, and
    without calls the final content is the text itself."""
    text = "".join(pieces)
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Glm45ToolParser, Qwen3CoderToolParser,
                DeepSeekV3ToolParser, KimiK2ToolParser):
        content, calls = prefixes_scan(cls(TOOLS), text)
        if not calls:
            assert content == text


def test_complete_array_elements():
    assert complete_array_elements('[{"name": "a", "parameters": {}}, {"name": "b", "par') == (
        [{"name": "a", "parameters": {}}], False)
    assert complete_array_elements('[{"a": 1}, {"b": [2]}]') == ([{"a": 1}, {"b": [2]}], True)
    assert complete_array_elements("") == ([], False)
    assert complete_array_elements("[1, 2]") == ([], False)   # objects only: a number cut short would parse


def test_tool_mode_checks_and_constraints():
    from plinth.core.request import SamplingParamsError
    from plinth.core.structured import grammar_of

    assert tool_mode(None, None, None, None) is None
    mode = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None)
    assert (mode.kind, mode.function) == ("function", "get_time")
    grammar_of(mode.constraint())   # compiles
    required = tool_mode(TOOLS, "required", False, None)
    spec = required.constraint()["json"]
    assert spec["maxItems"] == 1 and len(spec["items"]["anyOf"]) == 2
    grammar_of(required.constraint())
    assert tool_mode(TOOLS, "auto", None, HermesToolParser).parser is HermesToolParser
    assert tool_mode(TOOLS, "none", None, HermesToolParser).constraint() is None
    bad = [
        ((TOOLS, "auto", None, None), "tool_choice"),                     # auto needs a parser
        ((TOOLS, None, None, None), "tool_choice"),                       # ... and is the default with tools
        ((None, "required", None, None), "tool_choice"),
        ((TOOLS, {"type": "function", "function": {"name": "nope"}}, None, None), "tool_choice"),
        ((TOOLS, "sometimes", None, None), "tool_choice"),
        (([{"type": "function", "function": {"name": "bad name!"}}], "none", None, None), "tools"),
        (([{"type": "retrieval"}], "none", None, None), "tools"),
        (([WEATHER, WEATHER], "none", None, None), "tools"),
        (([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "none", None, None), "tools"),
        ((TOOLS, "none", "yes", None), "parallel_tool_calls"),
    ]
    for args, param in bad:
        with pytest.raises(SamplingParamsError) as info:
            tool_mode(*args)
        assert info.value.param == param, args


def stream_deltas(tracker: ToolCallTracker, text: str) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` a character at a time and assemble the deltas as an OpenAI client does."""
    content, calls = "", {}
    for i in range(1, len(text) + 1):
        delta, pieces = tracker.update(text[:i], final=i == len(text))
        content += delta
        for p in pieces:
            slot = calls.setdefault(p["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = p.get("id", slot["id"])
            slot["name"] += p.get("function", {}).get("name", "")
            slot["arguments"] += p["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("choice, text", [
    ("auto", HERMES_TEXT),
    ("auto", "Just text, no calls."),
    ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": '
                 '{"city": "Rome"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome", "days": 3}'),
    ("none", HERMES_TEXT),
])
def test_streamed_deltas_add_up_to_the_final_message(choice, text):
    mode = tool_mode(TOOLS, choice, None, HermesToolParser)
    streamed = ToolCallTracker(mode)
    content, calls = stream_deltas(streamed, text)
    final = ToolCallTracker(mode)
    final.update(text, final=True)
    assert content == (final.content or "")
    expected = final.message_calls() or []
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    if choice == "none":
        assert final.content == text and not expected


# ------------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tools"))


@pytest.fixture(scope="module")
def http(model_dir: Path):
    """An in-process server on the tiny model with the tool template and the hermes parser."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=1024,
                                                served_model_name="tiny", chat_template=TOOL_TEMPLATE))
    with TestClient(build_app(AsyncLLMEngine(engine), tool_parser=HermesToolParser)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def check_calls(message, allow: set[str]) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allow
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_forced_function_gives_arguments_matching_its_schema(client):
    for seed in range(3):
        resp = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_completion_tokens=48, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = resp.choices[0]
        assert choice.message.content is None and choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert check_calls(choice.message, {"get_weather"})[0][0] == "get_weather"
        else:   # out of tokens inside the JSON: what was written is its beginning
            assert choice.message.tool_calls[0].function.arguments.startswith("{")
    # the same request streamed: the deltas add up to the same call (greedy)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_completion_tokens=48, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    args, name, reasons = "", "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for piece in c.delta.tool_calls or ():
                assert piece.index == 0
                name += piece.function.name or ""
                args += piece.function.arguments or ""
            reasons.append(c.finish_reason)
    assert (name, args) == ("get_time", whole.message.tool_calls[0].function.arguments)
    assert reasons[-1] == whole.finish_reason
    if whole.finish_reason == "stop":
        assert json.loads(args)["zone"] in ("UTC", "CET")


def test_required_gives_calls_of_listed_tools(client):
    for parallel in (True, False):
        for seed in range(3):
            resp = client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                max_completion_tokens=96, temperature=1.0, seed=seed)
            choice = resp.choices[0]
            if choice.finish_reason == "length" and not choice.message.tool_calls:
                assert choice.message.content.startswith("[")   # cut before the first call was complete
                continue
            calls = check_calls(choice.message, {"get_weather", "get_time"})
            assert calls and (parallel or len(calls) == 1)
            assert choice.finish_reason in ("tool_calls", "length")


def test_auto_finds_the_call_the_model_writes(client):
    """The model writes a hermes call (made to by a regex constraint); the parser turns it into a call."""
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_completion_tokens=200, temperature=0.8, seed=3,
                  extra_body={"guided_regex": CALL_REGEX})
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (name, args), = check_calls(choice.message, {"get_weather"})
    assert name == "get_weather" and 2 <= len(args["city"]) <= 6
    text = ""
    calls = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls.extend(c.delta.tool_calls or ())
    assert text == "" and [(c.function.name, c.function.arguments) for c in calls] == [
        (name, choice.message.tool_calls[0].function.arguments)]
    # free text with tools: content, no calls, finish reason as usual
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_completion_tokens=12,
                                          temperature=0, extra_body={"guided_regex": "[a-z]{3,8}( [a-z]{3,8})?"})
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content and choice.message.content[0].isalpha()


def test_tools_reach_the_template_and_history_with_calls_renders(http):
    without = http.post("/tokenize", json={"messages": MESSAGES}).json()
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    assert with_tools["count"] > without["count"]
    text = http.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "The weather in a city." in text
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    rendered = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    # the arguments reach the template as an object (re-serialized by it), the tool's answer as a message
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "sunny, 21 C" in text
    r = http.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 4,
                                                 "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x y"}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    *(({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                                                                                "x-guidance": "bad"}}}],
        "tool_choice": choice}, "tools") for choice in ("required", {"type": "function", "function": {"name": "a"}})),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("choice", ['"required"', '{"type": "function", "function": {"name": "a"}}', '"none"'])
def test_tool_schemas_with_numbers_json_cannot_carry_are_400s_naming_tools(http, choice):
    """``NaN`` or ``Infinity`` (which the body's parser takes) in a tool's parameters: a 400 naming ``tools``."""
    tools = '[{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": ' \
            '{"x": {"type": "number", "maximum": Infinity}}}}}]'
    raw = f'{{"messages": {json.dumps(MESSAGES)}, "max_tokens": 2, "tools": {tools}, "tool_choice": {choice}}}'
    r = http.post("/v1/chat/completions", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "NaN or Infinity" in err["message"], err


def test_auto_without_a_parser_is_refused_and_the_flag_names_its_choices(model_dir: Path):
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app
    from plinth.entrypoints.openai.tool_parsers import ParserChoiceError

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=256))
    with TestClient(build_app(AsyncLLMEngine(engine))) as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
    assert resolve_tool_parser("hermes") is HermesToolParser and resolve_tool_parser(None) is None
    with pytest.raises(ParserChoiceError, match="deepseek_v3, glm45, gpt_oss, hermes, kimi_k2, llama3_json, mistral, qwen3_coder"):
        resolve_tool_parser("nope")
    r = subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", "serve", str(model_dir), "--tool-call-parser",
                        "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not a registered tool-call parser" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.server
def test_plinth_serve_with_a_tool_parser(model_dir: Path, tmp_path: Path):
    """``plinth serve --enable-auto-tool-choice --tool-call-parser hermes --chat-template FILE`` (vLLM's launch line
    for tools): a streamed auto call over HTTP; ``--uvicorn-log-level warning`` quiets the HTTP server's lines."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    args = [str(model_dir), "--selection", "off", "--max-model-len", "1024", "--served-model-name", "tiny",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template),
            "--uvicorn-log-level", "warning"]
    with running_server(args) as srv:
        assert "serving tiny on" in srv.output() and "Application startup complete" not in srv.output()
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, stream=True,
                                                max_completion_tokens=200, temperature=0,
                                                extra_body={"guided_regex": CALL_REGEX})
        calls, reasons = [], []
        for chunk in stream:
            for c in chunk.choices:
                calls.extend(c.delta.tool_calls or ())
                reasons.append(c.finish_reason)
        assert [c.function.name for c in calls] == ["get_weather"] and reasons[-1] == "tool_calls"
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])


def test_continue_final_message_and_chat_template_kwargs(http):
    """An open last message (no end-of-turn after it) and template variables, through /tokenize and chat."""
    def rendered(body):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    partial = MESSAGES + [{"role": "assistant", "content": "The weather in Paris is"}]
    text = rendered({"messages": partial, "add_generation_prompt": False, "continue_final_message": True})
    assert text.endswith("The weather in Paris is")
    closed = rendered({"messages": partial, "add_generation_prompt": False})
    assert closed.rstrip().endswith("The weather in Paris is<|im_end|>")
    assert rendered({"messages": MESSAGES, "chat_template_kwargs": {"think": False}}).endswith("<think></think>\n")
    assert not rendered({"messages": MESSAGES}).endswith("<think></think>\n")
    r = http.post("/v1/chat/completions", json={"messages": partial, "add_generation_prompt": False,
                                                 "continue_final_message": True, "max_tokens": 3,
                                                 "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    for body, param in [({"messages": partial, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
                         "chat_template_kwargs")]:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_calls_whose_arguments_have_no_json_text_are_content():
    """NaN, Infinity, out-of-range numbers and lone surrogate escapes cannot be written back as JSON that
    clients parse: such a block is content, not a call."""
    parser = HermesToolParser(TOOLS)
    for args in ('{"city": NaN}', '{"days": Infinity}', '{"days": 1e400}', '{"city": "\\ud800"}'):
        text = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
        assert prefixes_scan(parser, text) == (text, [])
    assert prefixes_scan(parser, '<tool_call>{"name": "f", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>')[1] == [
        ParsedCall("f", '{"city": "Zürich"}')]
    mode = tool_mode(TOOLS, "required", None, None)
    tracker = ToolCallTracker(mode)
    tracker.update('[{"name": "get_weather", "parameters": {"days": NaN}}]', final=True)
    assert tracker.message_calls() is None


def test_tool_schemas_edge_cases(http):
    """$defs and other local references in required mode, a function without parameters (no arguments),
    parameters that are not an object, an uncompilable schema, a name with a line break."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
            "additionalProperties": False}
    nested = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "$defs": {"City": city}, "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"], "additionalProperties": False}}}
    bare = {"type": "function", "function": {"name": "ping"}}
    body = {"messages": MESSAGES, "tools": [nested, bare], "tool_choice": "required", "max_tokens": 120,
            "temperature": 0.8, "seed": 4}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"]["tool_calls"] or []:
        schema = nested["function"]["parameters"] if call["function"]["name"] == "visit" else {
            "type": "object", "additionalProperties": False}
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [bare], "max_tokens": 20,
                                                 "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"City": {"type": "string"}}, "properties": {"c": {"$ref": "#/$defs/City"}}}}}
    # two tools whose definitions share a name: in "required" each call still follows its own tool's schema (more
    # local references: test_required_constraint_keeps_each_tools_local_references)
    tools = {"visit": nested["function"]["parameters"], "other": other["function"]["parameters"]}
    seen = set()
    for seed in range(6):
        r = http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tool_choice": "required", "max_tokens": 300, "temperature": 1.0, "seed": seed,
            "tools": [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools.items()]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        for call in choice["message"].get("tool_calls") or []:
            seen.add(call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), tools[call["function"]["name"]])
        assert choice["finish_reason"] == "length" or choice["message"]["tool_calls"]
    assert seen
    bad = [
        ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}],
          "tool_choice": "none"}, "tools", "object"),
        ({"tools": [{"type": "function", "function": {"name": "r", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}],
          "tool_choice": "required"}, "tools", "tools[0] (r)"),
        ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}], "tool_choice": "none"}, "tools",
         "name"),
    ]
    for extra, param, words in bad:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"], r.text


def test_history_must_name_its_calls(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ok = MESSAGES + [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1",
                                                                    "content": "sunny"}]
    assert http.post("/v1/chat/completions", json={"messages": ok, "max_tokens": 1}).status_code == 200
    for messages in (ok[:2] + [{"role": "tool", "content": "sunny"}],
                     MESSAGES + [{"role": "assistant", "tool_calls": [{**call, "id": None}]}],
                     MESSAGES + [{"role": "assistant", "tool_calls": [{**call, "type": "retrieval"}]}]):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_one_call_without_parallel_calls_and_mistral_ids():
    mode = tool_mode(TOOLS, "auto", False, HermesToolParser)
    tracker = ToolCallTracker(mode)
    assert stream_deltas(tracker, HERMES_TEXT)[1][0]["name"] == "get_weather"
    assert len(tracker.message_calls()) == 1
    mistral = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, MistralToolParser)
    tracker = ToolCallTracker(mistral)
    tracker.update('{"zone": "UTC"}', final=True)
    cid = tracker.message_calls()[0]["id"]
    assert len(cid) == 9 and cid.isalnum()


def test_streamed_forced_call_has_null_content(http):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 30, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}


def test_required_constraint_keeps_each_tools_local_references(tmp_path):
    """The grammar of tool_choice "required" accepts exactly the calls whose arguments follow their tool's
    schema, when the schema refers to itself ("#"), to its own properties, or carries an $id."""
    from conftest import make_tokenizer

    from plinth.core.structured import GrammarCompiler, normalize
    from plinth.entrypoints.openai.tools import tool_mode

    node = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "sub": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
            "required": ["v", "sub"], "additionalProperties": False}
    pair = {"$id": "urn:pair", "type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"], "additionalProperties": False}
    untyped = {"properties": {"n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("node", node), ("pair", pair), ("untyped", untyped))]
    tok = make_tokenizer()
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    spec = normalize(tool_mode(tools, "required", True, None).constraint())

    def accepts(calls: list) -> bool:
        matcher = compiler.matcher(spec)
        text = json.dumps(calls)   # the separators of COMPACT_JSON
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher.is_accepting()

    valid = [{"name": "node", "parameters": {"v": 1, "sub": {"v": 2, "sub": None}}},
             {"name": "pair", "parameters": {"a": "x", "b": "y"}}, {"name": "untyped", "parameters": {"n": 3}}]
    assert accepts(valid)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in valid:
        jsonschema.validate(call["parameters"], schemas[call["name"]])
    invalid = [[{"name": "node", "parameters": {"v": 1, "sub": [{"name": "node", "parameters": {"v": 2, "sub": None}}]}}],
               [{"name": "pair", "parameters": {"a": "x", "b": "z"}}],
               [{"name": "untyped", "parameters": 5}], [{"name": "untyped", "parameters": True}]]
    for calls in invalid:
        assert not accepts(calls), calls


def test_tool_choice_none_keeps_special_tokens_out_of_the_content(model_dir: Path):
    """A parser that reads special tokens (mistral's ``[TOOL_CALLS]``) gets them only when it reads the reply
    (``tool_choice: auto``); with ``none`` the reply is plain chat, special tokens skipped as without tools."""
    from starlette.testclient import TestClient

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=1024,
                                                served_model_name="tiny", chat_template=TOOL_TEMPLATE))
    special = engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert special not in engine.eos_token_ids
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {str(special): 100}}
    with TestClient(build_app(AsyncLLMEngine(engine), tool_parser=MistralToolParser)) as http:
        plain = http.post("/v1/chat/completions", json=body).json()
        assert "choices" in plain, plain
        plain = plain["choices"][0]["message"]
        none = http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"}).json()
        auto = http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "auto"}).json()
    assert "choices" in none, none
    assert plain["content"] == "" and none["choices"][0]["message"]["content"] == "", none
    assert auto["choices"][0]["message"]["content"] == "<|endoftext|>" * 3   # the parser read them (no call)


@pytest.mark.parametrize("mentions", [True, False])
def test_the_tools_warning_reads_a_models_named_templates(tmp_path, caplog, mentions):
    """A model whose tokenizer has named templates (``default`` and ``tool_use``): the start-up warning that the
    template never renders tools looks at all of them (it warned though ``tool_use`` renders them)."""
    import logging

    from server_utils import make_tiny_model

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(make_tiny_model(tmp_path / "m")), selection="off"))
    engine.tokenizer.chat_template = {
        "default": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "tool_use": "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}" if mentions
        else "{% for m in messages %}{{ m.content }}!{% endfor %}"}
    with caplog.at_level(logging.WARNING):
        build_app(AsyncLLMEngine(engine), tool_parser=HermesToolParser)
    assert ("the chat template does not mention tools" in caplog.text) != mentions


def test_earlier_calls_with_arguments_nested_too_deep_still_render(http):
    """An assistant message's tool call whose arguments nest deeper than the JSON parser goes is passed to the
    template as the string it is (not a 500)."""
    deep = '{"a": ' + "[" * 1200 + "]" * 1200 + "}"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # the arguments pass as text (the prompt holds the brackets), or, where the parser went that deep and the
    # template's JSON filter could not, the template's error: a 400 naming messages (never a 500)
    r = http.post("/tokenize", json={"model": "tiny", "messages": messages})
    assert (r.status_code == 200 and r.json()["count"] > 2400) or (
        r.status_code == 400 and r.json()["error"]["param"] == "messages"), r.text
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text   # (too long for 1,024 tokens)
