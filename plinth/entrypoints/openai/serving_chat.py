"""``POST /v1/chat/completions``: messages rendered with the model's chat template; tool calls
(:mod:`plinth.entrypoints.openai.tools`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import jinja2
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.engine import RESERVED_TEMPLATE_KWARGS, TextParts
from plinth.core.request import PositionLogprobs, RequestOutput, SamplingParams, SamplingParamsError
from plinth.core.scheduler import RequestRejectedError
from plinth.core.structured import StructuredOutputError, grammar_of
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
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from plinth.entrypoints.openai.reasoning_parsers import ReasoningParser
from plinth.entrypoints.openai.serving import (
    ServerContext,
    beam_search_params,
    check_structured,
    finish,
    json_logprob,
    merge,
    sampling_params,
    start,
)
from plinth.entrypoints.openai.streaming import SSEResponse, unless_disconnected
from plinth.entrypoints.openai.tools import (
    ToolCallTracker,
    ToolMode,
    compact_schema,
    parameters,
    template_messages,
    tool_mode,
)
from plinth.lora.request import LoRARequest
from plinth.multimodal.images import ImageParts, image_from_url, media_pool


def chat_messages(items: Sequence[ChatMessage], images: ImageParts | None = None) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them (text parts joined by line breaks, kept for templates
    that loop over them: :class:`~plinth.core.engine.TextParts`). ``images``: where a model with image inputs
    collects the ``image_url`` parts' images, in order (without it such parts are refused)."""
    messages = []
    for i, m in enumerate(items):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            parts = []
            for part in m.content:
                if part.type == "refusal" and m.role == "assistant":   # an earlier reply's refusal, as text
                    if part.refusal is None:
                        raise bad_request(f"messages[{i}]: a refusal content part needs its 'refusal'", "messages")
                    parts.append(part.refusal)
                    continue
                if part.type in ("image_url", "video_url"):
                    image = part.type == "image_url"
                    if images is None:
                        raise bad_request(f"messages[{i}]: this model takes no {'images' if image else 'videos'} "
                                          f"({'an' if image else 'a'} {part.type} content part); serve an "
                                          "image-and-text model", "messages")
                    add = images.add if image else images.add_video
                    try:
                        parts.append(add(getattr(part, part.type), f"messages[{i}] {part.type}"))
                    except RequestRejectedError as exc:
                        raise bad_request(str(exc), "messages") from None
                    continue
                if part.type != "text":
                    raise bad_request(f"messages[{i}]: only text, image_url and video_url content parts are "
                                      f"supported, got {part.type!r}", "messages")
                if part.text is None:
                    raise bad_request(f"messages[{i}]: a text content part needs its 'text'", "messages")
                parts.append(part.text)
            content = TextParts(parts)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_checked_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thinking is not None and m.role == "assistant":   # under both names templates read it by
            msg["reasoning_content"] = msg["reasoning"] = thinking
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                              "messages")
        messages.append(msg)
    return messages


