"""``POST /v1/score`` and ``POST /v1/rerank``. An embedding server (``--task embed``) embeds the texts (normalized)
and compares them by cosine similarity, as a bi-encoder is used for retrieval; each distinct text is embedded once
per request, all of them together. A one-label sequence classifier (``--task classify``, a cross-encoder) reads each
pair together (:func:`~plinth.entrypoints.openai.serving_classify.cross_encoder_scores`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from plinth.core.pooling import PoolingParams, cosine_scores
from plinth.entrypoints.openai.errors import bad_request
from plinth.entrypoints.openai.protocol import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    random_id,
)
from plinth.entrypoints.openai.serving import ServerContext
from plinth.entrypoints.openai.serving_classify import cross_encoder_scores
from plinth.entrypoints.openai.serving_embedding import embed_all, token_lists


def _as_items(value: object) -> list:
    """A text or a token-id list as a one-item list; a list of texts or of token-id lists as it is."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [value]
    return list(value)   # type: ignore[call-overload]


async def _embed_distinct(ctx: ServerContext, raw: Request, req: ScoreRequest | RerankRequest, rid: str,
                          groups: list[tuple[list, str]], lora: object) -> tuple[list[list[list[float]]], int]:
    """The embeddings of each group's items (texts or token lists, errors naming the group's field), each distinct
    token list embedded once; and the prompt tokens counted once per item."""
    token_groups = [await token_lists(ctx, req, items, param) for items, param in groups]
    distinct: dict[tuple[int, ...], int] = {}
    fields: list[str] = []   # the field each distinct token list first came from
    for ids_list, (_, param) in zip(token_groups, groups, strict=True):
        for ids in ids_list:
            if tuple(ids) not in distinct:
                distinct[tuple(ids)] = len(distinct)
                fields.append(param)
    vectors = await embed_all(ctx, raw, rid, [list(k) for k in distinct], PoolingParams(normalize=True),
                              req.priority, lora, fields, req.cache_salt)
    tokens = sum(len(ids) for ids_list in token_groups for ids in ids_list)
    return [[vectors[distinct[tuple(ids)]] for ids in ids_list] for ids_list in token_groups], tokens


async def create_score(ctx: ServerContext, req: ScoreRequest, raw: Request) -> Response:
    lora = ctx.check_model(req.model)
    ctx.check_task(("embed", "classify"), "/v1/score")
    ctx.note_ignored_fields(req)
    first, second = _as_items(req.text_1), _as_items(req.text_2)
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"text_1 holds {len(first)} items and text_2 {len(second)}: give one text_1, or as many as "
                          f"text_2", "text_1")
    rid = random_id("score")
    if ctx.front.task == "classify":
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
        scores, tokens = await cross_encoder_scores(ctx, raw, req, rid, pairs, ("text_1", "text_2"), lora)
    else:
        (left, right), tokens = await _embed_distinct(ctx, raw, req, rid, [(first, "text_1"), (second, "text_2")],
                                                      lora)
        scores = cosine_scores(left, right)
    data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    body = ScoreResponse(id=rid, model=ctx.reply_model(lora), data=data,
                         usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())


async def create_rerank(ctx: ServerContext, req: RerankRequest, raw: Request) -> Response:
    lora = ctx.check_model(req.model)
    ctx.check_task(("embed", "classify"), "/v1/rerank")
    ctx.note_ignored_fields(req)
    documents = list(req.documents)
    if not documents:
        raise bad_request("documents must not be empty", "documents")
    rid = random_id("rerank")
    if ctx.front.task == "classify":
        scores, tokens = await cross_encoder_scores(ctx, raw, req, rid, [(req.query, d) for d in documents],
                                                    ("query", "documents"), lora)
    else:
        (query, docs), tokens = await _embed_distinct(ctx, raw, req, rid, [([req.query], "query"),
                                                                           (documents, "documents")], lora)
        scores = cosine_scores(query, docs)
    scored = sorted(((score, i) for i, score in enumerate(scores)), key=lambda t: (-t[0], t[1]))
    if req.top_n is not None and req.top_n > 0:   # 0 or less: every document (vLLM's default is 0)
        scored = scored[:req.top_n]
    results = []
    for score, i in scored:
        doc = None
        if req.return_documents:
            item = documents[i]
            doc = RerankDocument(text=item) if isinstance(item, str) else RerankDocument(token_ids=list(item))
        results.append(RerankResult(index=i, relevance_score=score, document=doc))
    body = RerankResponse(id=rid, model=ctx.reply_model(lora), usage=RerankUsage(total_tokens=tokens), results=results)
    return JSONResponse(body.model_dump(exclude_none=True))
