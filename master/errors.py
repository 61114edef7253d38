"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every route.

Handlers here replace FastAPI's defaults (422 for validation, HTML-less 404s, tracebacks on 500)
so that clients always parse the same envelope, and nothing internal leaks out.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An answer other than success, raised anywhere below a route and rendered by the handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(0, round(self.retry_after)))} if self.retry_after is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, retry_after: float, status: int = 503) -> APIError:
    return APIError(status, message, "service_unavailable_error", None, "no_capacity", retry_after)


def internal_error() -> APIError:
    return APIError(500, "The server had an error while processing the request.", "server_error", None, "internal_error")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """First pydantic error as a sentence and the top-level field it names."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid value")
    return (f"{where}: {message}" if where else message), param


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        error = APIError(exc.status_code, message, "invalid_request_error", None, _HTTP_CODES.get(exc.status_code))
        response = error.response()
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()
