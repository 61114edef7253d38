"""A node's lifecycle (serving -> draining -> drained) and its small local status server.

Kubernetes probes read ``/livez`` and ``/readyz``; the preStop hook (``pd-cluster node-drain``)
posts ``/drain`` from inside the pod and polls until the node has finished its requests.
SIGTERM starts the same drain.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal

logger = logging.getLogger(__name__)


class NodeLifecycle:
    def __init__(self) -> None:
        self.registered = asyncio.Event()
        self.draining = False
        self.drain_requested = asyncio.Event()
        self.drained = asyncio.Event()

    def request_drain(self, why: str) -> None:
        if not self.draining:
            logger.info("draining (%s): no new work; leaving once running requests end", why)
        self.draining = True
        self.drain_requested.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_drain, signal.Signals(sig).name)
            except (NotImplementedError, RuntimeError):  # not the main thread (e.g. a Ray actor)
                pass


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def status_app(lifecycle: NodeLifecycle, node_id: str, role: str):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title=f"pd-cluster {role} node", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/livez")
    async def livez() -> dict:
        return {"status": "alive", "node_id": node_id, "role": role}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = lifecycle.registered.is_set() and not lifecycle.draining
        return JSONResponse({"ready": ready, "draining": lifecycle.draining}, status_code=200 if ready else 503)

    @app.post("/drain")
    async def drain(request: Request) -> JSONResponse:
        if not _is_loopback(request.client.host if request.client else None):
            return JSONResponse({"error": "drain is accepted from this host only"}, status_code=403)
        lifecycle.request_drain("local drain request")
        return JSONResponse({"draining": True, "done": lifecycle.drained.is_set()})

    @app.get("/drain")
    async def drain_state() -> dict:
        return {"draining": lifecycle.draining, "done": lifecycle.drained.is_set()}

    return app


async def serve_status(lifecycle: NodeLifecycle, node_id: str, role: str, host: str, port: int):
    """Start the status server as a task (nothing when port is 0); returns the uvicorn server."""
    if not port:
        return None
    import uvicorn

    config = uvicorn.Config(status_app(lifecycle, node_id, role), host=host, port=port, log_level="warning",
                            access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the node owns signals
    asyncio.get_running_loop().create_task(server.serve())
    return server
