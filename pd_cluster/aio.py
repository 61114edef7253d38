"""Small asyncio helpers shared by every process."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: How long a thread that holds the GIL keeps it while another waits (Python's default is 5 ms).
#: Each process here runs its event loop beside a busy thread (a node's engine, the master's
#: tokenizer): at 5 ms a job, a token or a tokenized prompt may wait that long for the loop to
#: take it, on every hop of a request. ``PD_CLUSTER_SWITCH_INTERVAL_S`` overrides it.
SWITCH_INTERVAL_S = 0.001


def prepare_process() -> None:
    """Settings every server process of the cluster starts with: the GIL switch interval."""
    interval = float(os.environ.get("PD_CLUSTER_SWITCH_INTERVAL_S", SWITCH_INTERVAL_S))
    sys.setswitchinterval(interval)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a server process's main coroutine: on uvloop where it is installed (its loop and
    sockets cost a fraction of asyncio's per message), else on asyncio's own loop."""
    prepare_process()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` without its Python 3.11 flaw.

    On 3.11, ``asyncio.wait_for`` can swallow a cancellation that arrives just as the awaited
    operation completes, and a loop that was being stopped then carries on forever.
    ``asyncio.timeout`` does not; this keeps the call shape (and raises ``TimeoutError``).
    """
    async with asyncio.timeout(timeout):
        return await awaitable
