"""Running the app under uvicorn with a graceful stop: on SIGINT/SIGTERM (or stop()) new requests get 503,
in-flight ones may finish for `shutdown_timeout` seconds; then Kiln ends the rest itself (their generations
aborted, KV blocks freed): a plain request answers 503 with an OpenAI error body, a stream sends an error event
and `[DONE]`. uvicorn cancels only what is still running GRACE_SECONDS later (a plain-text 500, a cut stream)."""
from __future__ import annotations

import asyncio
import ipaddress
import logging

import uvicorn

from .app import create_app
from .config import ServerConfig

GRACE_SECONDS = 5.0
logger = logging.getLogger("kiln.server")


class KilnServer(uvicorn.Server):
    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
                 log_level: str = "info"):
        config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout + GRACE_SECONDS,
                                access_log=False, log_level=log_level, lifespan="on")
        super().__init__(config)
        self.admission, self.shutdown_timeout = app.state.kiln.admission, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        self.admission.draining = True
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Begin the graceful shutdown (from any thread)."""
        self.admission.draining = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.admission.draining = True
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.admission.stop_all)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to give when anyone beyond this machine could use the server without a key."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"serving on {host} WITHOUT AN API KEY: anyone who can reach this address can use the model; "
            "pass --api-key or set KILN_API_KEY (or bind 127.0.0.1)")


def serve(llm, config: ServerConfig, host: str, port: int, shutdown_timeout: float) -> None:
    """Serve until interrupted; the LLM is shut down at the end. A LoRA adapter that cannot be served stops this
    before the port is bound (ValueError naming it)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln.server").setLevel(logging.INFO)
    warning = exposure_warning(host, config.api_key)
    if warning:
        logger.warning(warning)
    try:
        app = create_app(llm, config, owns_llm=True)
    except BaseException:
        llm.shutdown()
        raise
    KilnServer(app, host, port, shutdown_timeout).run()
