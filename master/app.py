"""Builds the master's FastAPI app: OpenAI API, node websocket, admin API, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, WebSocket

from master import admin, openai_api, status_page
from master.auth import ApiKeys, blank, read_keys_file
from master.body_limit import BodyLimitMiddleware
from master.config import MasterSettings
from master.context import MasterContext
from master.errors import install_error_handlers
from master.key_counts import KEY_COUNTS_ENV, KeyCounts, LocalKeyCounts, SharedKeyCounts
from master.load_mix import LoadMix
from master.metrics import MasterMetrics, status_of_http
from master.model_info import ModelInfo, read_model_info
from master.node_metrics import NodeCollector
from master.node_ws import node_socket
from master.planner_loop import PlannerLoop
from master.registry import CLOSE_GOING_AWAY, Registry
from master.rejections import RejectionLogMiddleware
from master.relay import Relay
from master.request_log import RequestIdMiddleware, RequestLog
from master.routing import make_policy
from master.server_send import MasterApp
from master.tokenization import Tokenizer
from pd_cluster import protocol
from pd_cluster.default_model import resolve_model_path
from pd_cluster.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The master cannot start with these settings."""


#: The master's secrets, each with the variable that sets it and what to do instead of leaving it empty.
_SECRETS = {
    "cluster_token": ("PD_CLUSTER_TOKEN", "set it to the secret the nodes use"),
    "admin_token": ("PD_ADMIN_TOKEN", "set it to a secret, or unset it to keep the admin API closed"),
    "status_token": ("PD_STATUS_TOKEN", "set it to a secret, or unset it to open the status page with the admin "
                                        "token only"),
}


def check_secrets(settings: MasterSettings) -> None:
    """Fail closed: a secret that is set but empty (or only whitespace) stops the master, since a
    bearer header with nothing after it would carry it. The message names the variable, never a value."""
    if settings.cluster_token is None:
        raise ConfigError("the master needs a cluster token: set PD_CLUSTER_TOKEN (nodes must use the same one)")
    for name, (variable, instead) in _SECRETS.items():
        if blank(getattr(settings, name)):
            raise ConfigError(f"{variable} is set but empty: {instead} (e.g. `openssl rand -hex 24`)")


def api_keys_from(settings: MasterSettings) -> ApiKeys:
    """The client keys of ``--api-key`` and ``--api-keys-file`` (a key's own limit wins)."""
    limits: dict[str, int | None] = {key.get_secret_value(): None for key in settings.api_keys}
    if settings.api_keys_file is not None:
        try:
            limits.update(read_keys_file(settings.api_keys_file))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the API keys file: {exc}") from exc
    if any(not key.strip() for key in limits):
        raise ConfigError("an API key must not be empty")
    if limits:
        logger.info("clients must send one of %d API keys", len(limits))
    return ApiKeys(limits, settings.max_concurrent_per_key, settings.retry_after_s, counts=key_counts_for(settings))


def key_counts_for(settings: MasterSettings) -> KeyCounts:
    """A worker of a master of several counts in the table its supervisor made, so a key's limit
    holds across the workers; a master of one process counts in its own."""
    table = os.environ.get(KEY_COUNTS_ENV)
    if settings.worker_index is None or not table:
        return LocalKeyCounts()
    return SharedKeyCounts(Path(table), settings.workers, settings.worker_index)


def create_app(settings: MasterSettings, tokenizer: Any = None) -> FastAPI:
    """Build a master app.

    ``tokenizer`` (a transformers tokenizer or a :class:`master.tokenization.Tokenizer`) skips
    loading one from the model directory; the model's config.json is still read when
    ``settings.model`` names a directory that has one. Without it the cluster's model name and
    KV shape are learned from the first node that joins.
    """
    check_secrets(settings)
    model: ModelInfo | None = None
    if tokenizer is None:
        path = resolve_model_path(settings.model)
        tokenizer = load_tokenizer(path)
        model = read_model_info(path)
    elif settings.model != "default" and (Path(settings.model).expanduser() / "config.json").is_file():
        model = read_model_info(Path(settings.model).expanduser())
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    if model is not None:
        logger.info("serving model %s (context %d)", model.name, model.max_model_len)

    metrics = MasterMetrics()
    registry = Registry(metrics, model, settings.node_outbox_frames)
    relay = Relay(registry, make_policy(settings.policy, settings.slo), metrics, settings)
    metrics.add_live(NodeCollector(registry))
    request_log = RequestLog(registry, settings.policy)
    relay.on_end.append(request_log.record)
    ctx = MasterContext(settings=settings, metrics=metrics, registry=registry, relay=relay, tokenizer=tok, model=model,
                        request_log=request_log)

    planner = None
    if settings.planner == "slo" and not settings.worker_index:
        mix = LoadMix(settings.planner_window_s, scale=settings.workers)
        relay.on_end.append(mix.record)
        planner = PlannerLoop(registry, metrics, settings, mix)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        planning = asyncio.create_task(planner.run()) if planner is not None else None
        yield
        if planning is not None:
            planning.cancel()
        for node_id in list(registry.nodes):
            registry.remove(node_id, "master shutting down", CLOSE_GOING_AWAY)
        tok.close()

    app = MasterApp(title="pd-cluster master", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: openai_api.openapi_document(app)  # type: ignore[method-assign]
    app.state.ctx = ctx
    app.state.api_keys = api_keys_from(settings)
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(admin.router)
    status_page.install(app, ctx)

    async def nodes_endpoint(websocket: WebSocket) -> None:
        await node_socket(websocket, ctx)

    app.add_api_websocket_route(protocol.NODE_WS_PATH, nodes_endpoint)
    def count_refused(path: str, status: int) -> None:
        if path in openai_api.GENERATION_PATHS:
            metrics.requests_total.labels(status=status_of_http(status)).inc()

    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       on_refused=count_refused)
    app.add_middleware(RejectionLogMiddleware, metrics=metrics)  # outermost: sees every answer
    return app
