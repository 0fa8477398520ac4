"""``POST /v1/embeddings``: OpenAI's embeddings route, for a server started with ``--task embed``."""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.pooling import PoolingParams
from plinth.entrypoints.openai.errors import APIError, bad_request
from plinth.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from plinth.entrypoints.openai.serving import MAX_CHOICES, ServerContext, collect, finish, merge, start
from plinth.entrypoints.openai.streaming import unless_disconnected


async def _inputs(ctx: ServerContext, req: EmbeddingRequest) -> list[list[int]]:
    """The request's inputs as token ids (texts tokenized, each truncated as asked and checked against the
    context)."""
    raw = req.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise bad_request("input must not be empty", "input")
    if len(raw) > MAX_CHOICES:
        raise bad_request(f"input holds {len(raw)} items; at most {MAX_CHOICES} per request", "input")
    for item in raw:
        if isinstance(item, str):
            ctx.check_text(len(item), "input", req.truncate_prompt_tokens is not None)
    out = []
    for item in raw:
        if isinstance(item, str):
            ids = await ctx.tokenize(item, add_special_tokens=req.add_special_tokens, param="input",
                                     truncating=req.truncate_prompt_tokens is not None)
        else:
            ids = list(item)   # type: ignore[arg-type]
            ctx.check_token_ids(ids, "input")
        ids = ctx.truncated(ids, req)
        if not ids:
            raise bad_request("input must not hold an empty text or token list", "input")
        ctx.check_length(len(ids), None, "input")   # at most max_model_len - 1 tokens (one position is sampled, then dropped)
        out.append(ids)
    return out


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest, raw: Request) -> Response:
    lora = ctx.check_model(req.model)
    ctx.check_task("embed")
    ctx.note_ignored_fields(req)
    try:
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from None
    inputs = await _inputs(ctx, req)
    rid = random_id("embd")
    requests = [(f"{rid}-{i}", ids, params) for i, ids in enumerate(inputs)]
    started = await unless_disconnected(raw, start(ctx, requests, req.priority, lora))
    events = merge(started)
    finals = await finish(raw, events, collect(events, len(inputs)))
    missing = next((i for i, out in enumerate(finals) if out is None or out.outputs is None), None)
    if missing is not None:
        raise APIError(500, f"embedding input {missing} ended without a result", "server_error")
    vectors = [out.outputs.embedding for out in finals]
    prompt_tokens = sum(len(ids) for ids in inputs)
    body = EmbeddingResponse(id=rid, model=ctx.reply_model(lora),
                             data=[EmbeddingData(index=i, embedding=_encode(v, req.encoding_format))
                                   for i, v in enumerate(vectors)],
                             usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
    return JSONResponse(body.model_dump())
