"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, and their handlers.

Every failure reaching a client goes through here: user mistakes get a 4xx naming the field,
an overloaded server a 503 with ``Retry-After``, and anything unexpected a generic 500 whose
traceback stays in the server log.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plinth.core.async_engine import EngineDeadError
from plinth.core.request import SamplingParamsError
from plinth.core.scheduler import QueueFullError, RequestRejectedError
from plinth.errors import EngineSleepingError, RequestFailedError, SleepModeError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to the error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "service_unavailable_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineSleepingError):
        return APIError(503, str(exc), "service_unavailable_error", code="engine_sleeping",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, SleepModeError):
        return bad_request(str(exc))
    if isinstance(exc, RequestRejectedError):   # without the engine's own request id, which the client never saw
        param = {"extra_args": "vllm_xargs"}.get(exc.param or "prompt", exc.param or "prompt")   # the body's name
        return bad_request(_ENGINE_REQUEST.sub("", str(exc), count=1), param)
    if isinstance(exc, RequestFailedError):   # the server's own code failed this request (the log has the traceback)
        return APIError(500, str(exc), "server_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the inference engine is not available: {exc}", "service_unavailable_error",
                        code="engine_unavailable")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return internal_error()


#: the engine's "request 'ID': " prefix of a refusal
_ENGINE_REQUEST = re.compile(r"^request '[^']*': ")


def internal_error() -> APIError:
    return APIError(500, "internal server error; the server log has the details", "server_error")


def error_json(exc: BaseException) -> str:
    """The error as one JSON document (for a stream that already started)."""
    return json.dumps(to_api_error(exc).body())


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    # a value that matches no member of a union fails in every member: the deepest location is the member
    # that came closest (prompt [[1, "a"]]: its list[list[int]] member at [0][1], not "a valid string")
    first = max(errors, key=lambda e: (e.get("type") == "json_invalid", len(e.get("loc", ()))))
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('msg', 'cannot parse')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") == "string_unicode":   # a field's name with a lone UTF-16 surrogate
        return bad_request("a field name of the request body is not valid Unicode (a lone UTF-16 surrogate)")
    if not loc:
        return bad_request("the request body must be a JSON object (sent with Content-Type: application/json)",
                           code="invalid_json")
    # Union members (prompt: str | list[...]) add their type name to the path; drop those. List indices stay
    # in the message (messages[2].role) but not in ``param``.
    path = [p for p in loc if not _is_union_tag(p)]
    fields = [p for p in path if not p.isdigit()]
    param = fields[0] if fields else None
    where = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip(".") or "body"
    if first.get("type") == "missing":
        return bad_request(f"missing required field {where!r}", param)
    return bad_request(f"invalid value for {where!r}: {first.get('msg', 'invalid')}", param)


_UNION_TAGS = ("str", "int", "float", "bool", "none", "bytes")


def _is_union_tag(part: str) -> bool:
    """Whether a pydantic error-location part names a union member (``str``, ``list[int]``,
    ``function-after[...]``) rather than a field (``stream``, ``stream_options``)."""
    return part in _UNION_TAGS or ("[" in part and part.endswith("]"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_, headers=exc.headers).response()

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    for cls in (SamplingParamsError, RequestRejectedError, QueueFullError, EngineDeadError, RequestFailedError,
                SleepModeError):
        app.add_exception_handler(cls, _known)

    # Reached through Starlette's ServerErrorMiddleware, which re-raises so the server logs the traceback.
    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error().response()
