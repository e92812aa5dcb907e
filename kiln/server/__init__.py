"""`kiln serve`: an OpenAI-compatible HTTP server over an LLM (FastAPI + uvicorn, the `kiln[serve]` extra).

    from kiln.server import create_app
    app = create_app(LLM("engine/"), ServerConfig(model_name="my-model"))

Modules, one job each: `config` (settings), `errors` (OpenAI error bodies), `body` (size-limited JSON reading),
`protocol` (strict request models), `sampling` (request → SamplingConfig), `generation` (submit, wait, stream,
abort on disconnect), `logprobs`, `completions` / `chat` (response shapes), `metrics` (Prometheus),
`middleware` (request ids, log lines, status counts), `app` (routes), `static/index.html` (the chat page).
"""
from .app import create_app
from .config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
