"""The websocket where nodes join, report and receive work (``protocol.NODE_WS_PATH``).

One connection per node. The node and the master first prove to each other that they hold the
cluster token (:mod:`master.node_auth`); then the node's next frame must be Register; after
that every frame is dispatched to the registry or the relay. A node that sends no status for
``heartbeat_timeout_s`` is dropped. Frames to the node go through its outbox and a writer task,
so the rest of the master never waits on a slow socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from urllib.parse import urlsplit

from starlette.websockets import WebSocket

from master.context import MasterContext
from master.delta_frames import plain_deltas
from master.node_auth import authenticate_node
from master.node_frames import frame_reader
from master.registry import CLOSE_NORMAL, CLOSE_POLICY_VIOLATION, CloseFrame, NodeRecord
from pd_cluster.aio import wait_for
from pd_cluster import protocol

logger = logging.getLogger(__name__)

#: Longest wait in one receive call; the loop re-checks heartbeats and removal between calls.
_RECEIVE_SLICE_S = 1.0
#: Longest wait for the writer to flush the close frame when a connection ends.
_CLOSE_GRACE_S = 2.0
#: Malformed frames of one node logged one by one; after that, every thousandth.
_LOGGED_MALFORMED = 10
#: Frames that carry a request's output or its fate: one dropped would leave a gap in an answer, so
#: the requests it names are ended with an error instead.
_REQUEST_FRAMES = frozenset({"first_token", "token_delta", "token_deltas", "request_failed", "kv_transferred"})


async def _receive_frame(ws: WebSocket) -> str | bytes | None:
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    return text if text is not None else message.get("bytes", b"")


async def _refuse(ws: WebSocket, reason: str, retryable: bool = False) -> None:
    refused = protocol.Refused(reason=reason, retryable=retryable)
    with contextlib.suppress(Exception):
        await wait_for(ws.send_text(protocol.encode(refused)), _CLOSE_GRACE_S)
        await wait_for(ws.close(CLOSE_POLICY_VIOLATION, reason[:120]), _CLOSE_GRACE_S)


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= 300 else text[:300] + "..."


async def node_socket(ws: WebSocket, ctx: MasterContext) -> None:
    settings = ctx.settings
    await ws.accept()
    proven_id = await authenticate_node(ws, settings.cluster_token, ctx.relay.instance_id, settings.register_timeout_s)
    if proven_id is None:
        return
    try:
        frame = await wait_for(_receive_frame(ws), settings.register_timeout_s)
    except asyncio.TimeoutError:
        await _refuse(ws, "no register frame")
        return
    except Exception:
        return
    if frame is None:
        return
    try:
        msg = protocol.parse_node_message(frame)
    except ValueError as exc:
        logger.warning("refused a node from %s: malformed register frame: %s", ws.client, _short(exc))
        await _refuse(ws, "malformed register frame")
        return
    if not isinstance(msg, protocol.Register):
        await _refuse(ws, "the first frame must be register")
        return
    if msg.node_id != proven_id:
        await _refuse(ws, f"registers as {msg.node_id!r} but proved the cluster token as {proven_id!r}")
        return
    reason = ctx.registry.refusal(msg)
    if reason is not None:
        logger.warning("refused node %s (%s): %s", msg.node_id, msg.role, reason)
        # A removed id may be allowed again, and a held id freed: the node keeps knocking.
        retryable = msg.node_id in ctx.registry.nodes or msg.node_id in ctx.registry.banned
        await _refuse(ws, reason, retryable=retryable)
        return

    record = ctx.registry.add(msg)
    writer = asyncio.create_task(_writer(ws, record, ctx), name=f"node-writer-{msg.node_id}")
    record.send(protocol.Registered(node_id=msg.node_id, master_id=ctx.relay.instance_id,
                                    masters=_worker_urls(ws, ctx)))
    if record.role == "prefill":
        record.send(ctx.registry.decode_peers())  # so it warms its channels before any request
    reader = frame_reader(ws.scope)
    if reader is not None:  # frames applied as they are read, ahead of the loop's other steps
        reader.on_frame = functools.partial(_read_frame, ctx, record)
    try:
        await _read_loop(ws, record, ctx)
    finally:
        if reader is not None:
            reader.on_frame = None
        ctx.registry.discard(record, "connection closed")
        try:
            await wait_for(writer, _CLOSE_GRACE_S)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
            writer.cancel()


def _worker_urls(ws: WebSocket, ctx: MasterContext) -> list[str]:
    """Every worker's private URL, for a node that dialled the public port of a master of several
    workers (none otherwise): reached through the host the node dialled, so that it holds behind
    DNS names, or the advertised host."""
    settings = ctx.settings
    server = ws.scope.get("server")
    if settings.worker_index is None or not server or server[1] != settings.port:
        return []
    host = urlsplit("//" + ws.headers.get("host", "")).hostname or str(server[0])
    scheme = "https" if settings.tls_cert is not None else "http"
    return settings.worker_urls(host, scheme)


async def _read_loop(ws: WebSocket, record: NodeRecord, ctx: MasterContext) -> None:
    timeout = ctx.settings.heartbeat_timeout_s
    while not record.removed:
        remaining = timeout - (time.monotonic() - record.last_status_at)
        if remaining <= 0:
            logger.warning("node %s missed its heartbeats for %.1f s", record.node_id, timeout)
            ctx.registry.discard(record, "missed heartbeats", CLOSE_NORMAL)
            return
        try:
            frame = await wait_for(_receive_frame(ws), min(remaining, _RECEIVE_SLICE_S))
        except asyncio.TimeoutError:
            continue
        except Exception as exc:  # the socket broke under us
            logger.info("node %s socket error: %s", record.node_id, _short(exc))
            return
        if frame is None:
            return
        if record.removed:
            return
        handle_frame(ctx, record, frame)


def _read_frame(ctx: MasterContext, record: NodeRecord, frame: str) -> None:
    """A frame handed over by the socket's read (:mod:`master.node_frames`): applied as
    :func:`_read_loop` applies one, a frame of a removed node dropped; a frame whose handling
    raises ends the node's link, as it ends the read loop."""
    if record.removed:
        return
    try:
        handle_frame(ctx, record, frame)
    except Exception:
        logger.exception("handling a frame from node %s failed", record.node_id)
        ctx.registry.discard(record, "a frame could not be handled", CLOSE_POLICY_VIOLATION)


