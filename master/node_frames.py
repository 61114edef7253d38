"""uvicorn's websocket protocol, handing a registered node's frames to the master as they are read.

Through uvicorn's own protocol a node's frame took a trip: the frame went into the connection's
queue and reading paused (two epoll changes a frame) until the node's task woke, a loop round
later, and took it. Every task step that became ready in between (a new client request's parse,
tokenization and routing; a stream's start) ran first, and each token of the frame waited for
them. :class:`NodeFrameProtocol` calls the node's handler from the read itself, before any task
step of that round, once the handler asks for it (:func:`frame_reader`); frames before that, and
any while earlier ones still wait in the queue (their order kept), take the queue as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request

#: The ASGI extension (in the websocket scope) that holds the connection's protocol.
FRAME_READER = "pd_cluster.frame_reader"


class NodeFrameProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, with a text frame handed to :attr:`on_frame` when set."""

    #: Called with each text frame as it is read (it must not raise); None: frames go to the queue.
    on_frame: Callable[[str], None] | None = None

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope: Any = getattr(self, "scope", None)
        if scope is not None:  # None: the handshake was refused
            scope["extensions"][FRAME_READER] = self

    def send_receive_event_to_app(self) -> None:
        on_frame = self.on_frame
        if on_frame is None or self.curr_msg_data_type != "text" or self.close_sent or not self.queue.empty():
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            super().send_receive_event_to_app()  # closes the connection as uvicorn does
            return
        self.frames = []
        on_frame(text)


def frame_reader(scope: Any) -> NodeFrameProtocol | None:
    """The protocol of a websocket served by :class:`NodeFrameProtocol` (None under any other server)."""
    reader = scope.get("extensions", {}).get(FRAME_READER)
    return reader if isinstance(reader, NodeFrameProtocol) else None
