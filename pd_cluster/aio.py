"""Small asyncio helpers shared by every process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` without its Python 3.11 flaw.

    On 3.11, ``asyncio.wait_for`` can swallow a cancellation that arrives just as the awaited
    operation completes, and a loop that was being stopped then carries on forever.
    ``asyncio.timeout`` does not; this keeps the call shape (and raises ``TimeoutError``).
    """
    async with asyncio.timeout(timeout):
        return await awaitable