def _checked_call(call: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """One of an assistant message's earlier tool calls, checked for OpenAI's shape."""
    fn = call.get("function")
    if not isinstance(call.get("id"), str) or call.get("type", "function") != "function" or not isinstance(
            fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str | dict):
        raise bad_request(f"messages[{i}].tool_calls[{j}]: a tool call is {{\"id\", \"type\": \"function\", "
                          f"\"function\": {{\"name\", \"arguments\"}}}}", "messages")
    return call


class _Reply:
    """One choice's reply as its text grows: the thinking (with a reasoning parser), the content and the
    tool calls (found in the content only). :meth:`update` takes the whole text so far and returns what is
    new: ``(thinking, content, tool-call deltas)``."""

    def __init__(self, mode: ToolMode | None, reasoning: type[ReasoningParser] | None, include_reasoning: bool = True):
        self.reasoning = reasoning() if reasoning is not None else None
        self.tools = ToolCallTracker(mode, reasoning.call_parser if reasoning is not None else None)
        self.thinking = ""
        self.include_reasoning = include_reasoning   # vLLM's include_reasoning: false drops the thinking from replies

    def update(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        thinking = ""
        if self.reasoning is not None:
            split = self.reasoning.scan(text, final)
            if split.reasoning.startswith(self.thinking):
                thinking = split.reasoning[len(self.thinking):]
            self.thinking, text = split.reasoning, split.content
        content, calls = self.tools.update(text, final)
        return (thinking if self.include_reasoning else ""), content, calls

    def message(self, role: str = "assistant") -> ResponseMessage:
        content = self.tools.content
        if self.reasoning is not None and content == "":   # all thinking (cut short): no answer, null as in vLLM
            content = None
        return ResponseMessage(role=role, content=content, tool_calls=self.tools.message_calls(),
                               reasoning_content=(self.thinking if self.include_reasoning else None) or None)


async def _check_tool_schemas(mode: ToolMode | None) -> None:
    """Compile the schema of each tool a constrained call may use, in a worker thread: one that does not
    compile is a 400 naming ``tools`` and the tool."""
    if mode is None or not mode.constrained:
        return

    def compile_all() -> None:
        for i, tool in enumerate(mode.tools):
            name = tool["function"]["name"]
            if mode.kind == "function" and name != mode.function:
                continue
            try:
                grammar_of({"json": compact_schema(parameters(tool))})
            except StructuredOutputError as exc:
                raise bad_request(f"tools[{i}] ({name}): {exc}", "tools") from None

    await asyncio.to_thread(compile_all)


def _tool_mode(ctx: ServerContext, req: ChatCompletionRequest) -> ToolMode | None:
    try:
        return tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_parser)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None


async def load_images(ctx: ServerContext, req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The images of the messages' ``image_url`` parts (and videos of ``video_url`` parts), by URL: decoded (data
    URLs), read (``file://``) or fetched (``http(s)://``) in worker threads, off the event loop, once their number is
    checked against ``--limit-mm-per-prompt`` (``None``: a model without image inputs, or no such parts). A refused
    URL or an unreadable image or video is a 400 naming ``messages``."""
    support = getattr(ctx.front, "images", None)
    if support is None:
        return None
    import functools

    from plinth.multimodal.video import video_from_url

    # (a video file's frames as the model's processor picks them)
    video_from_url = functools.partial(video_from_url, sample=support.video_sampler)
    found: dict[Any, tuple[str, Any]] = {}
    counts = {"image_url": 0, "video_url": 0}
    for i, m in enumerate(req.messages):
        for part in m.content if isinstance(m.content, list) else ():
            if part.type in counts:
                counts[part.type] += 1
                value = getattr(part, part.type)
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):   # (a video by ("video", url): the same URL may name an image too)
                    found.setdefault(url if part.type == "image_url" else ("video", url),
                                     (f"messages[{i}] {part.type}",
                                      image_from_url if part.type == "image_url" else video_from_url))
    if counts["image_url"] > support.limit:
        raise bad_request(f"messages: {counts['image_url']} images, at most {support.limit} a prompt "
                          "(--limit-mm-per-prompt)", "messages")
    if counts["video_url"] and support.video_placeholder is None:
        raise bad_request("messages: this model takes no videos (a video_url content part)", "messages")
    if counts["video_url"] > support.video_limit:
        raise bad_request(f"messages: {counts['video_url']} videos, at most {support.video_limit} a prompt "
                          "(--limit-mm-per-prompt)", "messages")
    if not found:
        return None
    loop = asyncio.get_running_loop()
    try:
        images = await asyncio.gather(*(loop.run_in_executor(media_pool(), read, url if isinstance(url, str) else url[1],
                                                             where, support.policy)
                                        for url, (where, read) in found.items()))
    except RequestRejectedError as exc:
        raise bad_request(str(exc), "messages") from None
    return dict(zip(found, images, strict=True))


def render_messages(ctx: ServerContext, req: ChatCompletionRequest | Any, tools: list[dict[str, Any]] | None,
                    images: list[Any] | None = None, loaded: dict[str, Any] | None = None) -> str:
    """The conversation of a chat or tokenize request as the chat template renders it (with the tools'
    definitions, ``continue_final_message`` and ``chat_template_kwargs``); a template error is a 400 naming
    ``messages``. ``images``: receives the images of the messages' ``image_url`` parts, in order (a model with
    image inputs; without it the parts are rendered and their images not read); ``loaded``: the images
    :func:`load_images` loaded."""
    support = getattr(ctx.front, "images", None)
    collected = support.parts(loaded, load=images is not None) if support is not None else None
    messages = chat_messages(req.messages, collected)
    if images is not None and collected is not None:
        images.extend(collected.images)
        images.extend(collected.videos)   # (after the images: told apart by their type)
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted((RESERVED_TEMPLATE_KWARGS | {"documents"}) & set(kwargs))   # documents: a request field
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (request fields of their own)",
                          "chat_template_kwargs")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message continues the last message, so add_generation_prompt must be "
                          "false", "continue_final_message")
    documents = getattr(req, "documents", None)
    if documents:
        kwargs = {**kwargs, "documents": documents}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None and "reasoning_effort" not in kwargs:   # chat_template_kwargs says it more precisely
        kwargs = {**kwargs, "reasoning_effort": effort}
    ctx.check_text(_message_chars(messages, tools) + (len(json.dumps(kwargs)) if kwargs else 0), "messages",
                   getattr(req, "truncate_prompt_tokens", None) is not None)
    try:
        return ctx.front.render_chat(template_messages(messages), add_generation_prompt=req.add_generation_prompt,
                                     tools=tools, continue_final_message=req.continue_final_message,
                                     template_kwargs=kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc


def _message_chars(messages: list[dict[str, Any]], tools: list[Any] | None) -> int:
    """Characters the template will render: contents, earlier calls and the tools' definitions."""
    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
    return chars + (len(json.dumps(tools)) if tools else 0)


def _logprobs(ctx: ServerContext, token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
              k: int, name: Callable[[int], str]) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions, strict=True):
        text = name(tid)
        top = [TopLogprob(token=name(t), logprob=lp, bytes=list(ctx.token_bytes(t)))
               for t, lp in ctx.top_logprobs(pos, k)]
        chosen = pos.get(tid)
        content.append(TokenLogprob(token=text, logprob=json_logprob(chosen.logprob) if chosen is not None else float("nan"),
                                    bytes=list(ctx.token_bytes(tid)), top_logprobs=top))
    return ChatLogprobs(content=content)


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


