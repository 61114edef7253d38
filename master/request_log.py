"""One structured line per request when it ends, and the recent ones kept for the status page.

The relay calls :meth:`RequestLog.record` once per request (``Relay.on_end``). The line carries
what an operator asks about one request: its id and the client's ``X-Request-Id``, the P and D
that served it and why they were chosen, how much of the prompt was cached or moved, TTFT, TPOT,
and how it ended. ``--log-format json`` makes every line of the master's log one JSON object
(:class:`JSONFormatter`); the request line's fields then sit at the top level of the object.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from master.errors import bad_request

if TYPE_CHECKING:
    from master.registry import Registry
    from master.relay import RelayRequest

logger = logging.getLogger("master.requests")

#: Ended requests kept for the status page (recent errors and routing decisions).
RECENT_REQUESTS = 200
#: Header a client (or a proxy in front of the master) may send to follow its request through the
#: logs; the answer carries it back (without one: the master's own id).
REQUEST_ID_HEADER = "X-Request-Id"
#: What a client's X-Request-Id may be: it goes into log lines and response headers as it is.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
#: The LogRecord attribute that carries a request's fields to :class:`JSONFormatter`.
FIELDS_ATTR = "request_fields"
#: The LogRecord attribute naming the line's event (``request`` when absent; ``rejected`` for
#: requests answered with an error before being served, see :mod:`master.rejections`).
EVENT_ATTR = "request_event"


@dataclass
class RequestRecord:
    """What one request did, from arrival to its end."""

    request_id: str
    client_request_id: str | None
    outcome: str
    finish_reason: str | None
    error: str | None
    prefill: str | None
    decode: str | None
    attempts: int
    #: ``pd`` (a prefill node, then the decode node) or ``local`` (prefilled where it decodes).
    path: str | None
    #: Why that path: mixed, no_prefill, short_miss, long_miss, pd_faster, tpot_slo, local_disabled.
    route_reason: str | None
    routing: str
    prompt_tokens: int
    cached_tokens: int  # found in P's prefix cache
    decode_hit_tokens: int  # D already held: not moved
    transferred_tokens: int
    transfer_bytes: int
    completion_tokens: int
    ttft_s: float | None
    #: TTFT's parts: arrival to the (last) attempt's dispatch (template, tokenizing, queueing, retries),
    #: and the node's own from taking the job to sending the first token; the rest is transit.
    dispatch_s: float | None
    node_ttft_s: float | None
    #: Of a prefill node's share: its prefix query to the decode node, and its engine's prefill
    #: (the prompt queued to its first token); None where D prefilled the request itself.
    prefix_query_s: float | None
    prefill_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    stream: bool
    ended_at: float  # wall clock (epoch seconds)
    #: Leases a decode node refused it for want of room (it waited again; not counted in ``attempts``).
    refusals: int = 0
    #: Seconds it waited in the admission queue for a decode node with room (None: it never
    #: waited), and why it waited last: decode_full, kv_full, decode_refused, rerun, behind_queue.
    queue_wait_s: float | None = None
    wait_reason: str | None = None
    #: The client's API key by name (:meth:`master.auth.ApiKeys.name_of`), never the key itself.
    key: str | None = None

    def as_dict(self) -> dict[str, Any]:
        # Every field is a plain value: a shallow copy is asdict's result without its deep copy.
        return dict(vars(self))

    def text(self) -> str:
        """The ``key=value`` form of the text log."""
        return "request " + key_value_text(self.as_dict(), skip=("ended_at",))


def key_value_text(fields: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """``key=value`` pairs of a line's fields (None left out, floats to 0.1 ms, strings with spaces
    or quotes quoted as JSON), readable back by :func:`parse_text_line`."""
    parts = []
    for key, value in fields.items():
        if key in skip or value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif isinstance(value, str) and (not value or any(c in value for c in ' "=')):
            value = json.dumps(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


_TEXT_LINE = re.compile(r"\brequest (request_id=.*)$")
_TEXT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_text_line(line: str) -> dict[str, str] | None:
    """The fields of one text-form request line (:meth:`RequestRecord.text`), values as written
    (quoted strings unquoted); None for any other line."""
    match = _TEXT_LINE.search(line)
    if match is None:
        return None
    return {key: json.loads(value) if value.startswith('"') else value
            for key, value in _TEXT_FIELD.findall(match.group(1))}


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Request-Id`` (None when it sent none); one that could garble a log line or a
    header (too long, spaces, quotes, control characters) is refused with a 400 that says what
    may be sent, rather than dropped without a word."""
    if value is None:
        return None
    if CLIENT_REQUEST_ID.fullmatch(value) is None:
        raise bad_request(f"{REQUEST_ID_HEADER} must be 1 to 128 characters of letters, digits and . _ : / + = @ -.",
                          None, "invalid_request_id")
    return value


