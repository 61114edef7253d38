"""One dispatch of a request to a (P, D) pair: its id on the wire, its nodes, its handover, and
what it claims on those nodes until it ends.

Each attempt has its own id (the request id, then ``<id>-r1``, ``<id>-r2``...), so frames and
aborts of an abandoned attempt can never touch the next one. A re-run starts a fresh
:class:`Attempt`; the ended one keeps what the request log reads (its nodes, its first token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from master.registry import NodeRecord
from master.routing import Plan
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams


def attempt_id_of(request_id: str, number: int) -> str:
    """The wire id of a request's attempt ``number`` (1 for the first)."""
    return request_id if number == 1 else f"{request_id}-r{number - 1}"


@dataclass(eq=False)
class Attempt:
    """One dispatch: it belongs to its P until the handover (P's KVTransferred or D's first
    tokens), and to its D until it ends."""

    number: int
    attempt_id: str
    decode_id: str
    #: None: D prefills it itself (no handover to wait for; D's deltas start the output).
    prefill_id: str | None
    #: How it was routed: its path, reason and D's prefix hit.
    plan: Plan | None
    #: When it was sent to its node(s) (monotonic).
    dispatched_at: float
    #: P's FirstToken arrived (from the start when D prefills it).
    first_token_seen: bool
    #: The KV reached D: P's loss no longer touches it.
    handed_over: bool
    ended: bool = False
    handoff_timer: asyncio.TimerHandle | None = None
    #: P's first token, withheld until D's first tokens when ``first_token_via`` is "decode".
    withheld_first: protocol.FirstToken | None = None
    #: D's frames that came before P's FirstToken (held back to keep order).
    early_deltas: list[protocol.TokenDelta] = field(default_factory=list)
    #: Its FirstToken (D's prefix hit, bytes moved), for the request log.
    first_token: protocol.FirstToken | None = None
    #: The node's own share of the TTFT: from taking the job to sending the first token.
    node_ttft_s: float | None = None

    @classmethod
    def start(
        cls, request_id: str, number: int, prefill: NodeRecord | None, decode: NodeRecord, plan: Plan | None,
        now: float,
    ) -> Attempt:
        local = prefill is None
        return cls(
            number=number,
            attempt_id=attempt_id_of(request_id, number),
            decode_id=decode.node_id,
            prefill_id=None if prefill is None else prefill.node_id,
            plan=plan,
            dispatched_at=now,
            first_token_seen=local,
            handed_over=local,
        )

    def cancel_handoff_timer(self) -> None:
        if self.handoff_timer is not None:
            self.handoff_timer.cancel()
            self.handoff_timer = None


def claim_nodes(
    attempt: Attempt, prefill: NodeRecord | None, decode: NodeRecord, kv_need: int, prompt_tokens: int,
    miss_tokens: int,
) -> None:
    """Count the attempt on its nodes: D's KV to come, the prefill it waits for, who holds it."""
    attempt_id = attempt.attempt_id
    decode.pending_kv[attempt_id] = kv_need
    decode.inflight.add(attempt_id)
    if prefill is None:
        decode.pending_prefill[attempt_id] = miss_tokens
        return
    prefill.pending_prefill[attempt_id] = prompt_tokens
    prefill.inflight.add(attempt_id)


def job_for(
    attempt: Attempt, decode: NodeRecord, token_ids: list[int], sampling: SamplingParams, deadline_s: float,
    client_request_id: str | None = None,
) -> protocol.PrefillJob | protocol.GenerateJob:
    """A ``PrefillJob`` for P naming D, or with no P a ``GenerateJob`` for the node that prefills
    and decodes it (its tokens, the first included, come as deltas)."""
    if attempt.prefill_id is None:
        return protocol.GenerateJob(request_id=attempt.attempt_id, token_ids=token_ids, sampling=sampling,
                                    deadline_s=deadline_s, client_request_id=client_request_id)
    return protocol.PrefillJob(
        request_id=attempt.attempt_id,
        token_ids=token_ids,
        sampling=sampling,
        decode_node_id=decode.node_id,
        decode_address=decode.info.data_address or "",
        deadline_s=deadline_s,
        client_request_id=client_request_id,
    )


def release_nodes(
    attempt: Attempt, lookup: Callable[[str | None], NodeRecord | None], abort: bool, abort_decode_only: bool
) -> None:
    """Take the ended attempt off its nodes' books; with ``abort``, tell them (or only D) to drop it."""
    attempt_id = attempt.attempt_id
    for node_id in (attempt.prefill_id, attempt.decode_id):
        node = lookup(node_id)
        if node is None:
            continue
        node.pending_prefill.pop(attempt_id, None)
        if node_id == attempt.decode_id:
            node.ended_attempts.add(attempt_id)  # its last status may still count it
        node.pending_kv.pop(attempt_id, None)
        node.reported_kv.discard(attempt_id)
        node.inflight.discard(attempt_id)
        if abort and (not abort_decode_only or node_id == attempt.decode_id):
            node.send(protocol.Abort(request_id=attempt_id))
