"""``POST /v1/embeddings``: OpenAI's embeddings route, for a server started with ``--task embed``."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams
from plinth.core.scheduler import RequestRejectedError
from plinth.entrypoints.openai.errors import APIError, bad_request
from plinth.entrypoints.openai.protocol import (
    ClassificationUsage,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    random_id,
)
from plinth.entrypoints.openai.serving import MAX_CHOICES, ServerContext, collect, finish, merge, start
from plinth.entrypoints.openai.streaming import unless_disconnected


async def request_inputs(ctx: ServerContext, req: Any) -> list[list[int]]:
    """The request's ``input`` (an embedding or classification request's) as token ids (texts tokenized, each
    truncated as asked and checked against the context), or its ``messages`` as the chat template renders them (one
    input)."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("give exactly one of 'input' and 'messages'", "input" if req.input is None else "messages")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        if getattr(ctx.front, "images", None) is not None:
            raise bad_request("a model with image inputs takes its pooling inputs as 'input' (texts or token ids), "
                              "not 'messages'", "messages")
        from plinth.entrypoints.openai.serving_chat import render_messages

        text = render_messages(ctx, req, None)
        return await token_lists(ctx, req, [text], "messages")
    raw = req.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    return await token_lists(ctx, req, raw, "input")   # type: ignore[arg-type]


async def token_lists(ctx: ServerContext, req: Any, items: list[str | list[int]], param: str) -> list[list[int]]:
    """``items`` (texts or token-id lists) as token ids: texts tokenized (``req.add_special_tokens``), each truncated
    as ``req.truncate_prompt_tokens`` asks and checked against the context; errors name ``param``."""
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    if len(items) > MAX_CHOICES:
        raise bad_request(f"{param} holds {len(items)} items; at most {MAX_CHOICES} per request", param)
    truncating = req.truncate_prompt_tokens is not None
    for item in items:
        if isinstance(item, str):
            ctx.check_text(len(item), param, truncating)
    out = []
    for item in items:
        if isinstance(item, str):
            special = req.special_tokens() if hasattr(req, "special_tokens") else req.add_special_tokens
            ids = await ctx.tokenize(item, add_special_tokens=special, param=param, truncating=truncating)
        else:
            ids = list(item)
            ctx.check_token_ids(ids, param)
        ids = ctx.truncated(ids, req)
        if not ids:
            raise bad_request(f"{param} must not hold an empty text or token list", param)
        ctx.check_length(len(ids), None, param, pooling=True)   # at most max_model_len tokens
        out.append(ids)
    return out


async def embed_all(ctx: ServerContext, raw: Request, rid: str, inputs: list[list[int]], params: PoolingParams,
                    priority: int, lora: object, param: str | Sequence[str] = "input",
                    cache_salt: str | None = None) -> list[list[float]]:
    """The embeddings of ``inputs`` (token-id lists), run together, in order; the engine's refusal of an input (its
    KV cache holds less than it) is a 400 naming the route's field ``param`` (or the input's, one per input)."""
    return [out.embedding for out in await pool_all(ctx, raw, rid, inputs, params, priority, lora, param,
                                                                    cache_salt)]


async def pool_all(ctx: ServerContext, raw: Request, rid: str, inputs: list[list[int]], params: PoolingParams,
                   priority: int, lora: object, param: str | Sequence[str] = "input",
                   cache_salt: str | None = None, token_types: Sequence[list[int] | None] | None = None) -> list[Any]:
    """The pooled results (``EmbeddingOutput`` or ``ClassificationOutput``) of ``inputs`` (with ``token_types``: each
    input's token types), as :func:`embed_all`."""
    requests = [(f"{rid}-{i}", ids, params) for i, ids in enumerate(inputs)]
    try:
        started = await unless_disconnected(raw, start(ctx, requests, priority, lora, param=param,
                                                           cache_salt=cache_salt, token_types=token_types))
    except RequestRejectedError as exc:
        raise bad_request(str(exc), exc.param or (param if isinstance(param, str) else "input")) from None
    events = merge(started)
    finals = await finish(raw, events, collect(events, len(inputs)))
    missing = next((i for i, out in enumerate(finals) if out is None or out.outputs is None), None)
    if missing is not None:
        raise APIError(500, f"input {missing} ended without a result", "server_error")
    return [out.outputs for out in finals]


def _encode(vector: Any, fmt: str) -> Any:
    """A vector (or a matrix: its rows one after another) as numbers, or as base64 of its little-endian float32
    bytes."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def pool_request(ctx: ServerContext, req: Any, raw: Request, route: str, task: str, options: dict[str, Any],
                       field: str, prefix: str) -> tuple[object, str, list[list[int]], list[Any]]:
    """A pooling route's common part: the model and task checked, ``PoolingParams(**options)`` (a bad value: a 400
    naming ``field``), the ``input`` tokenized and pooled; ``(lora, response id, inputs' token ids, outputs)``."""
    lora = ctx.check_model(req.model)
    ctx.check_task(task, route)
    ctx.note_ignored_fields(req)
    try:
        params = PoolingParams(**options)
    except ValueError as exc:
        raise bad_request(str(exc), field) from None
    inputs = await request_inputs(ctx, req)
    rid = random_id(prefix)
    return lora, rid, inputs, await pool_all(ctx, raw, rid, inputs, params, req.priority, lora,
                                                cache_salt=req.cache_salt)


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest, raw: Request) -> Response:
    lora, rid, inputs, outs = await pool_request(ctx, req, raw, "/v1/embeddings", "embed",
                                                 {"normalize": req.normalize, "dimensions": req.dimensions,
                                                  "task": "embed"}, "dimensions", "embd")
    vectors = [out.embedding for out in outs]
    prompt_tokens = sum(len(ids) for ids in inputs)
    body = EmbeddingResponse(id=rid, model=ctx.reply_model(lora),
                             data=[EmbeddingData(index=i, embedding=_encode(v, req.encoding_format))
                                   for i, v in enumerate(vectors)],
                             usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
    return JSONResponse(body.model_dump())


async def create_pooling(ctx: ServerContext, req: PoolingRequest, raw: Request) -> Response:
    """vLLM's ``/pooling``: the pooled output of each input as numbers: an embedding or label probabilities, or one
    row per input token (``task`` ``token_embed`` / ``token_classify``); the engine's own task by default."""
    lora, rid, inputs, outs = await pool_request(ctx, req, raw, "/pooling", ("embed", "classify"),
                                                 {"normalize": req.normalize, "dimensions": req.dimensions,
                                                  "use_activation": req.use_activation, "activation": req.activation,
                                                  "task": req.task},
                                                 # (the values pydantic lets through: a bad dimensions; the two
                                                 # names of use_activation disagreeing)
                                                 "dimensions" if req.activation is None else "use_activation", "pool")
    rows = [o.embedding if isinstance(o, EmbeddingOutput) else o.probs if isinstance(o, ClassificationOutput)
            else o.data.tolist() for o in outs]
    tokens = sum(len(ids) for ids in inputs)
    body = PoolingResponse(id=rid, model=ctx.reply_model(lora),
                           data=[PoolingData(index=i, data=_encode(v, req.encoding_format)) for i, v in enumerate(rows)],
                           usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())