async def _last(events: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    last = None
    async for _, out in events:
        last = out
    assert last is not None
    return last


def _reply_role(ctx: ServerContext, req: ChatCompletionRequest) -> str:
    """The role of the reply (vLLM's rule): ``--response-role`` (``assistant``) with ``add_generation_prompt``, the
    last message's own without (the reply continues it)."""
    return ctx.response_role if req.add_generation_prompt else req.messages[-1].role


def _echoed(ctx: ServerContext, req: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the reply (vLLM's rule): the last message's text when it has the reply's role."""
    if not req.echo:
        return ""
    support = getattr(ctx.front, "images", None)   # (an image part echoes as the image token)
    last = chat_messages(req.messages[-1:], support.parts(load=False) if support else None)[0]
    return last["content"] if last["role"] == _reply_role(ctx, req) else ""


@dataclasses.dataclass
class PreparedChat:
    """A chat request checked and turned into the engine's terms (shared with the Responses API's route)."""

    lora: LoRARequest | None
    mode: ToolMode | None
    params: SamplingParams
    ids: list[int]
    max_tokens: int | None
    max_param: str
    k: int | None
    #: the messages' images (a model with image inputs): a ``multi_modal_data`` dict, or its images processed already
    #: (with the request's ``mm_processor_kwargs``)
    multi_modal_data: Any = None
    prompt_len: int = 0   # the prompt's positions (each image's token widened)


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest, note_ignored: bool = True,
                       route: str = "/v1/chat/completions") -> PreparedChat:
    """Check a chat request (model, task, fields, tools, structured outputs, length) and render, tokenize it
    (``route``: the route asked, named where the server's model does not generate text).

    Raises:
        APIError: what is wrong with the request (400, or 404 for an unknown model).
    """
    lora = ctx.check_model(req.model)
    ctx.check_task("generate", route)
    if note_ignored:
        ctx.note_ignored_fields(req)
    if (problem := req.unsupported()) is not None:
        raise bad_request(problem[1], problem[0])
    mode = _tool_mode(ctx, req)
    images: list[Any] = []
    text = render_messages(ctx, req, mode.tools if mode is not None else None, images, await load_images(ctx, req))
    if images and req.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    if images and req.use_beam_search:
        raise bad_request("beam search does not take image inputs", "use_beam_search")
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    defaults = ctx.default_sampling
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(lambda: req.sampling_params(max_tokens, k, req.prompt_logprobs, defaults=defaults),
                             renames={"max_tokens": max_param, "logprobs": "top_logprobs"},
                             max_logprobs=ctx.front.max_logprobs)
    if ((mode is not None and mode.kind == "auto" and mode.parser is not None and mode.parser.keeps_special_tokens)
            or (ctx.reasoning_parser is not None and ctx.reasoning_parser.keeps_special_tokens)):
        params = dataclasses.replace(params, skip_special_tokens=False)
    await _check_tool_schemas(mode)
    await check_structured(ctx, req, params)
    # The template writes the special tokens itself, so none are added unless asked for.
    ids = ctx.truncated(await ctx.tokenize(text, add_special_tokens=bool(req.add_special_tokens), param="messages",
                                           truncating=req.truncate_prompt_tokens is not None), req)
    if not ids:
        raise bad_request("the chat template rendered these messages as an empty prompt; at least one token is "
                          "needed", "messages")
    support = getattr(ctx.front, "images", None)
    from plinth.multimodal.video import Video

    videos = [item for item in images if isinstance(item, Video)]
    images = [item for item in images if not isinstance(item, Video)]
    if support is not None and not images and support.token_id in ids:
        raise bad_request(f"the rendered prompt has the image token (id {support.token_id}) but the messages have "
                          "no image: send images as image_url parts", "messages")
    if support is not None and not videos and support.video_token_id is not None and support.video_token_id in ids:
        raise bad_request(f"the rendered prompt has the video token ({support.video_placeholder!r}) but the messages "
                          "have no video: send videos as video_url parts", "messages")
    length = len(ids)
    data: Any = media_data(images + videos)
    if data and req.mm_processor_kwargs:   # (the images processed here with the request's settings)
        ids_laid, data = await processed_media(support, ids, data, req.mm_processor_kwargs)
        length = len(ids_laid)
    elif data:   # the prompt as the engine lays it out: each image's (video's) positions, without pixels
        try:
            length = len(support.laid_out(ids, images + videos))
        except RequestRejectedError as exc:
            raise bad_request(str(exc), "messages") from None
    ctx.check_length(length, max_tokens, "messages", max_param, min_tokens=req.min_tokens or 0)
    return PreparedChat(lora, mode, params, ids, max_tokens, max_param, k, data or None, length)


def media_data(media: Sequence[Any]) -> dict[str, list[Any]]:
    """A conversation's images and videos (each kind in the order given) as ``multi_modal_data``."""
    from plinth.multimodal.video import Video

    kinds = (("image", [m for m in media if not isinstance(m, Video)]),
             ("video", [m for m in media if isinstance(m, Video)]))
    return {kind: items for kind, items in kinds if items}


async def processed_media(support: Any, ids: list[int], data: dict[str, Any],
                          settings: Any) -> tuple[list[int], Any]:
    """A chat request's images (and videos) through the image processor with the request's own
    ``mm_processor_kwargs`` (on the media threads), and the prompt as the engine lays it out with them.

    Raises:
        APIError: 400, settings the processor does not take (naming ``mm_processor_kwargs``) or media it refuses.
    """
    from plinth.multimodal.images import media_pool

    try:
        prepared = await asyncio.get_running_loop().run_in_executor(media_pool(), support.prepare, data, settings)
        return support.items(ids, prepared)[0], prepared
    except RequestRejectedError as exc:
        raise bad_request(str(exc), exc.param if exc.param == "mm_processor_kwargs" else "messages") from None


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    created = int(time.time())   # when the request arrived (a stream stamps its chunks when it starts)
    prep = await prepare_chat(ctx, req)
    lora, mode, params, ids, max_tokens, max_param, k = (prep.lora, prep.mode, prep.params, prep.ids, prep.max_tokens,
                                                        prep.max_param, prep.k)
    rid = random_id("chatcmpl")
    if req.use_beam_search:
        beam = beam_search_params(req, max_tokens, max_param, ctx.default_room(len(ids)), ctx.front.max_logprobs)
        out = (await unless_disconnected(raw, ctx.beam_search(rid, [ids], beam, lora, req.priority, req.cache_salt)))[0]
        choices = []
        keeps = ctx.reasoning_parser is not None and ctx.reasoning_parser.keeps_special_tokens
        for j, b in enumerate(out.sequences):
            reply = _Reply(None, ctx.reasoning_parser, req.include_reasoning)
            # a parser whose markers are special tokens reads the beam's text with them (not the ending EOS's)
            ended = b.finish_reason == "stop" and b.token_ids and b.token_ids[-1] in ctx.front.eos_token_ids
            reply.update(ctx.front.tokenizer.decode(b.token_ids[:-1] if ended else b.token_ids,
                                                    skip_special_tokens=False) if keeps else b.text, final=True)
            message = reply.message(_reply_role(ctx, req))
            if _echoed(ctx, req):
                message.content = _echoed(ctx, req) + (message.content or "")
            choices.append(ChatChoice(index=j, message=message, finish_reason=b.finish_reason))
        completion = sum(len(b.token_ids) for b in out.sequences)
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion, total_tokens=len(ids) + completion,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
        return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=ctx.reply_model(lora), choices=choices,
                                                   usage=usage).model_dump())
    started = await unless_disconnected(raw, start(ctx, [(rid, ids, params)], req.priority, lora,
                                                     cache_salt=req.cache_salt,
                                                     multi_modal_data=prep.multi_modal_data))
    events = merge(started)
    if req.stream:
        options = req.stream_options
        usage = None
        if options is not None and options.include_usage:
            usage = "every" if options.continuous_usage_stats else "end"
        elif ctx.force_include_usage:
            usage = "end"
        return SSEResponse(_stream(ctx, rid, params.n, k, prep.prompt_len, events, usage, ctx.token_namer(req), mode,
                                   _echoed(ctx, req), ctx.reply_model(lora), req.include_reasoning, _reply_role(ctx, req)),
                            on_close=events.aclose)
    final = await finish(raw, events, _last(events))
    reply = functools.partial(_reply, ctx, req, rid, created, lora, mode, k, final)
    if k is None and req.prompt_logprobs is None:
        return reply()
    return await asyncio.to_thread(reply)   # large (n x tokens x top_logprobs): built off the event loop


