"""Tool-call parsers: find the tool calls a model wrote in its own markup.

With ``tool_choice: "auto"`` the model decides whether to call a tool, and writes the call in the format its
chat template taught it. ``plinth serve --tool-call-parser NAME`` names that format; a parser turns the
generated text into content and calls. Parsers are plugins (``plinth_tool_parsers`` hook), and the built-in
ones register through the same hook:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text
  (Hermes 2 Pro, Qwen2 and Qwen2.5, and the many models trained on that format);
- ``llama3_json``: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``, or several
  separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1-3.3 with JSON tool calling);
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name": ..., "arguments": {...}}``;
- ``gpt_oss``: harmony messages to ``functions.NAME`` with JSON bodies (gpt-oss;
  :mod:`plinth.entrypoints.openai.harmony`);
- ``glm45``: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (GLM-4.5, 4.6);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>``
  (Qwen3-Coder);
- ``deepseek_v3``: DeepSeek's ``<｜tool▁calls▁begin｜>`` section (V3, R1 with fenced JSON arguments; V3.1);
- ``kimi_k2``: Kimi K2's ``<|tool_calls_section_begin|>`` section of ``functions.NAME:INDEX`` calls.

A parser looks at the whole text generated so far (:meth:`ToolParser.scan`) and returns the content and
the complete calls it finds. While the text grows, both only grow: text that may still become markup
(``<tool_c`` at the end, an open block, trailing whitespace) is held back until it is decided, so a stream
sends each piece once. Markup that turns out not to hold a valid call is content, verbatim: no generated text
is lost.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

from plinth.errors import UserFacingError
from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_tool_parsers() -> dict[str, str]:
    return {
        "hermes": "plinth.entrypoints.openai.tool_parsers:HermesToolParser",
        "llama3_json": "plinth.entrypoints.openai.tool_parsers:Llama3JsonToolParser",
        "mistral": "plinth.entrypoints.openai.tool_parsers:MistralToolParser",
        "glm45": "plinth.entrypoints.openai.tool_parsers:Glm45ToolParser",
        "qwen3_coder": "plinth.entrypoints.openai.tool_parsers:Qwen3CoderToolParser",
        "deepseek_v3": "plinth.entrypoints.openai.tool_parsers:DeepSeekV3ToolParser",
        "kimi_k2": "plinth.entrypoints.openai.tool_parsers:KimiK2ToolParser",
        "gpt_oss": "plinth.entrypoints.openai.harmony:GptOssToolParser",
    }


class ParserChoiceError(UserFacingError, ValueError):
    """``--tool-call-parser`` or ``--reasoning-parser`` names no registered parser, or one of the wrong class."""


def resolve_tool_parser(name: str | None) -> type[ToolParser] | None:
    """The parser class registered as ``name`` (``None``: no parser).

    Raises:
        ParserChoiceError: no parser has that name, or the registration is not a ToolParser subclass.
        PluginError: its module cannot be imported.
    """
    return resolve_parser("tool_parsers", "--tool-call-parser", "tool-call parser", name, ToolParser)


def resolve_parser(kind: str, flag: str, what: str, name: str | None, base: type) -> Any:
    """The class a plugin registered as ``name`` among ``kind`` (``None``: none), checked to subclass ``base``
    (``flag`` and ``what`` name it in errors)."""
    if name is None:
        return None
    from plinth.plugins import get_plugin_manager

    registered = get_plugin_manager().registrations(kind)
    found = registered.get(name)
    if found is None:
        raise ParserChoiceError(f"{flag} {name!r} is not a registered {what}; registered: "
                                f"{', '.join(sorted(registered)) or 'none'}")
    cls = found.load()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ParserChoiceError(f"{what} {name!r} from plugin {found.plugin!r} ({found.ref}) is not a "
                                f"{base.__name__} subclass")
    return cls


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text; ``id`` where the model wrote one that its
    chat template reads back in later turns (Kimi K2's ``functions.NAME:INDEX``), else ``None`` (a new id is made)."""

    name: str
    arguments: str
    id: str | None = None


