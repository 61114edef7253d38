"""Bearer-token checks for nodes (cluster token) and operators (admin token)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr


def bearer_matches(authorization: str | None, expected: SecretStr | None) -> bool:
    """True when an ``Authorization: Bearer <token>`` header carries ``expected`` (constant time)."""
    if expected is None or not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), expected.get_secret_value().encode())
