"""TLS contexts of the cluster's links, made from the files an operator gives.

A server (the master's HTTP and websocket endpoint, a decode node's data-plane listener) needs a
certificate and its key; a client (a node dialing a ``https://`` master, a prefill node dialing a
decode node) checks the server's certificate and host name against a CA file, or the system's
CAs without one. The certificate must name the address the others dial (an IP address goes in
its subjectAltName as ``IP:``).
"""

from __future__ import annotations

import ssl
from pathlib import Path


def check_pair(cert: Path | None, key: Path | None) -> None:
    """A certificate and its key come together; raises ValueError otherwise."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together (PD_TLS_CERT, PD_TLS_KEY)")


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """What a listener presents: ``cert`` (with its chain, PEM) and ``key``; TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def client_context(ca: Path | None) -> ssl.SSLContext:
    """What a dialer checks servers with: the CAs in ``ca`` (PEM), else the system's; host names
    are checked."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca is not None else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
