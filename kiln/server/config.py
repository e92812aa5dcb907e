"""Settings of one server (the `kiln serve` flags)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    model_name: str = "kiln"
    """The model id clients name in requests and /v1/models lists."""
    api_key: str | None = None
    """Bearer token every /v1 route requires (None: no authentication)."""
    max_queue: int = 64
    """Requests that may wait beyond the engine's max_batch_size running ones; more are refused with 429."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body accepted; larger ones are refused with 413."""
    body_timeout: float = 30.0
    """Seconds a client has to send its whole request body; slower ones (or a body shorter than its
    Content-Length) are refused with 408."""
    log_prompts: bool = False
    """Put prompt text in the per-request log lines."""

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be ≥ 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be ≥ 1024")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout={self.body_timeout} must be > 0")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty (that would serve without authentication); leave it "
                             "unset to serve without a key")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise ValueError("the API key must not start or end with whitespace (no request could match it)")
