"""One structured line for every request answered with an error before (or instead of) the relay
serving it: a 400 a body could not pass, a 401, a 404 of an unknown model or route, a 413, a 429,
a 503 while no node has joined. Served requests get their line from :mod:`master.request_log`
when they end; these never reach the relay, so without this an operator debugging a client's
failure would find nothing in the log. Each is also counted by reason in
``pdc_rejected_requests_total``.

The middleware reads the answer's own OpenAI error envelope (status, type, param, code), so every
route and every handler that answers an error is covered without each of them saying so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from master.metrics import MasterMetrics
from master.request_log import CLIENT_REQUEST_ID, EVENT_ATTR, FIELDS_ATTR, REQUEST_ID_HEADER, key_value_text

logger = logging.getLogger("master.requests")

#: The scope state key a handler sets once relay requests own the answer (they log it when they end).
RELAYED_STATE = "relayed"
#: The scope state key naming the client's API key (:meth:`master.auth.ApiKeys.name_of`), never the key.
KEY_NAME_STATE = "key_name"
#: Longest error body read back for the line (error envelopes are a few hundred bytes).
MAX_ERROR_BODY = 16384
#: Longest error message kept in the line (it may quote what the client sent).
MAX_MESSAGE = 300


@dataclass
class RejectedRecord:
    """A request answered with an error without being served."""

    status: int
    #: The error's ``code``, else its ``type``: what ``pdc_rejected_requests_total`` counts by.
    reason: str
    error_type: str | None
    param: str | None
    message: str | None
    method: str
    path: str
    client_request_id: str | None
    key: str | None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def text(self) -> str:
        return "rejected " + key_value_text(self.as_dict())


def record_of(scope: dict[str, Any], status: int, body: bytes) -> RejectedRecord | None:
    """The line of an answer with ``status`` and ``body``; None when it is no OpenAI error envelope
    (e.g. /health's 503 while the cluster forms)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict):
        return None
    state = scope.get("state", {})
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    client_id = headers.get(REQUEST_ID_HEADER.lower())
    if client_id is not None and CLIENT_REQUEST_ID.fullmatch(client_id) is None:
        client_id = None  # not one a line may carry (the answer says why)
    message = error.get("message")
    if isinstance(message, str) and len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return RejectedRecord(
        status=status, reason=str(error.get("code") or error.get("type") or f"http_{status}"),
        error_type=error.get("type"), param=error.get("param"), message=message,
        method=scope.get("method", ""), path=scope.get("path", ""),
        client_request_id=client_id, key=state.get(KEY_NAME_STATE),
    )


class RejectionLogMiddleware:
    """Logs and counts every error answer of a request the relay did not take over."""

    def __init__(self, app: Any, metrics: MasterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def watching_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < MAX_ERROR_BODY:
                body.extend(message.get("body", b"")[:MAX_ERROR_BODY - len(body)])
                if not message.get("more_body", False):
                    self._log(scope, status, bytes(body))
            await send(message)

        await self.app(scope, receive, watching_send)

    def _log(self, scope: dict[str, Any], status: int, body: bytes) -> None:
        if scope.get("state", {}).get(RELAYED_STATE):
            return
        record = record_of(scope, status, body)
        if record is None:
            return
        self.metrics.rejected_requests.labels(status=str(status), reason=record.reason).inc()
        level = logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, "%s", record.text(), extra={FIELDS_ATTR: record.as_dict(), EVENT_ATTR: "rejected"})