@dataclasses.dataclass(frozen=True)
class Scan:
    """What a text holds so far: its content (the text outside tool-call markup) and its complete calls."""

    content: str
    calls: tuple[ParsedCall, ...] = ()


def call_from(value: Any, argument_keys: Sequence[str] = ("arguments", "parameters")) -> ParsedCall | None:
    """The call a decoded JSON value describes: an object with a string ``name`` and an object of arguments
    under one of ``argument_keys`` (missing: no arguments); ``None`` for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in value:
            args = value[key]
            break
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):   # (nesting deeper than Python's stack)
            return None
    if not isinstance(args, dict):
        return None
    text = arguments_json(args)
    return ParsedCall(value["name"], text) if text is not None else None


def arguments_json(args: dict[str, Any]) -> str | None:
    """Decoded arguments as JSON text any client can read back; ``None`` for values that have no such text
    (``NaN``, ``Infinity``, a number out of float range, a lone UTF-16 surrogate escape)."""
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return None
    return text


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (text that may
    still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Base class of tool-call parsers. Subclass it, set :attr:`name`, implement :meth:`scan`, and register
    the class with the ``plinth_tool_parsers`` hook; one instance serves one request's choice."""

    name: ClassVar[str] = ""
    #: the markup is made of special tokens (e.g. ``[TOOL_CALLS]``): requests keep them in the text
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[dict[str, Any]]):
        self.tools = list(tools)

    @classmethod
    def call_id(cls) -> str:
        """A new id for a call (the model's chat template reads it back in later turns)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def scan(self, text: str, final: bool) -> Scan:
        """The content and complete calls of ``text``, all the model has generated so far (``final``:
        all it will generate). For a growing text, each scan's content and calls must start with the
        previous scan's; with ``final`` nothing is held back."""
        raise NotImplementedError


def join_segments(segments: list[str], has_calls: bool, final: bool) -> str:
    """Content from the text between calls (one segment per stretch; a call starts a new one): whitespace
    next to a call is dropped, segments are joined by a line break, and trailing whitespace is held back
    until the text goes on. Without calls the final content is the text itself."""
    if final and not has_calls:
        return "".join(segments)
    last = len(segments) - 1
    parts = []
    for i, seg in enumerate(segments):
        if i > 0:
            seg = seg.lstrip()
        if i < last or not final or has_calls:
            seg = seg.rstrip()
        if seg:
            parts.append(seg)
    return "\n".join(parts)


