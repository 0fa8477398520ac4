"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, as vLLM's server offers it.

``/tokenize`` takes a ``prompt`` (special tokens added by default, as a completion's prompt is) or chat
``messages`` (rendered with the chat template, which writes the special tokens itself) and returns the ids,
their count and the model's context length; ``/detokenize`` turns ids back into text. Both follow the
completion routes' checks: the text bound before tokenizing, ids inside the vocabulary.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from plinth.core.request import SamplingParamsError
from plinth.core.scheduler import RequestRejectedError
from plinth.entrypoints.openai.errors import bad_request
from plinth.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from plinth.entrypoints.openai.serving import ServerContext
from plinth.entrypoints.openai.serving_chat import load_images, media_data, processed_media, render_messages
from plinth.entrypoints.openai.tools import tool_mode


async def tokenize(ctx: ServerContext, req: TokenizeRequest) -> Response:
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt" if req.prompt is None else "messages")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        try:
            mode = tool_mode(req.tools, "none", None, None)   # the tools as the template sees them
        except SamplingParamsError as exc:
            raise bad_request(str(exc), exc.param) from None
        images: list[Any] = []   # (a model with image inputs: the ids show each image's widened positions)
        text = render_messages(ctx, req, mode.tools if mode else None, images, await load_images(ctx, req))
        special, param = bool(req.add_special_tokens), "messages"
    else:
        assert req.prompt is not None
        text, special, param = req.prompt, req.add_special_tokens is not False, "prompt"
    ids = await ctx.tokenize(text, add_special_tokens=special, param=param)
    if req.messages is not None and images:
        support = ctx.front.images
        if req.mm_processor_kwargs:   # (the images processed with the request's settings)
            ids, _ = await processed_media(support, ids, media_data(images), req.mm_processor_kwargs)
        else:
            try:
                ids = support.laid_out(ids, images)
            except RequestRejectedError as exc:
                raise bad_request(str(exc), "messages") from None
    strs = None
    if req.return_token_strs:   # the vocabulary's own strings of the tokens, as vLLM gives them
        tok = ctx.front.tokenizer
        strs = [str(s) for s in tok.convert_ids_to_tokens(ids)] if tok is not None else [str(t) for t in ids]
    body = TokenizeResponse(count=len(ids), max_model_len=ctx.front.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(body.model_dump(exclude_none=True))


async def detokenize(ctx: ServerContext, req: DetokenizeRequest) -> Response:
    ctx.check_model(req.model)
    limit = ctx.front.max_model_len
    if len(req.tokens) > limit:
        raise bad_request(f"at most {limit} token ids (the model's context), got {len(req.tokens)}", "tokens")
    ctx.check_token_ids(req.tokens, "tokens")
    tokenizer = ctx.front.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