def handle_frame(ctx: MasterContext, record: NodeRecord, frame: str | bytes) -> None:
    """Apply one frame from a registered node. A frame that cannot be parsed, or whose handling
    raises, is logged and dropped, and the requests it was about end with an error that says so:
    their streams never go on with tokens missing."""
    plain = plain_deltas(frame)
    if plain is not None:  # the hot frame, most of the time (see master.delta_frames)
        for delta in plain:
            try:
                if isinstance(delta, protocol.TokenDelta):  # a first delta with its prefill report
                    ctx.relay.on_token_delta(record, delta)
                else:
                    ctx.relay.on_plain_delta(record, delta)
            except Exception as exc:
                request_id = delta.request_id if isinstance(delta, protocol.TokenDelta) else delta[0]
                _not_applied(ctx, record, "token_delta", request_id, exc)
        return
    try:
        msg = protocol.parse_node_message(frame)
    except ValueError as exc:
        record.malformed_frames += 1
        count = record.malformed_frames
        if count <= _LOGGED_MALFORMED or count % 1000 == 0:
            logger.warning("dropped malformed frame #%d from node %s: %s", count, record.node_id, _short(exc))
        kind, request_ids = _named_requests(frame)
        for request_id in request_ids:
            ctx.relay.fail_unapplied(record, request_id, f"{record.role} node {record.node_id} sent a malformed "
                                                         f"{kind} report for it")
        return
    if isinstance(msg, protocol.TokenDeltas):
        for delta in msg.deltas:  # one request's failure leaves the others' tokens flowing
            try:
                ctx.relay.on_token_delta(record, delta)
            except Exception as exc:
                _not_applied(ctx, record, delta.type, delta.request_id, exc)
        return
    try:
        if isinstance(msg, protocol.NodeStatus):
            ctx.registry.handle_status(record, msg)
            ctx.relay.on_status(record, msg)
        elif isinstance(msg, protocol.TokenDelta):
            ctx.relay.on_token_delta(record, msg)
        elif isinstance(msg, protocol.FirstToken):
            ctx.relay.on_first_token(record, msg)
        elif isinstance(msg, protocol.KVEvents):
            ctx.registry.handle_kv_events(record, msg)
        elif isinstance(msg, protocol.RequestFailed):
            ctx.relay.on_request_failed(record, msg)
        elif isinstance(msg, protocol.KVTransferred):
            ctx.relay.on_kv_transferred(record, msg)
        elif isinstance(msg, protocol.Drained):
            ctx.registry.discard(record, "drained", CLOSE_NORMAL)
        elif isinstance(msg, protocol.RoleChanged):
            ctx.registry.handle_role_changed(record, msg)
        else:
            logger.warning("dropped an unexpected %s frame from node %s", type(msg).__name__, record.node_id)
    except Exception as exc:
        _not_applied(ctx, record, getattr(msg, "type", type(msg).__name__), getattr(msg, "request_id", None), exc)


def _not_applied(ctx: MasterContext, record: NodeRecord, kind: str, request_id: object, exc: Exception) -> None:
    """Applying a frame of ``kind`` raised: log it, and end the request it is about with the cause
    (its output would go on with a piece missing)."""
    logger.error("handling a %s frame from node %s failed", kind, record.node_id, exc_info=exc)
    if isinstance(request_id, str):
        cause = (f"the master could not apply {record.role} node {record.node_id}'s {kind} report for it "
                 f"({type(exc).__name__})")
        ctx.relay.fail_unapplied(record, request_id, cause)


def _named_requests(frame: str | bytes) -> tuple[str, list[str]]:
    """The type of a frame that failed to parse and, for a frame about requests, the request ids it
    names (read as plain JSON; none when even that fails)."""
    try:
        doc = json.loads(frame)
    except (ValueError, RecursionError):
        return "unreadable", []
    kind = doc.get("type") if isinstance(doc, dict) else None
    if kind not in _REQUEST_FRAMES:
        return str(kind), []
    items = doc.get("deltas") if kind == "token_deltas" else [doc]
    items = items if isinstance(items, list) else []
    return kind, [i["request_id"] for i in items if isinstance(i, dict) and isinstance(i.get("request_id"), str)]


async def _writer(ws: WebSocket, record: NodeRecord, ctx: MasterContext) -> None:
    send_timeout = ctx.settings.node_send_timeout_s
    try:
        while True:
            item = await record.outbox.get()
            if isinstance(item, CloseFrame):
                with contextlib.suppress(Exception):
                    await wait_for(ws.close(item.code, item.reason[:120]), send_timeout)
                return
            await wait_for(ws.send_text(item), send_timeout)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("sending to node %s failed: %s", record.node_id, _short(exc))
        ctx.registry.discard(record, "send failed")
