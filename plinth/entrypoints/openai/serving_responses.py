"""``POST /v1/responses``: OpenAI's Responses API, stateless, for text.

A request is turned into a chat request (``instructions`` as the system message, ``input`` as the conversation,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` as the response format) and run through the chat
route's checks and rendering; the reply is one ``message`` output item with one ``output_text`` part (after a
``reasoning`` item holding the thinking, with a reasoning parser), ``status`` ``completed``, ``incomplete``
(``max_output_tokens``), ``cancelled`` or ``failed``, and ``usage``. With ``stream`` the answer comes as the
API's server-sent events: ``response.created``, ``response.in_progress``, each item added, its text deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``), its ``done`` events, then
``response.completed`` (``response.incomplete``; an ``error`` event and ``response.failed`` on a failure). Not
supported (a 400 naming the field): tools, ``previous_response_id``
(nothing is stored), ``background``, input items other than messages, content other than text. ``reasoning``
items (a reply's output sent back as the next request's input) are accepted and left out of the conversation.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.request import RequestOutput
from plinth.entrypoints.openai.errors import APIError, bad_request, to_api_error
from plinth.entrypoints.openai.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ResponsesRequest,
    random_id,
)
from plinth.entrypoints.openai.serving import ServerContext, finish, merge, start
from plinth.entrypoints.openai.serving_chat import _last, _Reply, prepare_chat
from plinth.entrypoints.openai.streaming import SSEResponse, unless_disconnected

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _messages(req: ResponsesRequest) -> list[dict[str, str]]:
    """The conversation as chat messages (instructions first)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue   # a reply's reasoning item sent back: left out, as chat templates drop earlier turns' thinking
        if kind != "message" or "role" not in item:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (messages only)", "input")
        role = _ROLES.get(item["role"]) if isinstance(item["role"], str) else None
        if role is None:
            raise bad_request(f"input[{i}]: role {item['role']!r} is not one of {', '.join(_ROLES)}", "input")
        content = item.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []   # as chat content parts (joined as the chat route does)
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    url = part.get("image_url")
                    if not isinstance(url, str):
                        raise bad_request(f"input[{i}].content[{j}]: an input_image part needs its image_url (a "
                                          "data URL; file_id is not supported)", "input")
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                    continue
                if (not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS
                        or not isinstance(part.get("text"), str)):
                    raise bad_request(f"input[{i}].content[{j}]: only text and input_image parts are supported",
                                      "input")
                parts.append({"type": "text", "text": part["text"]})
            content = parts
        if not isinstance(content, str | list):
            raise bad_request(f"input[{i}]: content must be a string or a list of text and image parts", "input")
        messages.append({"role": role, "content": content})
    if not messages:
        raise bad_request("input has no messages", "input")
    return messages


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"json_schema\", \"name\": ..., "
                          "\"schema\": {...}}", "text")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format of type json_schema needs a schema (a JSON object)", "text")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("text.format of type json_schema needs a name (a string)", "text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                      "text")


#: chat fields named in errors -> the Responses API's (the request a user sent)
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


_FIELD = re.compile(r"\b(" + "|".join(_PARAMS) + r")\b")
_QUOTED = re.compile(r"""((?<!\w)'[^']*'(?!\w)|"[^"]*")""")   # (an apostrophe inside a word opens no quote)


def _responses_wording(message: str) -> str:
    """A chat error's message with the chat request's field names as the Responses API's, outside quoted text (a
    schema's names or a pattern the user wrote stay as written)."""
    pieces = _QUOTED.split(message)   # odd items: the quoted spans
    return "".join(piece if i % 2 else _FIELD.sub(lambda m: _PARAMS[m.group(1)], piece)
                   for i, piece in enumerate(pieces))


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    for field, value, why in (("tools", req.tools, "tools are not supported on /v1/responses: use "
                                                    "/v1/chat/completions"),
                              ("previous_response_id", req.previous_response_id,
                               "responses are not stored: send the whole conversation as input"),
                              ("conversation", req.conversation,
                               "conversations are not stored: send the whole conversation as input"),
                              ("prompt", req.prompt, "stored prompt templates are not supported: send the "
                                                     "instructions and input themselves"),
                              ("background", req.background, "background responses are not supported"),
                              ("top_logprobs", req.top_logprobs, "logprobs are not supported on /v1/responses: use "
                                                                 "/v1/chat/completions"),
                              ("include", "message.output_text.logprobs" in (req.include or ()),
                               "message.output_text.logprobs is not supported on /v1/responses: use "
                               "/v1/chat/completions")):
        if value:
            raise bad_request(why, field)
    if req.tool_choice not in (None, "none", "auto"):   # a call demanded, but no tool can be given
        raise bad_request(f"tool_choice {req.tool_choice!r} needs tools, which /v1/responses does not take: use "
                          "/v1/chat/completions", "tool_choice")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "max_tokens": req.max_output_tokens,
                            **{k: getattr(req, k) for k in ResponsesRequest.CHAT_FIELDS}}
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    if req.reasoning is not None:   # {"effort": "low", "summary": ...}: the effort reaches the chat template
        effort = req.reasoning.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                              "reasoning")
        body["reasoning_effort"] = effort
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


