"""The server's own ASGI ``send`` of an HTTP request, kept in its scope for a streamed body.

Every middleware between the server and a route that watches answers wraps ``send``: Starlette's
error and exception handlers, the request-id and the rejection-log middleware, five coroutines a
message. They read an answer's start (its status and headers) and an error's body, and none of
them changes a body. A stream writes a body message for every token of every client, so those
wrappers were a good part of the master's CPU a token; its body messages go straight to the
server's ``send`` (:func:`body_send`), while its start still passes every middleware.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

#: The scope key of the server's ``send`` (an HTTP request's scope only).
SERVER_SEND = "pd_cluster.server_send"


class MasterApp(FastAPI):
    """The master's app: keeps the server's ``send`` in each HTTP request's scope."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def body_send(scope: Scope, send: Send) -> Send:
    """Where a 200 answer's body messages go, once its start went through ``send``: the server's
    own ``send`` when the app kept it, else ``send``."""
    return scope.get(SERVER_SEND, send)
