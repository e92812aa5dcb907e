"""Bearer-token authentication of the /v1 routes."""
from __future__ import annotations

import hmac

from fastapi import Request

from .errors import APIError


def bearer_check(api_key: str | None):
    """A FastAPI dependency: 401 unless the request carries `Authorization: Bearer <api_key>`."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", "invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", "invalid_api_key")

    return check
