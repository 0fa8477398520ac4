"""``POST /v1/chat/completions``: messages rendered with the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jinja2
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.request import PositionLogprobs, RequestOutput
from plinth.entrypoints.openai.errors import bad_request
from plinth.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from plinth.entrypoints.openai.serving import (
    ServerContext,
    check_structured,
    first_outputs,
    merge,
    sampling_params,
)
from plinth.entrypoints.openai.streaming import SSEResponse, unless_disconnected


def chat_messages(items: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them (text parts joined)."""
    messages = []
    for i, m in enumerate(items):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            parts = []
            for part in m.content:
                if part.type != "text":
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                                      "messages")
                if part.text is None:
                    raise bad_request(f"messages[{i}]: a text content part needs its 'text'", "messages")
                parts.append(part.text)
            content = "".join(parts)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    return messages


def _logprobs(ctx: ServerContext, token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
              k: int) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions, strict=True):
        text = ctx.token_text(tid)
        top = [TopLogprob(token=ctx.token_text(t), logprob=lp, bytes=list(ctx.token_bytes(t)))
               for t, lp in ctx.top_logprobs(pos, k)]
        chosen = pos.get(tid)
        content.append(TokenLogprob(token=text, logprob=chosen.logprob if chosen is not None else float("nan"),
                                    bytes=list(ctx.token_bytes(tid)), top_logprobs=top))
    return ChatLogprobs(content=content)


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _last(events: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    last = None
    async for _, out in events:
        last = out
    assert last is not None
    return last


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if (problem := req.unsupported()) is not None:
        raise bad_request(problem[1], problem[0])
    messages = chat_messages(req.messages)
    ctx.check_text(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)), "messages")
    try:
        text = ctx.front.render_chat(messages, add_generation_prompt=req.add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as exc:
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(lambda: req.sampling_params(max_tokens, k),
                             renames={"max_tokens": max_param, "logprobs": "top_logprobs"})
    await check_structured(ctx, req, params)
    # The template writes the special tokens itself, so none are added here.
    ids = await ctx.tokenize(text, add_special_tokens=False, param="messages")
    ctx.check_length(len(ids), max_tokens, "messages", max_param, min_tokens=req.min_tokens or 0)
    rid = random_id("chatcmpl")
    stream = ctx.generate(rid, ids, params)
    firsts = await unless_disconnected(raw, first_outputs([stream]))
    events = merge([stream], firsts)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(ctx, rid, params.n, k, events, include_usage))
    final = await unless_disconnected(raw, _last(events))
    choices = []
    for c in final.outputs:
        n = len(c.token_ids)
        lp = _logprobs(ctx, c.token_ids, (c.logprobs or [])[:n], k) if k is not None else None
        choices.append(ChatChoice(index=c.index, message=ResponseMessage(content=c.text), logprobs=lp,
                                  finish_reason=str(c.finish_reason) if c.finish_reason else None,
                                  stop_reason=c.stop_reason))
    body = ChatCompletionResponse(id=rid, model=ctx.model_name, choices=choices, usage=_usage(final))
    return JSONResponse(body.model_dump())


async def _stream(ctx: ServerContext, rid: str, n: int, k: int | None,
                  events: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                   choices=[choice] if choice is not None else [], usage=usage).model_dump_json()

    for index in range(n):
        yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
    sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
    last: RequestOutput | None = None
    try:
        async for _, out in events:
            last = out
            for c in out.outputs:
                i = c.index
                if done[i]:
                    continue
                end = len(c.token_ids)
                delta = c.text[sent_chars[i]:]
                lp = None
                if k is not None and end > sent_tokens[i]:
                    lp = _logprobs(ctx, c.token_ids[sent_tokens[i]:end], (c.logprobs or [])[sent_tokens[i]:end], k)
                if delta or lp is not None:
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(content=delta), logprobs=lp))
                sent_chars[i], sent_tokens[i] = len(c.text), end
                if c.finish_reason is not None:
                    done[i] = True
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=str(c.finish_reason)))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if include_usage and last is not None:
        yield chunk(None, _usage(last))