class BlockToolParser(ToolParser):
    """Calls in blocks between :attr:`OPEN` and :attr:`CLOSE` markers among ordinary text; :meth:`decode` reads a
    block's body (``None``: not a call after all, and the block is content, verbatim). A block cut short by the end
    of the generation is decoded as it stands."""

    OPEN: ClassVar[str] = ""
    CLOSE: ClassVar[str] = ""

    def __init__(self, tools: Sequence[dict[str, Any]]):
        super().__init__(tools)
        # the decided part of the text seen last (up to the end of its last closed block): a longer text
        # with the same start resumes there, so a stream decodes each block once
        self._done: tuple[str, list[str], list[ParsedCall]] = ("", [""], [])

    def decode(self, body: str) -> list[ParsedCall] | None:
        """The calls in one block's body."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        done_text, done_segments, done_calls = self._done
        if not text.startswith(done_text):
            done_text, done_segments, done_calls = "", [""], []
        segments, calls, pos = list(done_segments), list(done_calls), len(done_text)
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                segments[-1] += tail if final else tail[:len(tail) - held_prefix(tail, self.OPEN)]
                break
            segments[-1] += text[pos:start]
            end = text.find(self.CLOSE, start + len(self.OPEN))
            if end < 0 and not final:   # an open block: wait for the rest
                break
            block_end = end + len(self.CLOSE) if end >= 0 else len(text)
            found = self.decode(text[start + len(self.OPEN):end if end >= 0 else len(text)])
            if not found:   # not a call after all: the markup is content
                segments[-1] += text[start:block_end]
            else:
                calls.extend(found)
                segments.append("")
            pos = block_end
            if end >= 0:
                self._done = (text[:pos], list(segments), list(calls))
        return Scan(join_segments(segments, bool(calls), final), tuple(calls))

    def call_of(self, function: str, pairs: re.Pattern[str], text: str, clean: Any) -> list[ParsedCall] | None:
        """One call of ``function`` whose arguments are ``text``'s ``(key, value)`` matches of ``pairs`` (nothing but
        whitespace between them; each value passed through ``clean``, then typed); ``None`` if ``text`` is not that."""
        args, pos = {}, 0
        for m in pairs.finditer(text):
            if text[pos:m.start()].strip():
                return None
            key = m.group(1).strip()
            args[key] = self.typed_value(function, key, clean(m.group(2)))
            pos = m.end()
        if text[pos:].strip():
            return None
        json_text = arguments_json(args)
        return [ParsedCall(function, json_text)] if json_text is not None else None

    def typed_value(self, function: str, key: str, raw: str) -> Any:
        """An argument the model wrote as bare text (GLM-4.5, Qwen3-Coder): a string where the tool's schema lets the
        parameter be one (``type`` ``string`` or a list holding it, a string ``enum`` holding the text, an
        ``anyOf``/``oneOf`` branch of those; ``null`` where it also allows null), else the JSON value the text reads
        as (a string where it reads as none, or as a value with no JSON text: ``NaN``, ``Infinity``, ``1e400``)."""
        schema = self._property_schema(function, key)
        if schema is not None and _allows_string(schema, raw):
            return None if raw.strip() == "null" and _allows_null(schema) else raw
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        return value if arguments_json({key: value}) is not None else raw

    def _property_schema(self, function: str, key: str) -> Any:
        for tool in self.tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and fn.get("name") == function:
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, dict) else None
                return props.get(key) if isinstance(props, dict) else None
        return None


def _strip_one_line_break(value: str) -> str:
    for brk in ("\r\n", "\n"):
        if value.startswith(brk):
            value = value[len(brk):]
            break
    for brk in ("\r\n", "\n"):
        if value.endswith(brk):
            return value[:-len(brk)]
    return value


def _schema_branches(schema: Any) -> list[dict[str, Any]]:
    """A property schema and its ``anyOf`` / ``oneOf`` branches (dicts only)."""
    if not isinstance(schema, dict):
        return []
    out = [schema]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else ():   # (a tool's schema is not checked in auto)
            out.extend(_schema_branches(branch))
    return out


def _types(branch: dict[str, Any]) -> list[Any]:
    kind = branch.get("type")
    return kind if isinstance(kind, list) else [kind]


def _allows_string(schema: Any, raw: str) -> bool:
    for branch in _schema_branches(schema):
        enum = branch.get("enum")
        if isinstance(enum, list) and raw in enum:
            return True
        if "string" in _types(branch):
            return True
    return False


def _allows_null(schema: Any) -> bool:
    return any("null" in _types(b) or (isinstance(b.get("enum"), list) and None in b["enum"])
               for b in _schema_branches(schema))


class HermesToolParser(BlockToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks among ordinary text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def decode(self, body: str) -> list[ParsedCall] | None:
        call = _decode_one(body)
        return [call] if call is not None else None


def _decode_one(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return call_from(value)


class Glm45ToolParser(BlockToolParser):
    """GLM-4.5 / 4.6: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs, then
    ``</tool_call>``; values are bare text (typed by the tool's schema, see :meth:`typed_value`)."""

    name = "glm45"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def decode(self, body: str) -> list[ParsedCall] | None:
        head, _, rest = body.partition("<arg_key>")
        fn = head.strip()
        if not FUNCTION_NAME.fullmatch(fn):
            return None
        # a value written on lines of its own loses the line breaks around it, as Qwen3-Coder's do
        return self.call_of(fn, self._PAIR, "<arg_key>" + rest if _ else "", _strip_one_line_break)


class Qwen3CoderToolParser(BlockToolParser):
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>``, each value
    on its own lines (typed by the tool's schema, see :meth:`typed_value`)."""

    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
    # a value ends at </parameter>, or where the next parameter or the function's end begins (the model left out
    # its </parameter>)
    _PARAM = re.compile(r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def decode(self, body: str) -> list[ParsedCall] | None:
        m = self._FUNCTION.match(body)
        if m is None:
            return None
        return self.call_of(m.group(1), self._PARAM, m.group(2), _strip_one_line_break)


class DeepSeekV3ToolParser(BlockToolParser):
    """DeepSeek-V3 / R1 / V3.1: a section ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` of calls
    ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>``, each either ``function<｜tool▁sep｜>NAME`` followed by the
    arguments in a fenced JSON block (V3, R1) or ``NAME<｜tool▁sep｜>`` followed by the JSON arguments (V3.1)."""

    name = "deepseek_v3"
    keeps_special_tokens = True
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _FENCED = re.compile(r"\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)

    def decode(self, body: str) -> list[ParsedCall] | None:
        calls, pos = [], 0
        while True:
            start = body.find(self.CALL, pos)
            if start < 0:
                return calls if calls and not body[pos:].strip() else None
            if body[pos:start].strip():
                return None
            end = body.find(self.END, start)
            call = self._call(body[start + len(self.CALL):end if end >= 0 else len(body)])
            if call is None:
                return None
            calls.append(call)
            if end < 0:
                return calls
            pos = end + len(self.END)

    def _call(self, text: str) -> ParsedCall | None:
        head, sep, rest = text.partition(self.SEP)
        if not sep:
            return None
        if head.strip() == "function":          # V3 / R1: the name, then a fenced JSON block
            m = self._FENCED.match(rest)
            if m is None:
                return None
            fn, raw = m.group(1), m.group(2)
        else:                                    # V3.1: the name before the separator
            fn, raw = head.strip(), rest.strip()
        try:
            args = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not fn or not isinstance(args, dict):
            return None
        text_args = arguments_json(args)
        return ParsedCall(fn, text_args) if text_args is not None else None


class KimiK2ToolParser(BlockToolParser):
    """Kimi K2: a section ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>`` of calls
    ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>``; the
    ``functions.NAME:INDEX`` header is the call's id (Kimi's chat template writes the id back there)."""

    name = "kimi_k2"
    keeps_special_tokens = True
    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    _CALL = re.compile(r"\s*<\|tool_call_begin\|>(?P<id>\s*(?:functions\.)?([^\s<:]+)(?::\d+)?\s*)"
                       r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)", re.DOTALL)

    def decode(self, body: str) -> list[ParsedCall] | None:
        calls, pos = [], 0
        while pos < len(body) and body[pos:].strip():
            m = self._CALL.match(body, pos)
            if m is None:
                return None
            try:
                args = json.loads(m.group(3))
            except (ValueError, RecursionError):
                return None
            text = arguments_json(args) if isinstance(args, dict) else None
            if text is None:
                return None
            calls.append(ParsedCall(m.group(2), text, m.group("id").strip()))
            pos = m.end()
        return calls or None


class Llama3JsonToolParser(ToolParser):
    """A reply that is a JSON call (or several joined by ``;``, the last one may be followed by ``;`` too),
    optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        maybe_call = not body or body.startswith("{") or self.TAG.startswith(text.lstrip())
        if not final:
            return Scan("" if maybe_call else text.rstrip())
        if maybe_call and body:
            calls = self._calls(body)
            if calls:
                return Scan("", tuple(calls))
        return Scan(text)

    @staticmethod
    def _calls(body: str) -> list[ParsedCall]:
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while True:
            try:
                value, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return []
            call = call_from(value, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return []
            pos = len(body) - len(rest) + 1
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if pos == len(body):   # a ";" after the last call
                return calls


class MistralToolParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and a JSON array of calls, or (the newer tokenizers: Mistral Small 3.2,
    Magistral, Devstral) ``[TOOL_CALLS]NAME[ARGS]{...}`` once per call."""

    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"

    @classmethod
    def call_id(cls) -> str:
        """Nine letters and digits: Mistral's templates refuse any other id."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.MARKER)
        if start < 0:
            if final:
                return Scan(text)
            return Scan(text[:len(text) - held_prefix(text, self.MARKER)].rstrip())
        before = text[:start]
        if not final:
            return Scan(before.rstrip())
        calls = self._calls(text[start + len(self.MARKER):])
        if calls is None:
            return Scan(text)
        return Scan(before.rstrip(), tuple(calls))

    @classmethod
    def _calls(cls, body: str) -> list[ParsedCall] | None:
        if not body.lstrip().startswith(("[", "{")):
            return cls._named_calls(body)
        try:
            value, end = json.JSONDecoder().raw_decode(body.strip())
        except (ValueError, RecursionError):
            return None
        if body.strip()[end:].strip():
            return None
        items = value if isinstance(value, list) else [value]
        calls = [call_from(v) for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls   # type: ignore[return-value]

    @classmethod
    def _named_calls(cls, body: str) -> list[ParsedCall] | None:
        """``NAME[ARGS]{...}`` calls, each after its own ``[TOOL_CALLS]`` (the first one's already read)."""
        calls = []
        for piece in body.split(cls.MARKER):
            m = _MISTRAL_NAMED_CALL.match(piece)
            if m is None:
                return None
            try:
                args, end = json.JSONDecoder().raw_decode(m.group(2))
            except (ValueError, RecursionError):
                return None
            text = arguments_json(args) if isinstance(args, dict) else None
            if m.group(2)[end:].strip() or text is None:
                return None
            calls.append(ParsedCall(m.group(1), text))
        return calls


#: one call of Mistral's newer format after its ``[TOOL_CALLS]``: the name, an optional ``[CALL_ID]``, then ``[ARGS]``
_MISTRAL_NAMED_CALL = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]\s*(.*)", re.DOTALL)

#: a function name as OpenAI's tools allow it (ASCII letters, digits, ``_``, ``-``, ``.``, at most 64): what a tool
#: definition may be named (:func:`plinth.entrypoints.openai.tools.tool_mode`) and what a parser reads as one
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

_ELEMENT_GAP = re.compile(r"\s*,?\s*")


def complete_array_elements(text: str) -> tuple[list[Any], bool]:
    """The complete elements at the start of a JSON array being written (``text`` may stop anywhere), and
    whether the array is closed. Elements must be objects or arrays (a number cut short would parse)."""
    scanner = ArrayScanner()
    return scanner.feed(text), scanner.closed


class ArrayScanner:
    """:func:`complete_array_elements` for a growing text: :meth:`feed` decodes only what is new and returns
    the elements completed since the last call."""

    def __init__(self) -> None:
        self.closed = False
        self._text = ""   # the text up to the end of the last complete element
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Any]:
        if not text.startswith(self._text) or self.closed:
            return []
        body = text.lstrip()
        if not body.startswith("["):
            return []
        lead = len(text) - len(body)
        pos = max(len(self._text) - lead, 1)
        out = []
        while True:
            pos = _ELEMENT_GAP.match(body, pos).end()   # type: ignore[union-attr]
            if body.startswith("]", pos):
                self.closed = True
                return out
            if pos >= len(body) or body[pos] not in "{[":
                return out
            try:
                value, pos = self._decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return out
            out.append(value)
            self._text = text[:lead + pos]
