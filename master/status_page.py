"""The live status page: ``/status`` (HTML + JS in master/static/) and the JSON it polls.

What it shows comes from state the master already keeps: the registry (the nodes table, as the
admin API shows it) and the requests as they end (``Relay.on_end``), folded into
:class:`TrafficHistory`: per-interval counts, KV bytes moved and latency samples over the last
minutes, plus the latest requests for the errors and routing tables.

Access: the admin token, or a read-only status token (``PD_STATUS_TOKEN``) that shows the page
and nothing else. A browser cannot send a bearer header when it opens a page, so ``/status``
asks for the token once (a form, or ``/status?token=...``) and keeps a cookie derived from it
(HttpOnly, SameSite=Strict); scripts may send ``Authorization: Bearer`` to ``/status/data``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from master.admin import node_view
from master.auth import bearer_matches
from master.request_log import RequestRecord

if TYPE_CHECKING:
    from pydantic import SecretStr

    from master.context import MasterContext

STATIC = Path(__file__).parent / "static"
COOKIE = "pd_status"
#: Width of one point of the charts, and how many are kept (10 minutes).
BUCKET_S = 5.0
BUCKETS = 120
#: Latency samples kept per bucket (a bounded reservoir: percentiles stay cheap at any rate).
SAMPLES_PER_BUCKET = 256
#: The window the headline numbers (requests/s, percentiles) are computed over.
HEADLINE_S = 60.0
RECENT_ROWS = 20


@dataclass
class Bucket:
    start: float
    requests: int = 0
    errors: int = 0
    transfer_bytes: int = 0
    completion_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class TrafficHistory:
    """Ended requests folded into fixed-width time buckets, and the latest ones kept whole."""

    def __init__(self, bucket_s: float = BUCKET_S, buckets: int = BUCKETS) -> None:
        self.bucket_s = bucket_s
        self.buckets: deque[Bucket] = deque(maxlen=buckets)
        self.recent: deque[RequestRecord] = deque(maxlen=200)

    def add(self, record: RequestRecord, now: float | None = None) -> None:
        now = time.time() if now is None else now
        bucket = self._bucket(now)
        bucket.requests += 1
        bucket.errors += record.outcome != "ok"
        bucket.transfer_bytes += record.transfer_bytes
        bucket.completion_tokens += record.completion_tokens
        for samples, value in ((bucket.ttft, record.ttft_s), (bucket.tpot, record.tpot_s)):
            if value is not None and len(samples) < SAMPLES_PER_BUCKET:
                samples.append(value)
        self.recent.append(record)

    def _bucket(self, now: float) -> Bucket:
        start = math.floor(now / self.bucket_s) * self.bucket_s
        if not self.buckets or self.buckets[-1].start < start:
            self.buckets.append(Bucket(start))
        return self.buckets[-1]

    def series(self, now: float | None = None) -> dict[str, Any]:
        """One point per bucket over the whole window (empty buckets included), oldest first."""
        now = time.time() if now is None else now
        last = math.floor(now / self.bucket_s) * self.bucket_s
        first = last - ((self.buckets.maxlen or BUCKETS) - 1) * self.bucket_s
        by_start = {b.start: b for b in self.buckets}
        points = []
        start = first
        while start <= last:
            b = by_start.get(start) or Bucket(start)
            points.append({
                "t": start,
                "requests_per_s": b.requests / self.bucket_s,
                "errors_per_s": b.errors / self.bucket_s,
                "kv_bytes_per_s": b.transfer_bytes / self.bucket_s,
                "tokens_per_s": b.completion_tokens / self.bucket_s,
                "ttft_p50": percentile(b.ttft, 0.5),
                "ttft_p99": percentile(b.ttft, 0.99),
                "tpot_p50": percentile(b.tpot, 0.5),
            })
            start += self.bucket_s
        return {"bucket_s": self.bucket_s, "points": points}

    def headline(self, now: float | None = None, window_s: float = HEADLINE_S) -> dict[str, Any]:
        now = time.time() if now is None else now
        since = now - window_s
        recent = [b for b in self.buckets if b.start + self.bucket_s > since]
        ttft = [v for b in recent for v in b.ttft]
        tpot = [v for b in recent for v in b.tpot]
        requests = sum(b.requests for b in recent)
        return {
            "window_s": window_s,
            "requests_per_s": requests / window_s,
            "error_ratio": sum(b.errors for b in recent) / requests if requests else None,
            "kv_bytes_per_s": sum(b.transfer_bytes for b in recent) / window_s,
            "tokens_per_s": sum(b.completion_tokens for b in recent) / window_s,
            "ttft_s": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99)},
            "tpot_s": {"p50": percentile(tpot, 0.5), "p90": percentile(tpot, 0.9), "p99": percentile(tpot, 0.99)},
        }


def _row(record: RequestRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in (
        "ended_at", "request_id", "client_request_id", "outcome", "finish_reason", "error", "prefill", "decode",
        "attempts", "routing", "prompt_tokens", "decode_hit_tokens", "transferred_tokens", "ttft_s", "e2e_s")}


# ---- access ------------------------------------------------------------------------------------


def _session(token: SecretStr) -> str:
    """The cookie for a token: a keyed digest, so the cookie is not the token itself."""
    return hmac.new(token.get_secret_value().encode(), b"pd-cluster status page", hashlib.sha256).hexdigest()


def _tokens(ctx: MasterContext) -> list[SecretStr]:
    return [t for t in (ctx.settings.admin_token, ctx.settings.status_token) if t is not None and t.get_secret_value()]


def _allowed(request: Request, ctx: MasterContext) -> bool:
    tokens = _tokens(ctx)
    if any(bearer_matches(request.headers.get("authorization"), t) for t in tokens):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return any(hmac.compare_digest(cookie, _session(t)) for t in tokens) if cookie else False


def _matching(ctx: MasterContext, given: str) -> SecretStr | None:
    return next((t for t in _tokens(ctx) if hmac.compare_digest(given.encode(), t.get_secret_value().encode())), None)


def _with_session(token: SecretStr, request: Request) -> Response:
    response = RedirectResponse("/status", status_code=303)
    response.set_cookie(COOKIE, _session(token), httponly=True, samesite="strict", path="/status",
                        secure=request.url.scheme == "https")
    return response


def _login_page(ctx: MasterContext, message: str = "", status: int = 401) -> HTMLResponse:
    if not _tokens(ctx):
        message = "The status page is off: start the master with PD_ADMIN_TOKEN or PD_STATUS_TOKEN."
    html = (STATIC / "login.html").read_text().replace("{{message}}", message)
    return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})


# ---- routes ------------------------------------------------------------------------------------


router = APIRouter(prefix="/status")


def _ctx(request: Request) -> MasterContext:
    return request.app.state.ctx


@router.get("", response_model=None)
async def status_page(request: Request, token: str | None = None) -> Response:
    ctx = _ctx(request)
    if token is not None:
        matched = _matching(ctx, token)
        return _with_session(matched, request) if matched else _login_page(ctx, "Wrong token.")
    if not _allowed(request, ctx):
        return _login_page(ctx)
    return FileResponse(STATIC / "status.html", headers={"Cache-Control": "no-store"})


@router.post("/login", response_model=None)
async def login(request: Request) -> Response:
    ctx = _ctx(request)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    matched = _matching(ctx, (form.get("token") or [""])[0].strip())
    return _with_session(matched, request) if matched else _login_page(ctx, "Wrong token.")


@router.get("/static/{name}", response_model=None)
async def asset(name: str, request: Request) -> Response:
    path = STATIC / name
    if name not in {"status.js", "status.css"} or not path.is_file():
        return Response(status_code=404)
    return FileResponse(path)


@router.get("/data", response_model=None)
async def data(request: Request) -> Response:
    ctx = _ctx(request)
    if not _allowed(request, ctx):
        return JSONResponse({"error": {"message": "Missing or wrong token.", "type": "authentication_error"}}, 401)
    return JSONResponse(snapshot(ctx, request.app.state.traffic), headers={"Cache-Control": "no-store"})


def snapshot(ctx: MasterContext, traffic: TrafficHistory, now: float | None = None) -> dict[str, Any]:
    """Everything the page shows, as one JSON document."""
    now = time.time() if now is None else now
    registry = ctx.registry
    nodes = sorted(registry.nodes.values(), key=lambda n: (n.role, n.node_id))
    recent = list(traffic.recent)
    return {
        "now": now,
        # With several masters each page shows the traffic of the one that answered: it says which.
        "master": f"{socket.gethostname()}:{ctx.settings.port}",
        "model": ctx.model_name,
        "policy": ctx.settings.policy,
        "health": {
            "prefill_nodes": len(registry.active("prefill")),
            "decode_nodes": len(registry.active("decode")),
            "mixed_nodes": len(registry.active("mixed")),
            "warm_pairs": registry.warm_pairs(),
            "queued_requests": len(ctx.relay.queue),
            "running_requests": len(ctx.relay.requests),
        },
        "nodes": [node_view(n) for n in nodes],
        "headline": traffic.headline(now),
        "series": traffic.series(now),
        "errors": [_row(r) for r in reversed(recent) if r.outcome != "ok"][:RECENT_ROWS],
        "routing": [_row(r) for r in reversed(recent) if r.decode is not None][:RECENT_ROWS],
    }


def install(app: FastAPI, ctx: MasterContext) -> TrafficHistory:
    """Serve the page from ``app`` and feed it every request as it ends."""
    traffic = TrafficHistory()
    app.state.traffic = traffic
    ctx.request_log.on_record.append(traffic.add)
    app.include_router(router)
    return traffic
