"""Bearer-token checks for operators (admin token) and clients (API keys), and the per-key bound
on a client's concurrent generations. Nodes prove the cluster token without sending it
(:mod:`master.node_auth`)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from master.errors import APIError, unauthorized
from master.key_counts import KeyCounts, LocalKeyCounts

logger = logging.getLogger(__name__)


def blank(secret: SecretStr | None) -> bool:
    """A secret that is set but holds only whitespace: every header would carry it, so it opens nothing."""
    return secret is not None and not secret.get_secret_value().strip()


def bearer_matches(authorization: str | None, expected: SecretStr | None) -> bool:
    """True when an ``Authorization: Bearer <token>`` header carries ``expected`` (constant time);
    never for an empty secret (``Bearer `` with nothing after it would match it)."""
    if expected is None or blank(expected) or not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), expected.get_secret_value().encode())


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def read_keys_file(path: Path) -> dict[str, int | None]:
    """API keys, one a line: ``KEY`` or ``KEY MAX_CONCURRENT``; blank lines and ``#`` comments skipped."""
    keys: dict[str, int | None] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2 or (len(words) == 2 and not words[1].isdigit()):
            raise ValueError(f"{path}:{number}: expected `KEY` or `KEY MAX_CONCURRENT`")
        keys[words[0]] = int(words[1]) if len(words) == 2 else None
    return keys


@dataclass
class ClientSlot:
    """One admitted request of one key and the generations it runs; :meth:`release` (idempotent)
    gives them back."""

    keys: "ApiKeys"
    key: str | None
    generations: int = 1
    released: bool = False
    #: A relay request took it over (and releases it when it ends).
    handed: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.keys.release(self.key, self.generations)


@dataclass
class ApiKeys:
    """The keys clients must send (``Authorization: Bearer <key>``) and how many generations each
    may run at once: a request counts one per prompt and choice (prompts x max(n, best_of)), since
    each is a request of its own on the nodes. No keys configured: the API is open (and per-key
    limits do not apply)."""

    limits: dict[str, int | None] = field(default_factory=dict)
    default_limit: int | None = None
    retry_after_s: float = 1.0
    #: Where the running generations are counted: this process, or the table every worker of
    #: the master shares (:mod:`master.key_counts`).
    counts: KeyCounts = field(default_factory=LocalKeyCounts)

    @property
    def open_generations(self) -> dict[str, int]:
        """The keys with generations running, and how many."""
        running = {key: self.counts.running(key) for key in self.limits}
        return {key: n for key, n in running.items() if n}

    @property
    def required(self) -> bool:
        return bool(self.limits)

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's key (None when keys are not required); raises a 401 APIError otherwise."""
        if not self.required:
            return None
        given = _bearer(authorization)
        if given is None:
            raise unauthorized("You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
        for key in self.limits:
            if hmac.compare_digest(given.encode(), key.encode()):
                return key
        raise unauthorized("Incorrect API key provided.")

    @staticmethod
    def name_of(key: str | None) -> str | None:
        """A key as logs and metrics name it: ``key-`` and the first 8 hex digits of its SHA-256
        (``printf %s KEY | sha256sum`` finds which), never the key itself."""
        if key is None:
            return None
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]

    def limit_of(self, key: str | None) -> int | None:
        if key is None:
            return None
        limit = self.limits.get(key)
        return limit if limit is not None else self.default_limit

    def acquire(self, key: str | None, generations: int = 1) -> ClientSlot:
        """Count ``generations`` more running under ``key``. A request larger than the key's whole
        limit can never pass: 400, saying so (no client should retry it). One that fits the limit but
        not what is free of it now: 429 with Retry-After."""
        limit = self.limit_of(key)
        if limit is not None and generations > limit:
            raise APIError(400, f"This request runs {generations} generations at once (prompts x n or best_of), "
                           f"more than this API key may run concurrently ({limit}). Send fewer prompts or choices "
                           "per request.", "invalid_request_error", None, "generations_over_key_limit")
        if key is None:  # an open API: nothing to bound
            return ClientSlot(self, key, generations)
        running = self.counts.try_add(key, generations, limit)
        if running is None:
            raise APIError(429, f"Too many concurrent generations for this API key: {self.counts.running(key)} "
                           f"running, this request needs {generations}, the limit is {limit}.", "rate_limit_error",
                           None, "rate_limit_exceeded", self.retry_after_s)
        return ClientSlot(self, key, generations)

    def release(self, key: str | None, generations: int = 1) -> None:
        if key is not None:
            self.counts.sub(key, generations)
