"""The FastAPI app of `kiln serve`: OpenAI's /v1 routes (bearer auth), vLLM's routes that load and unload LoRA
adapters (only on a server with an API key), /health, /metrics and the chat page."""
from __future__ import annotations

from contextlib import asynccontextmanager
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .admission import shutting_down
from .auth import bearer_check
from .body import parse_request
from .chat import create_chat_completion
from .completions import create_completion
from .config import ServerConfig
from .errors import APIError, ClientDisconnected, install_error_handlers
from .middleware import RequestLog
from .protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from .state import ServerState

CLIENT_CLOSED = 499   # nginx's status for "the client closed the connection"


def create_app(llm, config: ServerConfig | None = None, owns_llm: bool = False) -> FastAPI:
    """An app serving `llm` (and the LoRA adapters of config.lora_modules and of the engine, each checked here: a
    bad one raises ValueError naming it); with owns_llm the LLM is shut down when the app stops."""
    state = ServerState(llm, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        state.admission.draining = True
        state.close()
        if owns_llm:
            llm.shutdown()

    app = FastAPI(title="Kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kiln = state
    install_error_handlers(app)
    app.add_middleware(RequestLog, metrics=state.metrics)
    app.include_router(_v1_routes(state), dependencies=[Depends(bearer_check(state.config.api_key))])
    app.include_router(_plain_routes(state))
    return app


def _v1_routes(state: ServerState) -> APIRouter:
    router, served = APIRouter(prefix="/v1"), state.models

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [served.card(name) for name in served.names()]}

    @router.get("/models/{model:path}")
    async def model(model: str):
        return served.card(model)

    @router.post("/completions")
    async def completions(request: Request):
        return await _generate(create_completion, request, state)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(create_chat_completion, request, state)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _require_api_key(state)
        req = await parse_request(request, LoadLoraAdapterRequest, state.config, {})
        return await served.load(req.lora_name, req.lora_path)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _require_api_key(state)
        req = await parse_request(request, UnloadLoraAdapterRequest, state.config, {})
        return served.unload(req.lora_name)

    return router


def _require_api_key(state: ServerState) -> None:
    """Loading reads the server's files: only clients holding the API key may, so a server without one refuses."""
    if state.config.api_key is None:
        raise APIError(403, "loading and unloading LoRA adapters needs a server started with an API key "
                            "(--api-key or KILN_API_KEY)", "adapter_loading_disabled")


async def _generate(handler, request: Request, state: ServerState):
    try:
        return await handler(request, state)
    except ClientDisconnected:
        request.state.outcome = "client disconnected"
        return Response(status_code=CLIENT_CLOSED)


def _plain_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    page = resources.files("kiln.server").joinpath("static/index.html").read_text(encoding="utf-8")

    @router.get("/health")
    async def health():
        if state.admission.draining:
            raise shutting_down()
        if not state.llm.healthy():
            raise APIError(503, "the engine loop has stopped", "engine_unavailable")
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @router.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(page)

    return router
