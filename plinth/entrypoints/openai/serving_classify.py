"""``POST /classify`` (vLLM's route) for a sequence classifier (``--task classify``): each input's label
probabilities; and the pairs of ``/v1/score`` and ``/v1/rerank`` read together by a one-label classifier (a
cross-encoder), each pair's score its label's probability."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.pooling import PoolingParams, check_cross_encoder, cut_pair, pair_types
from plinth.core.scheduler import RequestRejectedError
from plinth.entrypoints.openai.errors import bad_request
from plinth.entrypoints.openai.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    ClassificationUsage,
)
from plinth.entrypoints.openai.serving import MAX_CHOICES, ServerContext
from plinth.entrypoints.openai.serving_embedding import pool_all, pool_request


async def create_classification(ctx: ServerContext, req: ClassificationRequest, raw: Request) -> Response:
    lora, rid, inputs, outs = await pool_request(ctx, req, raw, "/classify", "classify",
                                                 {"use_activation": req.use_activation, "activation": req.activation,
                                                  "task": "classify"},
                                                 "use_activation", "classify")
    labels = ctx.front.classifier.labels
    data = [ClassificationData(index=i, label=labels[max(range(len(o.probs)), key=o.probs.__getitem__)],
                               probs=o.probs, num_classes=len(o.probs)) for i, o in enumerate(outs)]
    tokens = sum(len(ids) for ids in inputs)
    body = ClassificationResponse(id=rid, model=ctx.reply_model(lora), data=data,
                                  usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())


async def cross_encoder_scores(ctx: ServerContext, raw: Request, req: Any, rid: str, pairs: list[tuple[Any, Any]],
                               params: tuple[str, str], lora: object) -> tuple[list[float], int]:
    """Each pair's score by a one-label classifier reading the two together (texts tokenized as a pair, token-id
    lists joined; ``truncate_prompt_tokens`` cuts each pair as the tokenizer cuts one, the longer text first, so that
    both keep their beginning; errors name the field at fault, a pair too long its longer text's); and the prompt
    tokens."""
    try:
        check_cross_encoder(ctx.front.classifier)
    except RequestRejectedError as exc:
        raise bad_request(str(exc), "model", "model_not_supported") from None
    if not pairs:
        raise bad_request(f"{params[1]} must not be empty", params[1])
    if len(pairs) > MAX_CHOICES:
        raise bad_request(f"{params[1]} holds {len(pairs)} items; at most {MAX_CHOICES} per request", params[1])
    keep = ctx.keep_tokens(req)
    inputs: list[list[int]] = []
    types: list[list[int] | None] = []
    special = ctx.front.special_ids if getattr(ctx.front, "encoder", False) else ()
    segments = ctx.front.num_token_types > 1
    for first, second in pairs:
        longer = params[0] if len(first) >= len(second) else params[1]   # named where the pair is too long
        if isinstance(first, str) and isinstance(second, str):
            ids, kinds = await ctx.tokenize_pair(first, second, add_special_tokens=req.add_special_tokens,
                                                 param=longer, max_tokens=keep)
        elif isinstance(first, str) or isinstance(second, str):
            raise bad_request(f"a cross-encoder reads {params[0]} and {params[1]} together: give both as texts or "
                              f"both as token ids", params[1])
        else:
            for item, param in zip((first, second), params, strict=True):
                if not item:
                    raise bad_request(f"{param} must not hold an empty token list", param)
                ctx.check_token_ids(item, param)
            ids, split = cut_pair(first, second, keep, special)
            kinds = pair_types(len(ids), split) if segments else None
        if not ids:
            raise bad_request(f"{params[0]} and {params[1]} must not be empty", params[0])
        ctx.check_length(len(ids), None, longer, pooling=True)   # at most max_model_len tokens
        inputs.append(ids)
        types.append(kinds)
    outs = await pool_all(ctx, raw, rid, inputs, PoolingParams(), req.priority, lora, params[1],
                          cache_salt=req.cache_salt, token_types=types)
    return [o.probs[0] for o in outs], sum(len(ids) for ids in inputs)
