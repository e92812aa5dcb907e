"""Settings of one server (the `kiln serve` flags)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


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
    lora_modules: dict[str, str | os.PathLike] = field(default_factory=dict)
    """LoRA adapters served by name (`--lora_modules name=path`): name → Hugging Face PEFT adapter directory. A
    request whose `model` is a name runs under that adapter. Each is read and checked against the engine when the
    app is made (a bad one stops the server, named); adapters stored in the engine (LoraConfig.lora_dir) are served
    by their names too."""

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
        if not isinstance(self.lora_modules, dict):
            raise ValueError(f"lora_modules must be a dict of adapter name → directory, got "
                             f"{type(self.lora_modules).__name__}")
        for name, path in self.lora_modules.items():
            problem = adapter_name_problem(name, self.model_name)
            if problem:
                raise ValueError(f"lora_modules: {problem}")
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise ValueError(f"lora_modules: adapter {name!r} needs a directory, got {path!r}")


def adapter_name_problem(name, base: str) -> str | None:
    """What is wrong with `name` as the name of an adapter served beside the base model `base` (None: nothing)."""
    if not isinstance(name, str) or not name:
        return f"an adapter name must be a non-empty string, got {name!r}"
    if name != name.strip() or not name.isprintable():
        return f"adapter name {name!r} starts or ends with whitespace or holds control characters"
    if name == base:
        return f"adapter name {name!r} is the base model's name"
    return None
