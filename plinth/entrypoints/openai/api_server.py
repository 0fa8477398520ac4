"""The FastAPI app: routes, API-key check, lifespan.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/embeddings``
(``--task embed``), ``POST /classify`` (``--task classify``), ``POST /v1/score`` and ``POST /v1/rerank`` (either),
``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health`` (also ``GET|POST /ping``),
``GET /version``, ``GET /metrics``; with ``--allow-runtime-lora-updating`` also ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``; with ``--enable-weight-updates`` also ``POST /update_weights`` and
``POST /reset_prefix_cache``. A request's ``X-Request-Id`` header comes back on its response (with
``--enable-request-id-headers``, a new one on a response to a request without one).

With an API key, every route but ``/health``, ``/ping``, ``/version`` and ``/metrics`` needs
``Authorization: Bearer <key>``; those stay open so that orchestrators and Prometheus can reach them
without the key (they expose no request content: only liveness, versions, the startup
selection and aggregate counters). Bind to a private interface or put a proxy in front if
those must be hidden too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Query
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from plinth import __version__
from plinth.config import ConfigError
from plinth.core.async_engine import AsyncLLMEngine
from plinth.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from plinth.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PoolingRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsRequest,
)
from plinth.entrypoints.openai.reasoning_parsers import ReasoningParser
from plinth.entrypoints.openai.serving import LoRANameError, ServerContext
from plinth.entrypoints.openai.serving_chat import create_chat_completion
from plinth.entrypoints.openai.serving_classify import create_classification
from plinth.entrypoints.openai.serving_completion import create_completion
from plinth.entrypoints.openai.serving_embedding import create_embedding, create_pooling
from plinth.entrypoints.openai.serving_responses import create_response
from plinth.entrypoints.openai.serving_score import create_rerank, create_score
from plinth.entrypoints.openai.serving_tokenize import detokenize, tokenize
from plinth.entrypoints.openai.streaming import ClientDisconnected
from plinth.entrypoints.openai.tool_parsers import ToolParser
from plinth.errors import EngineSleepingError, ModelLoadError
from plinth.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

#: the routes that stay open when an API key is set (everything else needs it)
OPEN = frozenset({"/health", "/ping", "/version", "/metrics"})


class APIKeyMiddleware:
    """Refuse requests without ``Authorization: Bearer <key>`` (compared in constant time), except to the
    :data:`OPEN` routes. Paths are taken relative to the ASGI ``root_path`` (``--root-path``), which the
    server puts in front of them."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] == "http" and path.rstrip("/") not in OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                missing = not given
                message = ("missing API key: send 'Authorization: Bearer <key>'" if missing
                           else "invalid API key")
                response = APIError(401, message, "authentication_error", code="invalid_api_key",
                                    headers={"WWW-Authenticate": "Bearer"}).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: the largest request body the server reads by default (``--max-request-bytes``): a long prompt of embeddings or
#: several large images as data URLs fit; a body that would only exhaust the host's memory does not
DEFAULT_MAX_REQUEST_BYTES = 256 << 20


class RequestSizeMiddleware:
    """Refuse (413) a request whose body is larger than ``max_bytes``: by its ``Content-Length`` before anything is
    read, else while it arrives (a chunked body), never holding more than the limit; the app then reads the body
    as it came."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self) -> Any:
        return APIError(413, f"the request body is larger than the server takes ({self.max_bytes} bytes; "
                             "--max-request-bytes)", code="request_too_large").response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refusal()(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left: the app sees it as it would have
                chunks = []
                first: Any = message
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._refusal()(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()   # (later: the disconnect a streaming reply watches for)

        await self.app(scope, replay, send)


class RequestIdMiddleware:
    """Send a request's ``X-Request-Id`` header back on its response (for tracing through proxies); with ``generate``
    (``--enable-request-id-headers``, as vLLM's), a response to a request without one gets a new one (uuid4, hex)."""

    def __init__(self, app: ASGIApp, generate: bool = False):
        self.app = app
        self.generate = generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope["headers"]).get(b"x-request-id") if scope["type"] == "http" else None
        if (not given or len(given) > 256) and self.generate and scope["type"] == "http":
            given = uuid.uuid4().hex.encode()
        if not given or len(given) > 256:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclasses.dataclass(frozen=True)
