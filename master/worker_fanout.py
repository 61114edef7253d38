"""An operator's change, received by one worker of a master of several, applied by every worker.

Each worker holds its own registry, so a drain, removal or allow reaches the siblings too: the
worker that took the call repeats it on each sibling's private port, with the same admin token
and a header that stops the sibling from repeating it again. Every call has a deadline; a sibling
that does not answer (it is restarting) is logged and named in the answer.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import httpx

from master.config import MasterSettings

logger = logging.getLogger(__name__)

#: Marks a call one worker repeats on a sibling: applied there, not repeated further.
FANOUT_HEADER = "x-pd-worker-fanout"
#: Deadline of one sibling's answer.
SIBLING_TIMEOUT_S = 5.0


def _loopback(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def sibling_urls(settings: MasterSettings) -> list[str]:
    """The private URLs of the other workers, on this host."""
    scheme = "https" if settings.tls_cert is not None else "http"
    host = _loopback(settings.host)
    return [f"{scheme}://{host}:{settings.worker_port(i)}" for i in range(settings.workers)
            if i != settings.worker_index]


def _verify(settings: MasterSettings) -> ssl.SSLContext | bool:
    """Siblings serve this worker's own certificate: trust exactly it (the host name is loopback)."""
    if settings.tls_cert is None:
        return True
    context = ssl.create_default_context(cafile=str(settings.tls_cert))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


async def fan_out(
    settings: MasterSettings, method: str, path: str, authorization: str, body: dict[str, Any] | None = None
) -> list[str]:
    """Repeat ``method path`` (with its JSON ``body``) on every sibling worker; the URLs of those
    that did not apply it."""
    urls = sibling_urls(settings) if settings.worker_index is not None else []
    if not urls:
        return []
    headers = {"authorization": authorization, FANOUT_HEADER: "1"}
    async with httpx.AsyncClient(timeout=SIBLING_TIMEOUT_S, verify=_verify(settings)) as client:
        async def one(url: str) -> str | None:
            try:
                answer = await client.request(method, url + path, headers=headers, json=body)
            except httpx.HTTPError as exc:
                logger.warning("worker %s did not take %s %s: %s", url, method, path, exc or type(exc).__name__)
                return url
            # 404: the sibling does not hold that node (it left there already): nothing to apply.
            if answer.status_code >= 400 and answer.status_code != 404:
                logger.warning("worker %s answered %s %s with %d", url, method, path, answer.status_code)
                return url
            return None

        failed = await asyncio.gather(*(one(url) for url in urls))
    return [url for url in failed if url is not None]
