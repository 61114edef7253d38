"""The few master calls the launcher makes: health, the admin node list, drain."""

from __future__ import annotations

import ssl
from typing import Any

import httpx


class MasterClient:
    def __init__(self, url: str, admin_token: str | None, timeout: float = 5.0,
                 verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: what an https master's certificate is checked with (True: the system's CAs)."""
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def healthy(self) -> bool:
        """True once the master routes (its /health: a mixed node, or a decode node); False if down."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Registered nodes by id, as ``GET /admin/nodes`` shows them (raises if unreachable)."""
        response = self._http.get("/admin/nodes")
        response.raise_for_status()
        return {n["id"]: n for n in response.json()["data"]}

    def try_nodes(self) -> dict[str, dict[str, Any]] | None:
        try:
            return self.nodes()
        except httpx.HTTPError:
            return None

    def drain_node(self, node_id: str) -> dict[str, Any] | None:
        """Ask the master to drain a node; its view at that moment, or None if it is not registered."""
        response = self._http.post(f"/admin/nodes/{node_id}/drain")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()
