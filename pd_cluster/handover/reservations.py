"""D's reservations for the P -> D handover: reserve KV for an incoming prompt, commit it.

``reserve`` matches the prompt against the prefix cache at block granularity, pins the hit,
and allocates slots for the rest, so P can send only the missing blocks. The reservation is
counted against admission until it is committed (the request joins the decode batch) or
cancelled (P gave up, or its lease ran out).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.radix_cache import RadixNode
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    lease_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hit_tokens: int
    hit_slots: torch.Tensor  # tree slots of the cached prefix (pinned through ``node``)
    new_slots: torch.Tensor  # slots reserved for tokens [hit_tokens, len(prompt))
    node: RadixNode
    expires_at: float
    created_at: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def held(self) -> int:
        return self.new_slots.numel()


class NoCapacity(RuntimeError):
    """The decode engine cannot take this request now (another node may)."""


class Reservations:
    """Reservations of one decode engine, by lease id. Call only from the engine's thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        #: Lease id -> reservation not yet committed or cancelled.
        self.pending: dict[str, Reservation] = {}

    @property
    def block_size(self) -> int:
        return self.engine.cache.block_size

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lease_s: float
    ) -> Reservation:
        engine = self.engine
        engine.validate(prompt_token_ids, params)
        if request_id in engine.requests or any(r.request_id == request_id for r in self.pending.values()):
            raise ValueError(f"request_id: {request_id!r} is already on this node")
        sched = engine.scheduler
        n = len(prompt_token_ids)
        left = sched.predicted_left(params, generated=1)
        busy = len(sched.running) + len(self.pending)
        if busy >= engine.config.max_running_requests or not sched.fits(n + 1, left):
            raise NoCapacity(f"decode node is full ({len(sched.running)} running, {len(self.pending)} reserved of "
                             f"{engine.config.max_running_requests} rows, {engine.pool.num_free} free KV slots)")
        match = engine.cache.match_prefix(prompt_token_ids)
        engine.cache.inc_ref(match.node)
        engine.settle_freed_slots()  # the prefill node writes these slots from outside the engine's stream
        slots = sched.alloc_slots(n - match.num_tokens)
        if slots is None:
            engine.cache.dec_ref(match.node)
            raise NoCapacity("decode node has no free KV slots")
        res = Reservation(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            hit_tokens=match.num_tokens,
            hit_slots=match.slots,
            new_slots=slots,
            node=match.node,
            expires_at=time.monotonic() + lease_s,
        )
        self.pending[res.lease_id] = res
        sched.external_held += res.held
        return res

    def cancel(self, lease_id: str) -> bool:
        res = self.pending.pop(lease_id, None)
        if res is None:
            return False
        self.engine.scheduler.external_held -= res.held
        self._drop(res)
        return True

    def _drop(self, res: Reservation) -> None:
        self.engine.pool.free(res.new_slots)
        self.engine.cache.dec_ref(res.node)

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Cancel every reservation whose lease ran out (its P died or gave up)."""
        now = time.monotonic() if now is None else now
        gone = [r for r in self.pending.values() if r.expires_at <= now]
        for res in gone:
            logger.warning("lease %s of request %s expired before commit; freeing %d KV slots",
                           res.lease_id, res.request_id, res.held)
            self.cancel(res.lease_id)
        return gone

    def commit(self, lease_id: str, first_token: int) -> Request | None:
        """The prompt's KV has arrived: cache the prompt and join the request to the batch. The
        request continues the seed's random stream at output position 1, as P left it. A beam
        search starts from the KV instead, without P's token (None returned)."""
        res = self.pending.pop(lease_id, None)
        if res is None:
            raise KeyError(f"lease {lease_id} is unknown or expired")
        engine = self.engine
        sched = engine.scheduler
        sched.external_held -= res.held
        if res.params.use_beam_search:
            self._start_beams(res)
            return None
        n = res.num_tokens
        slots = torch.cat((res.hit_slots[: res.hit_tokens], res.new_slots))
        row = engine.table.alloc_row()
        if row is None:
            self._drop(res)
            raise NoCapacity("decode node has no free request row")
        node = res.node
        if engine.cache.enabled:
            # The prompt enters the cache now, so later turns hit it while this one decodes.
            match = engine.cache.insert(res.prompt_token_ids, slots)
            slots = torch.cat((match.slots, slots[match.num_tokens :]))
            engine.cache.inc_ref(match.node)
            engine.cache.dec_ref(res.node)
            node = match.node

        # The prompt's logprobs went out with P's first token: D has no prompt of its own to score.
        params = res.params.model_copy(update={"prompt_logprobs": None}) if res.params.prompt_logprobs is not None \
            else res.params
        req = engine.make_request(res.request_id, res.prompt_token_ids, params)
        req.sampling.output_token_ids.append(first_token)
        req.output.append(first_token)  # P already reported this token's text
        req.row = row
        engine.table.write(row, 0, slots)
        req.prefix_node = node
        req.num_computed = n
        req.num_cached_tokens = res.hit_tokens
        req.admitted_once = True
        req.status = RequestStatus.RUNNING
        engine.requests[req.request_id] = req
        sched.add_running(req)
        engine.stats.prompt_tokens += n
        engine.stats.cached_prompt_tokens += res.hit_tokens
        return req

    def _start_beams(self, res: Reservation) -> None:
        """Start the beam search of ``res`` from its KV. The cached prefix gets one more holder
        (the search's, :meth:`KVPool.share`): the cache may evict it meanwhile, and the search
        frees its hold as it ends; the prompt is not cached (its beams hold it)."""
        engine = self.engine
        hit = res.hit_slots[: res.hit_tokens]
        if hit.numel():
            engine.pool.share(hit)
        engine.cache.dec_ref(res.node)
        engine.stats.cached_prompt_tokens += res.hit_tokens
        try:
            engine.add_beam_request(res.request_id, res.prompt_token_ids, res.params,
                                    prompt_slots=torch.cat((hit, res.new_slots)))
        except ValueError as e:
            raise NoCapacity(str(e)) from None