class CorsSettings:
    """Cross-origin requests from browsers (off unless origins are given: a page on any site could otherwise
    use a server on the user's machine)."""

    allowed_origins: tuple[str, ...]
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def build_app(front: AsyncLLMEngine, api_key: str | None = None, tool_parser: type[ToolParser] | None = None,
              reasoning_parser: type[ReasoningParser] | None = None, return_tokens_as_token_ids: bool = False,
              cors: CorsSettings | None = None, lora_modules: Sequence[tuple[str, str]] = (),
              allow_lora_updates: bool = False, openapi: bool = True, response_role: str = "assistant",
              allow_weight_updates: bool = False,
              max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, force_include_usage: bool = False,
              request_id_headers: bool = False) -> FastAPI:
    """The server app around a running engine front (shut down with the app); ``tool_parser`` finds the
    tool calls of ``tool_choice: "auto"`` requests, ``reasoning_parser`` the thinking of chat replies;
    ``return_tokens_as_token_ids``: logprob tokens as ``token_id:N`` unless a request says otherwise; ``cors``:
    the origins (and methods, headers) browsers may call from; ``lora_modules``: ``(name, folder)`` of the LoRA
    adapters served as models of those names (read and checked here); ``allow_lora_updates``: the routes that
    load and unload adapters while serving; ``openapi``: serve the API's schema at ``/openapi.json``;
    ``response_role``: the role of chat replies to requests with ``add_generation_prompt``;
    ``allow_weight_updates``: the routes that load new weights from the server's disk and forget the prefix cache;
    ``max_request_bytes``: the largest request body read (larger ones are 413s; ``None``: no limit);
    ``force_include_usage``: every stream ends with a usage chunk, as if it asked for one (``stream_options``);
    ``request_id_headers``: a response to a request without an ``X-Request-Id`` gets a new one (it always gets its own).

    Raises:
        ValueError: an adapter cannot be served, or its name is taken.
    """
    ctx = ServerContext(front=front, metrics=ServerMetrics(front.served_model_name),
                        model_name=front.served_model_name, tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser, return_tokens_as_token_ids=return_tokens_as_token_ids,
                        allow_lora_updates=allow_lora_updates, response_role=response_role,
                        force_include_usage=force_include_usage)
    for name, path in lora_modules:
        ctx.add_lora(name, path)
    if tool_parser is not None and "tools" not in (front.chat_template_source or ""):
        logger.warning("--tool-call-parser %s: the chat template does not mention tools, so the model will not "
                       "see their definitions; pass a --chat-template that renders them", tool_parser.name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        front.shutdown()

    app = FastAPI(title="plinth", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None)
    app.state.ctx = ctx
    install_error_handlers(app)
    if max_request_bytes is not None:   # (the innermost: a caller without the key is refused before its body is read)
        app.add_middleware(RequestSizeMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors is not None:   # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_credentials=cors.allow_credentials, allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers))
    app.add_middleware(RequestIdMiddleware, generate=request_id_headers)

    @app.api_route("/ping", methods=["GET", "POST"])   # the health check's name on some hosting platforms
    @app.get("/health")
    async def health() -> Response:
        if not front.is_healthy:
            return APIError(503, "the inference engine is not running", "service_unavailable_error",
                            code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        selection = front.selection.to_dict() if front.selection is not None else None
        return JSONResponse({"version": __version__, "selection": selection})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(front.stats()), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        # (the longest sequence a request may make: max_model_len, or less where the KV cache holds less)
        longest = front.max_sequence_len
        lora = ctx.loras.get(name)
        if name not in ctx.model_names and lora is not None:
            return ModelCard(id=name, root=lora.lora_path, parent=ctx.model_name, max_model_len=longest)
        return ModelCard(id=name, max_model_len=longest)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(ModelList(data=[card(name) for name in (*ctx.model_names, *ctx.loras)]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        if not model:   # (an empty ``model`` field of a request means the base model; an empty id names none)
            raise APIError(404, "no model id given: GET /v1/models/{id}", "not_found_error", "model",
                           "model_not_found")
        ctx.check_model(model)
        return JSONResponse(card(model).model_dump())

    def check_lora_updates() -> None:
        if not ctx.allow_lora_updates:
            raise APIError(404, "loading and unloading LoRA adapters while serving is off (plinth serve "
                                "--allow-runtime-lora-updating turns it on)", "not_found_error", code="not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        check_lora_updates()
        try:
            await asyncio.to_thread(ctx.add_lora, body.lora_name, body.lora_path, body.load_inplace)
        except LoRANameError as exc:
            raise bad_request(str(exc), "lora_name", "model_name_taken" if exc.taken else None) from None
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        logger.info("serving LoRA adapter %r from %s", body.lora_name, body.lora_path)
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        check_lora_updates()
        lora = ctx.loras.pop(body.lora_name, None)
        if lora is None:
            raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is served", "not_found_error",
                           "lora_name", "model_not_found")
        front.remove_lora(lora.lora_int_id)
        logger.info("stopped serving LoRA adapter %r", body.lora_name)
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    def check_weight_updates() -> None:
        if not allow_weight_updates:
            raise APIError(404, "updating the weights and the prefix cache while serving is off (plinth serve "
                                "--enable-weight-updates turns it on)", "not_found_error", code="not_found")

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> Response:
        check_weight_updates()
        t0 = time.monotonic()
        try:
            count = await front.update_weights(body.path, body.reset_prefix_cache)
        except ModelLoadError as exc:
            raise bad_request(str(exc), "path") from None
        except EngineSleepingError as exc:   # (no retry helps: POST /wake_up?tags=weights first)
            raise APIError(409, f"{exc} (POST /wake_up?tags=weights)", "invalid_request_error",
                           code="engine_sleeping") from None
        logger.info("weights updated from %s: %d tensor(s) in %.2f s", body.path, count, time.monotonic() - t0)
        return JSONResponse({"status": "ok", "tensors": count})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        check_weight_updates()
        return JSONResponse({"status": "ok", "reset": await front.reset_prefix_cache()})

    if getattr(front, "sleep_mode", False):   # an engine started with --enable-sleep-mode (vLLM's routes)
        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            t0 = time.monotonic()
            await front.sleep(level)
            logger.info("asleep (level %d) in %.2f s", level, time.monotonic() - t0)
            return JSONResponse({"status": "ok", "is_sleeping": True})

        @app.post("/wake_up")
        async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:   # noqa: B008 (FastAPI's way)
            try:
                await front.wake_up(tags)
            except ConfigError as exc:   # no room on the device now
                raise APIError(503, str(exc), "service_unavailable_error", code="no_memory",
                               headers={"Retry-After": "10"}) from None
            return JSONResponse({"status": "ok", "is_sleeping": front.is_sleeping()})

        @app.get("/is_sleeping")
        async def is_sleeping() -> Response:
            return JSONResponse({"is_sleeping": front.is_sleeping()})

    async def answer(handler: Any, body: Any, raw: Request) -> Response:
        try:
            return await handler(ctx, body, raw)
        except ClientDisconnected:
            return Response(status_code=499)   # never delivered: the client is gone

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await answer(create_completion, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await answer(create_chat_completion, body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await answer(create_response, body, raw)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await answer(create_embedding, body, raw)

    @app.post("/pooling")
    @app.post("/v1/pooling")
    async def pooling(body: PoolingRequest, raw: Request) -> Response:
        return await answer(create_pooling, body, raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, raw: Request) -> Response:
        return await answer(create_classification, body, raw)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, raw: Request) -> Response:
        return await answer(create_score, body, raw)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        return await answer(create_rerank, body, raw)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        return await tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        return await detokenize(ctx, body)

    return app