def _reply(ctx: ServerContext, req: ChatCompletionRequest, rid: str, created: int, lora: LoRARequest | None,
           mode: Any, k: int | None, final: RequestOutput) -> Response:
    """The whole (not streamed) reply to a chat request, encoded."""
    choices = []
    name = ctx.token_namer(req)
    echoed, role = _echoed(ctx, req), _reply_role(ctx, req)
    for c in final.outputs:
        n = len(c.token_ids)
        lp = _logprobs(ctx, c.token_ids, (c.logprobs or [])[:n], k, name) if k is not None else None
        reply = _Reply(mode, ctx.reasoning_parser, req.include_reasoning)
        reply.update(c.text, final=True)
        reason = reply.tools.finish_reason(str(c.finish_reason) if c.finish_reason else None)
        message = reply.message(role)
        if echoed:
            message.content = echoed + (message.content or "")
        choices.append(ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=reason,
                                  stop_reason=c.stop_reason))
    prompt_logprobs = (ctx.prompt_logprobs(final, req.prompt_logprobs, name)
                       if req.prompt_logprobs is not None else None)
    body = ChatCompletionResponse(id=rid, created=created, model=ctx.reply_model(lora), choices=choices, usage=_usage(final),
                                  prompt_logprobs=prompt_logprobs)
    return JSONResponse(body.model_dump())