#: the error of a response whose request the engine aborted (at shut-down)
CANCELLED = "the request was cancelled"


class _Body:
    """The response object as it grows (the same fields in every event and in the final answer)."""

    def __init__(self, req: ResponsesRequest, model: str, num_prompt: int):
        self.id = random_id("resp")
        self.item_id = random_id("msg")
        self.reasoning_id = random_id("rs")
        self.created = int(time.time())
        self.req, self.model, self.num_prompt = req, model, num_prompt

    @staticmethod
    def status_of(final: RequestOutput | None, failed: bool = False) -> str:
        """``completed``, ``incomplete`` (the output limit), ``cancelled`` (aborted) or ``failed``."""
        if failed or (final is not None and final.error):
            return "failed"
        reason = str(final.outputs[0].finish_reason) if final is not None else "abort"
        return {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")

    def reasoning(self, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        """The thinking (with a reasoning parser) as a reasoning output item."""
        return {"type": "reasoning", "id": item_id or self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item (no content part yet while it is only announced)."""
        parts = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                      "logprobs": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": parts}

    def response(self, status: str, output: list[dict[str, Any]],
                 final: RequestOutput | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "metadata": req.metadata or {},
            "parallel_tool_calls": bool(req.parallel_tool_calls) if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice or "auto", "tools": [], "text": req.text or {"format": {"type": "text"}},
            "incomplete_details": None, "error": None, "usage": None, "user": req.user, "store": False,
            "previous_response_id": None, "truncation": req.truncation or "disabled",
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if final is not None:
            c = final.outputs[0]
            out_tokens = len(c.token_ids)
            body["usage"] = {"input_tokens": self.num_prompt,
                             "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                             "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                             "total_tokens": self.num_prompt + out_tokens}
        return body


#: request fields the response repeats as they came
_ECHOED = ("instructions", "metadata", "user", "text", "truncation", "tool_choice")
#: the values OpenAI's response object holds for the echoed ``truncation`` and ``text.verbosity``
TRUNCATIONS = ("auto", "disabled")
VERBOSITIES = ("low", "medium", "high")


def _check_echoed(req: ResponsesRequest) -> None:
    """Refuse echoed fields that cannot be written back as UTF-8 (JSON allows a lone UTF-16 surrogate
    escape) or as standard JSON (``NaN``, ``Infinity``), or whose values a client's response model would
    refuse (``truncation``, ``text.verbosity``)."""
    for name in _ECHOED:
        value = getattr(req, name, None)
        if value is None:
            continue
        try:
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
        except UnicodeEncodeError:
            raise bad_request(f"{name} holds text that is not valid Unicode (a lone UTF-16 surrogate)", name) from None
        except ValueError:
            raise bad_request(f"{name} holds a number JSON cannot carry (NaN or Infinity)", name) from None
    if req.truncation is not None and req.truncation not in TRUNCATIONS:
        raise bad_request(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {req.truncation!r}", "truncation")
    verbosity = (req.text or {}).get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise bad_request(f"text.verbosity must be one of {', '.join(VERBOSITIES)}, got {verbosity!r}", "text")


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request) -> Response:
    ctx.note_ignored_fields(req)
    _check_echoed(req)
    chat = _chat_request(req)
    try:
        prep = await prepare_chat(ctx, chat, note_ignored=False, route="/v1/responses")
    except APIError as exc:   # name the Responses API's fields, not the chat request's
        param = _PARAMS.get(exc.param or "", exc.param)
        raise APIError(exc.status, _responses_wording(exc.message), exc.type, param, exc.code, exc.headers) from None
    body = _Body(req, ctx.reply_model(prep.lora), prep.prompt_len)
    started = await unless_disconnected(raw, start(ctx, [(body.id, prep.ids, prep.params)], req.priority, prep.lora,
                                                     cache_salt=req.cache_salt,
                                                     multi_modal_data=prep.multi_modal_data))
    events = merge(started)
    if req.stream:
        return SSEResponse(_events(ctx, body, events, prep.params.skip_special_tokens), named_events=True,
                           on_close=events.aclose)
    final = await finish(raw, events, _last(events))
    reply = _Reply(None, ctx.reasoning_parser)
    reply.update(final.outputs[0].text, final=True)
    text = reply.message().content or ""
    status = body.status_of(final)
    # the items the stream gives: the thinking before the answer, the answer, thinking written after it (gpt-oss
    # may think again); the last one the model wrote is cut short with the response
    first = _thinking_before_answer(ctx, final.outputs[0].text) if text else reply.thinking
    # (its own item: without the line break that parts it from the earlier thinking in a chat reply)
    late = reply.thinking[len(first):].removeprefix("\n") if reply.thinking.startswith(first) else ""
    first = first if late else reply.thinking
    items = [body.reasoning(first, "completed" if text else _item_status(status))] if first else []
    items.append(body.message(text, _item_status(status)))
    if late:
        items.append(body.reasoning(late, _item_status(status), random_id("rs")))
    out = body.response(status, items, final, await _reasoning_tokens(ctx, final, prep.params.skip_special_tokens))
    if status in ("failed", "cancelled"):   # as the stream's response.failed says it
        out["error"] = {"code": "server_error", "message": final.error or CANCELLED}
    return JSONResponse(out)


def _thinking_before_answer(ctx: ServerContext, text: str) -> str:
    """The thinking a reply wrote before its answer's first character (``text``: the whole reply, which has an
    answer): the reasoning of the shortest prefix that already holds answer text (as the message has it: without
    the calls the reasoning parser leaves in their markup)."""
    parser = ctx.reasoning_parser
    if parser is None:
        return ""
    hi = _first_holding(len(text), lambda m: bool(_Reply(None, parser).update(text[:m], False)[1].strip()))
    hi = min(hi, len(text))
    return parser().scan(text[:hi], hi == len(text)).reasoning


def _first_holding(n: int, holds: Callable[[int], bool]) -> int:
    """The smallest m in [1, n] for which ``holds`` (false, then true, as m grows), else n + 1: a binary search."""
    lo, hi = 0, n + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        hi, lo = (mid, lo) if holds(mid) else (hi, mid)
    return hi


async def _reasoning_tokens(ctx: ServerContext, final: RequestOutput, skip_special: bool) -> int:
    """The output tokens that wrote thinking (markers included; with a reasoning parser): those before the first
    one whose text holds answer, and those after the answer where the model thought again (gpt-oss). Found by
    binary searches over the decoded prefixes of the output, in a worker thread."""
    parser = ctx.reasoning_parser
    ids = list(final.outputs[0].token_ids)
    if parser is None or not ids:
        return 0
    tokenizer = ctx.front.tokenizer

    def count() -> int:
        @functools.cache   # the searches below meet the same prefixes
        def text(m: int) -> str:
            return tokenizer.decode(ids[:m], skip_special_tokens=skip_special)

        def first(holds: Callable[[int], bool]) -> int:
            return _first_holding(len(ids), holds)

        whole = text(len(ids))
        thought = parser().scan(whole, True).reasoning
        if not thought and parser.START not in whole and parser.END not in whole:
            return 0   # no thinking (white space before the answer, or an empty reply, is none)
        written = first(lambda m: len(text(m)) >= len(whole))   # the tokens that wrote the text (not a final EOS)
        answer = first(lambda m: bool(parser().scan(text(m), False).content.strip()))
        if answer > written:
            return written   # all thinking
        before = parser().scan(text(answer), False).reasoning
        thinking = answer - 1
        if len(thought) > len(before):   # thought again after the answer: until the answer goes on (or the end)
            def reasoning(m: int) -> int:
                return len(parser().scan(text(m), False).reasoning)

            def content(m: int) -> int:
                return len(parser().scan(text(m), False).content)

            start = first(lambda m: reasoning(m) > len(before))
            done = first(lambda m: reasoning(m) >= len(thought))
            shown = content(done)
            resumed = first(lambda m: m > done and content(m) > shown)
            thinking += min(resumed, written + 1) - start
        return thinking

    return await asyncio.to_thread(count)


def _item_status(status: str) -> str:
    """The output message's status for the response's."""
    return "completed" if status == "completed" else "incomplete"


async def _events(ctx: ServerContext, body: _Body, events: AsyncIterator[tuple[int, RequestOutput]],
                  skip_special: bool) -> AsyncIterator[str]:
    """The Responses API's stream: ``event: <type>`` lines with the JSON event (each with its ``sequence_number``)."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return json.dumps(data, ensure_ascii=False)

    yield event("response.created", response=body.response("in_progress", []))
    yield event("response.in_progress", response=body.response("in_progress", []))
    reply = _Reply(None, ctx.reasoning_parser)
    items: list[dict[str, Any]] = []     # output items finished
    thinking: int | None = None          # the reasoning item's output index while it is open
    message: int | None = None           # the message's output index once it is announced
    text, final, failure = "", None, None

    sent_thinking = 0   # characters of the thinking sent in the reasoning item, once it is closed
    shown = ""          # the thinking sent in the reasoning item

    def close_thinking(state: str = "completed") -> Iterator[str]:
        nonlocal thinking, sent_thinking
        sent_thinking = len(shown)
        if thinking is None:
            return
        yield event("response.reasoning_text.done", item_id=body.reasoning_id, output_index=thinking,
                    content_index=0, text=shown)
        item = body.reasoning(shown, state)
        yield event("response.output_item.done", output_index=thinking, item=item)
        items.append(item)
        thinking = None

    def open_message(thinking_state: str = "completed") -> Iterator[str]:
        nonlocal message
        yield from close_thinking(thinking_state)
        message = len(items)
        yield event("response.output_item.added", output_index=message, item=body.message("", "in_progress"))
        yield event("response.content_part.added", item_id=body.item_id, output_index=message, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    try:
        async for _, out in events:
            final = out
            c = out.outputs[0]
            thought, delta, _ = reply.update(c.text, final=c.finish_reason is not None)
            if thought and delta and message is None:
                # the answer began within this output, and thinking came with it (outputs merged while the client
                # lagged; several tokens a step): only what was thought before the answer goes in this item, the
                # rest in one after the message, as the reply without streaming has it
                early = _thinking_before_answer(ctx, c.text)
                thought = early[len(shown):] if early.startswith(shown) else ""
            if thought and message is None:
                if thinking is None:
                    thinking = len(items)
                    yield event("response.output_item.added", output_index=thinking,
                                item=body.reasoning("", "in_progress"))
                shown += thought
                yield event("response.reasoning_text.delta", item_id=body.reasoning_id, output_index=thinking,
                            content_index=0, delta=thought)
            if delta:
                if message is None:
                    for e in open_message():
                        yield e
                text += delta
                yield event("response.output_text.delta", item_id=body.item_id, output_index=message,
                            content_index=0, delta=delta, logprobs=[])
    except Exception as exc:  # noqa: BLE001 - reported in the stream: the API's error event, then response.failed
        error = to_api_error(exc)   # a message fit for the client (an unexpected one is logged, not sent)
        failure = error.message
        yield event("error", code=error.code or error.type, message=failure, param=error.param,
                    error={"type": error.type, "code": error.code, "message": failure, "param": error.param})
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    status = body.status_of(final, failed=failure is not None)
    if message is None:   # every response has its message, if empty; thinking that never reached it ends with the reply
        for e in open_message(_item_status(status)):
            yield e
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield event("response.output_text.done", item_id=body.item_id, output_index=message, content_index=0, text=text,
                logprobs=[])
    yield event("response.content_part.done", item_id=body.item_id, output_index=message, content_index=0, part=part)
    item = body.message(text, _item_status(status))
    yield event("response.output_item.done", output_index=message, item=item)
    items.append(item)   # at its output index: nothing else was added after it opened
    late = reply.thinking[sent_thinking:].removeprefix("\n")
    if late:   # thinking written after the answer began (gpt-oss may think again): a reasoning item after it
        late_id, index = random_id("rs"), len(items)
        yield event("response.output_item.added", output_index=index, item=body.reasoning("", "in_progress", late_id))
        yield event("response.reasoning_text.delta", item_id=late_id, output_index=index, content_index=0, delta=late)
        yield event("response.reasoning_text.done", item_id=late_id, output_index=index, content_index=0, text=late)
        items.append(body.reasoning(late, _item_status(status), late_id))
        yield event("response.output_item.done", output_index=index, item=items[-1])
    done = body.response(status, items, final,
                         await _reasoning_tokens(ctx, final, skip_special) if final is not None else 0)
    if status in ("failed", "cancelled"):
        done["error"] = {"code": "server_error", "message": failure or (final.error if final else None)
                         or CANCELLED}
        yield event("response.failed", response=done)
    else:
        yield event(f"response.{status}", response=done)
