"""Request bodies: at most max_bytes, strict UTF-8, JSON without NaN/Infinity, then a protocol model."""
from __future__ import annotations

import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import APIError, invalid


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the server's limit of {limit} bytes", "request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; refused with 413 as soon as it (or its Content-Length) passes `limit`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(f"request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError as err:
        raise invalid(f"request body is not valid JSON: {err}", code="invalid_json") from None


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """The first problem, named by its field path: ("temperature: Input should be ...", "temperature")."""
    first = err.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown parameter"
    return (f"{param}: {message}" if param else message), param


async def parse_request(request: Request, model: type[BaseModel], limit: int,
                        unsupported: dict[str, str]) -> BaseModel:
    """The body as `model`; a field named in `unsupported` is refused with its explanation."""
    data = parse_json(await read_body(request, limit))
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
