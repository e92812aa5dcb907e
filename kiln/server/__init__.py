"""`kiln serve`: an OpenAI-compatible HTTP server over an LLM (FastAPI + uvicorn, the `kiln[serve]` extra).

    from kiln.server import ServerConfig, create_app
    app = create_app(LLM("engine/"), ServerConfig(model_name="my-model"))

Modules, one job each: `config` (settings), `app` (routes), `state` (what routes share), `models` (the base model
and the LoRA adapters served by name, loaded and unloaded at run time), `auth` (bearer keys),
`admission` (the bounded queue), `body` (size-limited JSON reading), `protocol` (strict request models),
`sampling` (request → SamplingConfig), `generation` (submit, await or stream, abort on disconnect),
`completions` / `chat` / `responses` / `logprobs` (OpenAI's response shapes), `sse` (server-sent events),
`errors` (OpenAI error bodies), `metrics` (Prometheus), `middleware` (request ids, log lines), `run` (uvicorn with a
graceful stop), `static/index.html` (the chat page).
"""
from .config import ServerConfig

__all__ = ["create_app", "ServerConfig"]


def __getattr__(name: str):
    """create_app imported when asked for, so that the settings (ServerConfig) import without FastAPI installed."""
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module 'kiln.server' has no attribute {name!r}")
