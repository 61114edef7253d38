"""The states of a request in the master, the moves allowed between them, and how it ended.

::

    new ──> queued ──> running ──> finished
     │        │  ^       │ ^
     │        │  └───────┘ └─ re-run on another pair at once (a new attempt)
     └────────┴──────────┴──> failed

A request waits in ``queued`` for capacity (first admission, or a re-run no pair could take at
once), runs an attempt in ``running``, and ends ``finished`` (its last token arrived) or
``failed`` (an error, a timeout, or its client left). Nothing leaves an end state. An illegal
move is a bug in the relay: it is logged and raised, never applied.
"""

from __future__ import annotations

import enum
import logging
from typing import Literal

logger = logging.getLogger(__name__)

#: How a request ended, as ``pdc_requests_total`` and the request log name it.
Outcome = Literal["ok", "error", "aborted", "timeout", "unavailable", "rate_limited"]


class RequestState(enum.StrEnum):
    NEW = "new"
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED)


#: Each state and the states a request in it may move to.
ALLOWED_MOVES: dict[RequestState, frozenset[RequestState]] = {
    RequestState.NEW: frozenset({RequestState.QUEUED, RequestState.RUNNING, RequestState.FAILED}),
    RequestState.QUEUED: frozenset({RequestState.RUNNING, RequestState.FAILED}),
    RequestState.RUNNING: frozenset(
        {RequestState.RUNNING, RequestState.QUEUED, RequestState.FINISHED, RequestState.FAILED}
    ),
    RequestState.FINISHED: frozenset(),
    RequestState.FAILED: frozenset(),
}


class IllegalMove(RuntimeError):
    """A move the state machine does not allow (a bug in the relay)."""


def check_move(request_id: str, current: RequestState, new: RequestState) -> None:
    """Raise :class:`IllegalMove` unless a request in ``current`` may move to ``new``."""
    if new not in ALLOWED_MOVES[current]:
        logger.error("request %s cannot move from %s to %s", request_id, current, new)
        raise IllegalMove(f"request {request_id} cannot move from {current} to {new}")
