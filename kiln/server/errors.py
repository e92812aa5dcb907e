"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable", 500: "internal_error"}


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: it always encodes, even when the message quotes a client's unpaired
    surrogate."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client as `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"},
                   408: {"Connection": "close"}}.get(self.status)   # 408: the rest of the body may still come
        return ErrorResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers (its own, unknown routes, wrong methods, bugs) uses the OpenAI body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        return err.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return APIError(err.status_code, str(err.detail), code).response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, err: Exception):
        return APIError(500, f"internal server error: {type(err).__name__}", "internal_error").response()
