"""Tool calling for ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, and the calls in
the output.

- ``tool_choice: "none"`` (the default without tools): the tools are shown to the template, the reply is text.
- ``"auto"`` (the default with tools): the model decides; the server's ``--tool-call-parser`` finds the calls
  in its text (:mod:`plinth.entrypoints.openai.tool_parsers`). Without a parser such requests are refused.
- ``"required"``: the output is constrained (structured outputs) to a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` objects, each naming a tool with arguments matching its schema
  (one call with ``parallel_tool_calls: false``).
- ``{"type": "function", "function": {"name": NAME}}``: the output is constrained to the arguments of that
  function (its ``parameters`` schema); the reply is that one call.

The constrained JSON is compact (``", "`` and ``": "`` separators, no free whitespace), so that a model
cannot pad it with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from plinth.core.engine import TextParts
from plinth.core.request import SamplingParamsError
from plinth.entrypoints.openai.tool_parsers import (
    FUNCTION_NAME,
    ArrayScanner,
    ParsedCall,
    ToolParser,
    arguments_json,
)

#: how the constrained JSON is written (llguidance's JSON options)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MODES = ("none", "auto", "required", "function")


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """A request's tool setup: ``kind`` is one of :data:`MODES`; ``function`` names the forced function;
    ``parser`` is the server's tool-call parser (it reads ``auto`` replies, and makes every call's id)."""

    kind: str
    tools: list[dict[str, Any]]
    function: str | None = None
    parallel: bool = True
    parser: type[ToolParser] | None = None

    def call_id(self) -> str:
        return (self.parser or ToolParser).call_id()

    @property
    def constrained(self) -> bool:
        """The output is held to the tools' schemas (``required``, a forced function)."""
        return self.kind in ("required", "function")

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output spec of a ``required`` or forced-function request.

        ``required``: an array of ``{"name", "parameters"}`` calls, each tool's schema under the root's ``$defs``
        with its local references (``#``, ``#/$defs/...``, ``#/properties/...``) rebased there.
        """
        schemas = {t["function"]["name"]: parameters(t) for t in self.tools}
        if self.kind == "function":
            assert self.function is not None
            return {"json": compact_schema(schemas[self.function])}
        if self.kind != "required":
            return None
        # each tool's schema moves whole under the array's "$defs", its local references rebased to point there
        defs: dict[str, Any] = {}
        items = []
        for i, (name, schema) in enumerate(schemas.items()):
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
            defs[f"tool_{i}"] = _rebased(schema, f"#/$defs/tool_{i}")
            items.append({"type": "object",
                          "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                          "required": ["name", "parameters"], "additionalProperties": False})
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": compact_schema(array)}


_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``) pointing under ``base`` (a JSON pointer such as
    ``#/$defs/tool_0``, where the schema now lives) and its ``$id`` dropped; data keywords are left as they are."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$id":
            continue
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` written as compact JSON (its own ``x-guidance`` options, if any, take precedence)."""
    return {**schema, "x-guidance": {**COMPACT_JSON, **(schema.get("x-guidance") or {})}}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A checked tool's arguments schema (no ``parameters``: no arguments, as OpenAI defines it)."""
    schema = tool["function"].get("parameters")
    if not schema:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", **schema}   # arguments are an object, whether or not the schema says so


def tool_mode(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
              parser: type[ToolParser] | None) -> ToolMode | None:
    """The checked tool setup of a request; ``None`` without tools and tool choice.

    Raises:
        SamplingParamsError: naming ``tools``, ``tool_choice`` or ``parallel_tool_calls``.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise SamplingParamsError("tool_choice", "tool_choice needs tools")
        return None
    checked = [_check_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SamplingParamsError("tools", f"two tools are named {dup!r}")
    choice = "auto" if tool_choice is None else tool_choice
    function = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SamplingParamsError("tool_choice", 'a named tool choice is {"type": "function", "function": '
                                      '{"name": NAME}}')
        if fn["name"] not in names:
            raise SamplingParamsError("tool_choice", f"tool_choice names {fn['name']!r}, which is not in tools")
        kind, function = "function", fn["name"]
    elif choice in ("none", "auto", "required"):
        kind = choice
    else:
        raise SamplingParamsError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named "
                                  f"function, got {choice!r}")
    if parallel is not None and not isinstance(parallel, bool):
        raise SamplingParamsError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if kind == "auto" and parser is None:
        raise SamplingParamsError("tool_choice", "tool_choice 'auto' (the default with tools) needs the server "
                                  "started with --tool-call-parser; use 'required', a named function or 'none'")
    return ToolMode(kind, checked, function, parallel is not False, parser)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise SamplingParamsError("tools", f'{where}: a tool is {{"type": "function", "function": {{...}}}}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise SamplingParamsError("tools", f"{where}: needs a 'function' object")
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise SamplingParamsError("tools", f"{where}: the function name must be 1-64 letters, digits, '_', '.' "
                                  f"or '-', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise SamplingParamsError("tools", f"{where}: description must be a string")
    params = fn.get("parameters")
    if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
        raise SamplingParamsError("tools", f"{where}: parameters must be a JSON schema of an object "
                                  f'({{"type": "object", "properties": {{...}}}})')
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SamplingParamsError("tools", f"{where}: parameters must hold JSON values only (no NaN or "
                                  f"Infinity): {exc}") from None
    if params is not None and not isinstance(params.get("x-guidance", {}), dict | None):
        raise SamplingParamsError("tools", f"{where}: parameters' x-guidance must be an object of options, "
                                  f"got {params['x-guidance']!r}")
    return {"type": "function", "function": fn}


def plain_messages(messages: Sequence[Any], images: Any = None) -> list[dict[str, Any]]:
    """OpenAI-style message dicts (from Python or a file) as the chat template takes them, the way the server
    reads a request's: an assistant's ``content: null`` (a turn of tool calls) becomes ``""``, text (and an
    assistant's refusal) content parts are joined by line breaks (:class:`TextParts`), and tool-call arguments written as a JSON object become
    the object (:func:`template_messages`). ``images`` (a model with image inputs: an
    :class:`~plinth.multimodal.images.ImageParts`) collects the images of ``image_url`` (a data URL) and ``image_pil``
    (a PIL image) parts, and a video model's videos of ``video_url`` (a data URL of a video file) and ``video`` (its
    frames) parts, in order; without it such parts are refused.

    Raises:
        ValueError: ``messages[i]: ...`` for a message that is not an object with a role and text content.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' string")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "image_pil"):
                    if images is None:
                        raise ValueError(f"messages[{i}]: this model takes no images (an {kind} content part)")
                    texts.append(images.add(part.get(kind), f"messages[{i}] {kind}"))
                    continue
                if kind in ("video_url", "video"):
                    if images is None:
                        raise ValueError(f"messages[{i}]: this model takes no videos (a {kind} content part)")
                    texts.append(images.add_video(part.get(kind), f"messages[{i}] {kind}"))
                    continue
                key = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
                if key is None or not isinstance(part.get(key), str):
                    raise ValueError(f"messages[{i}]: only text content parts ({{type: text, text}}) are supported"
                                     + (", and image_url / image_pil ones" if images is not None else "")
                                     + (" and video_url / video ones" if getattr(images, "video_placeholder", None)
                                        else ""))
                texts.append(part[key])
            content = TextParts(texts)
        elif content is None and role == "assistant":   # a turn of tool calls only
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] needs a 'content' string (or a list of text parts)")
        out.append({**m, "content": content})
    return template_messages(out)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` as chat templates read them: arguments written as a JSON object become the
    object (templates iterate or re-serialize them); other arguments stay as they are."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except (ValueError, RecursionError):   # (nesting deeper than Python's stack)
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


class ToolCallTracker:
    """The tool calls of one choice as its text grows: content deltas and tool-call deltas for a stream,
    and the final content and calls.

    :meth:`update` takes the whole text so far and returns what is new: ``(content, tool_call_deltas)``,
    each delta in the shape of OpenAI's streamed ``delta.tool_calls`` entries.

    ``markup`` is a reasoning parser's :attr:`~plinth.entrypoints.openai.reasoning_parsers.ReasoningParser.call_parser`
    (calls it leaves in the text in their markup): unless the ``auto`` parser reads them (the reader derives from
    it), it takes them out of the text first; they are the calls of ``auto`` and ``required``, a forced function's
    call (its arguments then come whole, once the call is complete), and are dropped without calls.
    """

    def __init__(self, mode: ToolMode | None, markup: type[ToolParser] | None = None):
        self.mode = mode
        auto = mode is not None and mode.kind == "auto" and mode.parser is not None
        self.parser = mode.parser(mode.tools) if auto else None   # type: ignore[union-attr,misc]
        reads = self.parser is not None and markup is not None and issubclass(markup, type(self.parser))
        self.markup = markup(mode.tools if mode is not None else []) if markup is not None and not reads else None
        self.content: str | None = ""
        self.calls: list[tuple[str, ParsedCall]] = []   # (id, call)
        self._sent_args = 0   # forced function: argument characters sent
        self._array = ArrayScanner()   # required: the array's complete elements so far
        self._found: list[ParsedCall] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        kind = self.mode.kind if self.mode is not None else "none"
        marked: tuple[ParsedCall, ...] = ()   # the calls taken out of the text in their markup
        if self.markup is not None:
            scan = self.markup.scan(text, final)
            text, marked = scan.content, scan.calls
        if kind == "function":
            assert self.mode is not None and self.mode.function is not None
            self.content = None
            deltas: list[dict[str, Any]] = []
            if marked:
                text = marked[0].arguments
            elif self.markup is not None and not final:
                text = ""   # the text may still be followed by the call: its arguments if so, else the text
            if not self.calls:
                self.calls.append((self.mode.call_id(), ParsedCall(self.mode.function, "")))
            cid, call = self.calls[0]
            self.calls[0] = (cid, ParsedCall(call.name, text))
            if text[self._sent_args:] or (final and self._sent_args == 0):
                piece: dict[str, Any] = {"index": 0, "function": {"arguments": text[self._sent_args:]}}
                if self._sent_args == 0:
                    piece = {"index": 0, "id": cid, "type": "function",
                             "function": {"name": call.name, "arguments": text}}
                deltas.append(piece)
                self._sent_args = len(text)
            return "", deltas
        if kind == "required":
            self._found.extend(c for c in map(_required_call, self._array.feed(text)) if c is not None)
            calls = [*marked, *self._found]
            if self.mode is not None and not self.mode.parallel:
                calls = calls[:1]
            self.content = None
            if final and not calls:   # cut short before a complete call: the text is the content
                self.content = text
                return text, []
            return "", self._new_calls(calls)
        before = self.content or ""
        if self.parser is None:
            self.content = text
            return text[len(before):], []
        scan = self.parser.scan(text, final)
        found = [*marked, *scan.calls]
        self.content = None if final and found and not scan.content else scan.content
        # a parser keeps its content growing (ToolParser.scan); one that does not loses only stream deltas
        delta = scan.content[len(before):] if scan.content.startswith(before) else ""
        calls = found if self.mode is None or self.mode.parallel else found[:1]
        return delta, self._new_calls(calls)

    def _new_calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        deltas = []
        for i in range(len(self.calls), len(calls)):
            cid = calls[i].id
            if not cid or any(cid == earlier for earlier, _ in self.calls):   # (a model may repeat its own id)
                cid = self.mode.call_id() if self.mode is not None else ToolParser.call_id()
            self.calls.append((cid, calls[i]))
            deltas.append({"index": i, "id": cid, "type": "function",
                           "function": {"name": calls[i].name, "arguments": calls[i].arguments}})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for a choice that stopped after calls it chose to make (auto, required)."""
        if reason == "stop" and self.calls and self.mode is not None and self.mode.kind in ("auto", "required"):
            return "tool_calls"
        return reason

    def message_calls(self) -> list[dict[str, Any]] | None:
        if not self.calls:
            return None
        return [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for cid, c in self.calls]


def _required_call(value: Any) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
            value.get("parameters"), dict):
        return None
    text = arguments_json(value["parameters"])
    return ParsedCall(value["name"], text) if text is not None else None
