"""Request bodies: Content-Type application/json, at most max_bytes within body_timeout seconds, strict UTF-8,
JSON without NaN/Infinity nested at most MAX_JSON_DEPTH deep, then a protocol model (parsed off the event loop)."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .config import ServerConfig
from .errors import APIError, ClientDisconnected, invalid

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects accepted; the deepest request Kiln understands is 4 levels."""


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the server's limit of {limit} bytes", "request_too_large")


def check_json_type(request: Request) -> None:
    """415 unless the body is declared JSON: a browser sends text/plain or form bodies across sites without
    asking (no CORS preflight), JSON only after one, which this server never grants."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not "
                            f"{kind or 'none'}", "unsupported_media_type")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body; refused with 413 as soon as it (or its Content-Length) passes `limit`, with 408 when it has
    not all arrived within `timeout` seconds (a body shorter than its Content-Length would wait forever)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", "request_timeout") from None
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return b"".join(chunks)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _deeper_than(value, limit: int) -> bool:
    """Whether arrays/objects nest more than `limit` deep (level by level: no recursion)."""
    level = [value]
    for _ in range(limit):
        level = [child for v in level if isinstance(v, (dict, list))
                 for child in (v.values() if isinstance(v, dict) else v)]
        if not level:
            return False
    return any(isinstance(v, (dict, list)) for v in level)


def parse_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(f"request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    too_deep = invalid(f"request body nests arrays/objects more than {MAX_JSON_DEPTH} deep", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise too_deep from None
    except ValueError as err:
        raise invalid(f"request body is not valid JSON: {err}", code="invalid_json") from None
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep
    return data


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """The first problem, named by its field path: ("temperature: Input should be ...", "temperature")."""
    first = err.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown parameter"
    return (f"{param}: {message}" if param else message), param


def _validate(raw: bytes, model: type[BaseModel], unsupported: dict[str, str]) -> BaseModel:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object", code="invalid_json")
    for name in data:
        if name in unsupported:
            raise invalid(unsupported[name], name, "unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err)
        raise invalid(message, param) from None


async def parse_request(request: Request, model: type[BaseModel], config: ServerConfig,
                        unsupported: dict[str, str]) -> BaseModel:
    """The body as `model`; a field named in `unsupported` is refused with its explanation. Parsing and
    validation (tens of ms for a body of megabytes) run on a worker thread, so other requests go on."""
    check_json_type(request)
    raw = await read_body(request, config.max_body_bytes, config.body_timeout)
    return await asyncio.to_thread(_validate, raw, model, unsupported)
