"""Running the app under uvicorn with a graceful stop: on SIGINT/SIGTERM (or stop()) new requests get 503,
in-flight ones may finish for `shutdown_timeout` seconds, then the rest are cancelled (their generations
aborted, KV blocks freed) and the LLM shuts down."""
from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .config import ServerConfig


class KilnServer(uvicorn.Server):
    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
                 log_level: str = "info"):
        config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout,
                                access_log=False, log_level=log_level, lifespan="on")
        super().__init__(config)
        self.admission = app.state.kiln.admission

    def handle_exit(self, sig, frame) -> None:
        self.admission.draining = True
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Begin the graceful shutdown (from any thread)."""
        self.admission.draining = True
        self.should_exit = True


def serve(llm, config: ServerConfig, host: str, port: int, shutdown_timeout: float) -> None:
    """Serve until interrupted; the LLM is shut down at the end."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.server").setLevel(logging.INFO)
    KilnServer(create_app(llm, config, owns_llm=True), host, port, shutdown_timeout).run()
