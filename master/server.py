"""Entry point of the master process."""

from __future__ import annotations

import logging
from typing import Any

from master.app import ConfigError, api_keys_from, check_secrets, create_app
from master.config import MasterSettings
from master.heap import settle
from master.node_frames import NodeFrameProtocol
from master.request_log import use_json_logs
from master.workers import WorkerSupervisor, reuse_port_socket
from pd_cluster import protocol
from pd_cluster.aio import prepare_process
from pd_cluster.tls import server_context

__all__ = ["ConfigError", "create_app", "run_master", "run_worker"]

#: Headroom over the largest control message for websocket framing.
_WS_FRAME_SLACK = 64 * 1024

logger = logging.getLogger(__name__)


def tls_options(settings: MasterSettings) -> dict[str, str]:
    """uvicorn's TLS arguments (none: plain HTTP); the files are loaded once here, so that a bad
    certificate or key fails the start with a clear :class:`ConfigError`."""
    if settings.tls_cert is None or settings.tls_key is None:
        return {}
    try:
        server_context(settings.tls_cert, settings.tls_key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {settings.tls_cert} and its key: {exc}") from exc
    logger.info("serving HTTPS and wss:// (certificate %s)", settings.tls_cert)
    return {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}


def _logging(settings: MasterSettings) -> None:
    # A worker's lines name it: the workers of one master share its log.
    worker = "" if settings.worker_index is None else f"worker-{settings.worker_index} "
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s {worker}%(name)s: %(message)s"
        )
    if settings.log_format == "json":
        use_json_logs()  # uvicorn's own lines too: it then configures no handlers of its own


def uvicorn_options(settings: MasterSettings, tls: dict[str, str]) -> dict[str, Any]:
    """uvicorn's settings of a master process (one alone or one worker)."""
    import uvicorn

    return {
        "log_level": settings.log_level.lower(),
        "access_log": settings.access_log,
        "log_config": None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        "ws_max_size": protocol.MAX_MESSAGE_BYTES + _WS_FRAME_SLACK,
        # Node frames uncompressed: deflating a job of a thousand token ids took ~0.3 ms of the
        # loop, and every token frame paid an inflate, to save bytes on the cluster's own network.
        "ws_per_message_deflate": False,
        # Nodes' frames applied as they are read (master.node_frames).
        "ws": NodeFrameProtocol,
        "timeout_graceful_shutdown": int(settings.shutdown_timeout_s),
        **tls,
    }


def run_master(settings: MasterSettings | None = None) -> None:
    """Serve the master on ``settings.host:settings.port`` until interrupted; with
    ``settings.workers`` > 1, as that many supervised worker processes (:mod:`master.workers`).

    Raises :class:`ConfigError` when no cluster token is configured, a token is set but empty, or
    the TLS certificate (``settings.tls_cert``, ``settings.tls_key``: HTTPS and ``wss://``) cannot be
    loaded.
    """
    import uvicorn

    settings = settings if settings is not None else MasterSettings()
    _logging(settings)
    tls = tls_options(settings)
    if settings.workers > 1:
        check_secrets(settings)
        api_keys_from(settings)  # a bad keys file stops the start here, not in every worker
        WorkerSupervisor(settings, run_worker).run()
        return
    app = create_app(settings)
    prepare_process()
    settle(app.state.ctx.metrics)
    # On uvloop and httptools (dependencies; uvicorn picks them up itself).
    uvicorn.run(app, host=settings.host, port=settings.port, **uvicorn_options(settings, tls))


def run_worker(settings: MasterSettings) -> None:
    """One worker of a master of several: serves clients on the shared public port and nodes and
    sibling workers on its private port (``settings.worker_index`` says which)."""
    import uvicorn

    _logging(settings)
    tls = tls_options(settings)
    app = create_app(settings)
    prepare_process()
    settle(app.state.ctx.metrics)
    index = settings.worker_index or 0
    sockets = [reuse_port_socket(settings.host, settings.port), reuse_port_socket(settings.host,
                                                                                  settings.worker_port(index))]
    logger.info("worker %d serving on port %d (private port %d)", index, settings.port, settings.worker_port(index))
    uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings, tls))).run(sockets=sockets)