async def _stream(ctx: ServerContext, rid: str, n: int, k: int | None, num_prompt: int,
                  events: AsyncIterator[tuple[int, RequestOutput]], usage: str | None, name: Callable[[int], str],
                  mode: ToolMode | None = None, echoed: str = "", model: str = "",
                  include_reasoning: bool = True, role: str = "assistant") -> AsyncIterator[str]:
    """``usage``: ``"end"`` for a last chunk with the usage, ``"every"`` also for each chunk's choice's usage so
    far (vLLM's ``continuous_usage_stats``); ``echoed``: text each choice starts with (``echo``); ``model``: the
    chunks' model name."""
    created = int(time.time())

    def so_far(tokens: int) -> UsageInfo | None:
        if usage != "every":
            return None
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=tokens, total_tokens=num_prompt + tokens)

    def chunk(choice: ChatChunkChoice | None, counts: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(id=rid, created=created, model=model,
                                   choices=[choice] if choice is not None else [], usage=counts)
        # OpenAI's chunks carry "usage": null only when the usage was asked for (stream_options.include_usage)
        return body.model_dump_json(exclude={"usage"} if usage is None else None)

    for index in range(n):
        # a forced or required call's reply has no content (null, as in the non-streamed message)
        first = DeltaMessage(role=role, content=None if mode is not None and mode.constrained else "")
        yield chunk(ChatChunkChoice(index=index, delta=first), so_far(0))
        if echoed:
            yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(content=echoed)), so_far(0))
    sent_tokens, done = [0] * n, [False] * n
    replies = [_Reply(mode, ctx.reasoning_parser, include_reasoning) for _ in range(n)]
    last: RequestOutput | None = None
    try:
        async for _, out in events:
            last = out
            for c in out.outputs:
                i = c.index
                if done[i]:
                    continue
                end = len(c.token_ids)
                finished = c.finish_reason is not None
                thinking, delta, calls = replies[i].update(c.text, final=finished)
                lp = None
                if k is not None and end > sent_tokens[i]:
                    lp = _logprobs(ctx, c.token_ids[sent_tokens[i]:end], (c.logprobs or [])[sent_tokens[i]:end], k,
                                   name)
                if thinking or delta or calls or lp is not None:
                    piece = DeltaMessage(content=delta if delta or not (calls or thinking) else None,
                                         tool_calls=calls or None, reasoning_content=thinking or None)
                    yield chunk(ChatChunkChoice(index=i, delta=piece, logprobs=lp), so_far(end))
                sent_tokens[i] = end
                if finished:
                    done[i] = True
                    reason = replies[i].tools.finish_reason(str(c.finish_reason))
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=reason,
                                                stop_reason=c.stop_reason), so_far(end))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if usage is not None and last is not None:
        yield chunk(None, _usage(last))