class RequestLog:
    """Turns ended relay requests into :class:`RequestRecord` lines and keeps the latest ones."""

    def __init__(self, registry: Registry, policy: str, keep: int = RECENT_REQUESTS) -> None:
        self.registry = registry
        self.policy = policy
        self.recent: deque[RequestRecord] = deque(maxlen=keep)
        #: Called with each record (the status page's traffic history).
        self.on_record: list[Callable[[RequestRecord], None]] = []

    def record(self, r: RelayRequest) -> RequestRecord:
        record = self.build(r)
        self._count_transfer(record)
        self.recent.append(record)
        for listener in self.on_record:
            listener(record)
        level = logging.INFO if record.outcome == "ok" else logging.WARNING
        logger.log(level, "%s", record.text(), extra={FIELDS_ATTR: record.as_dict()})
        return record

    def build(self, r: RelayRequest) -> RequestRecord:
        first = r.first_token
        block_size = self._block_size(r.decode_id)
        prompt = len(r.token_ids)
        plan = r.plan
        local = plan is not None and plan.path == "local"
        if local:  # prefilled where it decodes: what its cache held, nothing moved
            hit = r.cached_tokens
        else:
            hit = min(first.hit_blocks_decode * block_size, prompt) if first is not None else 0
        # The first token report of the attempt that answered (a retried attempt's is cleared).
        reported = first is not None and r.node_ttft_s is not None and not local
        ttft = tpot = e2e = None
        if r.first_token_at is not None:
            ttft = r.first_token_at - r.arrival
            if r.finished_at is not None and r.completion_tokens > 1:
                tpot = (r.finished_at - r.first_token_at) / (r.completion_tokens - 1)
        if r.finished_at is not None:
            e2e = r.finished_at - r.arrival
        return RequestRecord(
            request_id=r.request_id,
            client_request_id=r.client_request_id,
            outcome=r.outcome or "error",
            finish_reason=r.finish_reason,
            error=r.failure.message if r.failure is not None else None,
            prefill=r.prefill_id,
            decode=r.decode_id,
            attempts=r.attempt,
            refusals=r.refused,
            queue_wait_s=_seconds(r.queue_wait_s) if r.wait_reason is not None else None,
            wait_reason=r.wait_reason,
            path=plan.path if plan is not None else None,
            route_reason=plan.reason if plan is not None else None,
            routing=self._reason(r, hit, prompt),
            prompt_tokens=prompt,
            cached_tokens=r.cached_tokens if not local else 0,
            decode_hit_tokens=hit,
            transferred_tokens=prompt - hit if first is not None else 0,
            transfer_bytes=first.transfer_bytes if first is not None else 0,
            completion_tokens=r.completion_tokens,
            ttft_s=_seconds(ttft),
            dispatch_s=_seconds(r.dispatched_at - r.arrival) if r.dispatched_at is not None else None,
            node_ttft_s=_seconds(r.node_ttft_s),
            prefix_query_s=_seconds(first.prefix_query_s) if reported else None,
            prefill_s=_seconds(first.prefill_s) if reported else None,
            tpot_s=_seconds(tpot),
            e2e_s=_seconds(e2e),
            stream=r.stream,
            ended_at=time.time(),
            key=r.key_name,
        )

    def _block_size(self, decode_id: str | None) -> int:
        node = self.registry.get(decode_id) if decode_id else None
        spec = node.info.kv_spec if node is not None else self.registry.cluster_spec
        return spec.block_size if spec is not None else 1

    def _reason(self, r: RelayRequest, hit: int, prompt: int) -> str:
        """Why this pair, in a phrase: the policy, whether the pair was warm, what D held, retries."""
        if not r.dispatched:
            return "not routed: no pair could take it"
        parts = [self.policy]
        plan = r.plan
        if plan is not None:
            parts.append(f"{'prefilled on D' if plan.path == 'local' else 'P -> D'} ({plan.reason.replace('_', ' ')})")
            if plan.cost_s is not None:
                parts.append(f"priced {plan.cost_s * 1000:.1f} ms")
        prefill = self.registry.get(r.prefill_id) if r.prefill_id else None
        if prefill is not None:
            parts.append("warm pair" if prefill.warm_with(r.decode_id or "") else "cold pair")
        if r.first_token is not None or (plan is not None and plan.path == "local" and r.first_token_at is not None):
            parts.append(f"D held {hit}/{prompt} prompt tokens")
        if r.attempt > 1:
            parts.append(f"attempt {r.attempt} after {', '.join(sorted(r.excluded)) or 'a failure'}")
        return "; ".join(parts)

    def _count_transfer(self, record: RequestRecord) -> None:
        """KV bytes each node moved: P sent them, D received them (shown per node by the admin API)."""
        if not record.transfer_bytes:
            return
        for node_id in (record.prefill, record.decode):
            node = self.registry.get(node_id) if node_id else None
            if node is not None:
                node.kv_transfer_bytes += record.transfer_bytes


class JSONFormatter(logging.Formatter):
    """Every log record as one JSON object: time, level, logger, message, and a request's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, FIELDS_ATTR, None)
        if fields:
            doc["event"] = getattr(record, EVENT_ATTR, "request")
            doc.update(fields)
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def use_json_logs(root: logging.Logger | None = None) -> None:
    """Make every handler of the root logger write JSON lines (adding one if there is none)."""
    root = root or logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JSONFormatter())


class RequestIdMiddleware:
    """Answers a generation request with its id in ``X-Request-Id``, on success, error and
    streamed answers alike: the client's own when it sent one (its request's log line and the
    nodes' job lines carry it beside the master's id), else the master's (the id its log line and
    the nodes' logs carry). The handler names the id in ``request.state.request_id``; requests
    without one pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                request_id = scope.get("state", {}).get("request_id")
                if request_id:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    headers.append((b"x-request-id", request_id.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
