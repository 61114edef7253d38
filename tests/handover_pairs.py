"""A real prefill service and a real decode service in the test process, for handover tests.

They are joined over a loopback link (``loopback=True``: no sockets, D's pool handed to P
directly when ``share``) or over the real data plane on localhost (sockets, a gloo pair group,
and with ``share`` D's pool offered in the handshake: the test registers a handle kind for it).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from decode_node.service import DecodeService
from pd_cluster.config import EngineConfig
from pd_cluster.handover import LoopbackChannels
from pd_cluster.handover.messages import MatchPrefix, MatchResult
from pd_cluster.llm import LLM
from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.transfer import PeerChannel
from prefill_node.service import PrefillService

TOKEN = "handover-test-token"
NEW_TOKENS = 8
LOOPBACK_ADDRESS = "loopback:d0"


def engine_config(model_dir, block_size: int = 16, tp: int = 1, kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                        block_size=block_size, tp=tp, kv_cache_dtype=kv_cache_dtype)


def single_engine_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of one engine doing it all: what P then D must produce."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_total_tokens=4096, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


async def poll(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class ServicePair:
    def __init__(self) -> None:
        self.p: PrefillService
        self.d: DecodeService
        self.address = ""
        #: What a test calls this pair (for example the path its KV takes).
        self.label = ""
        self.loopback: LoopbackChannels | None = None
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    def on_tokens(self, updates) -> None:
        with self.lock:
            for u in updates:
                self.tokens.setdefault(u.request_id, []).append(u.token_id)
                if u.finish_reason is not None:
                    self.finished.add(u.request_id)

    def job(self, prompt: list[int]) -> PrefillJob:
        return PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt,
                          sampling=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          decode_node_id="d0", decode_address=self.address, deadline_s=60.0)

    async def run(self, prompt: list[int]):
        """P's job through to D's last token: (P's first token + D's tokens, P's result)."""
        job = self.job(prompt)
        firsts = []

        async def report(first) -> None:
            firsts.append(first)

        result = await self.p.run_job(job, report)
        await poll(lambda: job.request_id in self.finished, 60.0, "the decode node to finish")
        return [firsts[0].token_id] + self.tokens[job.request_id], result

    def channel(self) -> PeerChannel | None:
        """P's open channel to D, if any."""
        return (self.loopback or self.p.pool).peek(self.address)

    async def lease(self, prompt: list[int], *, lease_s: float = 30.0, direct: bool = False,
                    request_id: str | None = None) -> tuple[PeerChannel, MatchResult]:
        """A lease on D for ``prompt`` taken by hand, as P's job would."""
        channel = await self.p.channels.get(self.address)
        match = await channel.request(MatchPrefix(request_id=request_id or uuid.uuid4().hex, token_ids=prompt,
                                                  sampling=SamplingParams(temperature=0.0, max_tokens=4),
                                                  lease_s=lease_s, direct=direct), 10.0)
        assert isinstance(match, MatchResult) and match.lease_id, match
        return channel, match

    async def d_stats(self) -> dict:
        engine = self.d.engine
        return await self.d.worker.call(lambda: {
            "idle": engine.pool.num_free + engine.cache.evictable_tokens, "capacity": engine.pool.capacity,
            "reservations": len(self.d.reservations.pending), "external_held": engine.scheduler.external_held,
        })

    async def stop(self) -> None:
        await self.p.stop()
        await self.d.stop()
        self.p.engine.close()  # a tensor-parallel engine's ranks
        self.d.engine.close()


async def start_pair(model_dir, *, loopback: bool = True, share: bool = False, block_size: int = 16,
                     p_tp: int = 1, d_tp: int = 1, d_kv_dtype: str = "auto", p_kv_dtype: str = "auto",
                     **p_options) -> ServicePair:
    """Both services started (no engine warm-up), P's and D's engines of ``p_tp`` and ``d_tp``
    ranks (their KV caches storing ``p_kv_dtype`` and ``d_kv_dtype``); ``p_options`` go to the
    PrefillService."""
    pair = ServicePair()
    pair.d = DecodeService(engine_config(model_dir, block_size, d_tp, d_kv_dtype), node_id="d0", cluster_token=TOKEN,
                           on_tokens=pair.on_tokens, share_kv_pool=share, warm_up=False, listen=not loopback)
    await pair.d.start()
    if loopback:
        pair.loopback = LoopbackChannels("p0", "cpu")
        pair.loopback.add(LOOPBACK_ADDRESS, pair.d.receiver, "d0", share_pool=share)
        pair.address = LOOPBACK_ADDRESS
    else:
        pair.address = pair.d.data_address
    pair.p = PrefillService(engine_config(model_dir, block_size, p_tp, p_kv_dtype), node_id="p0", cluster_token=TOKEN,
                            warm_up=False, lease_s=30.0, channels=pair.loopback, **p_options)
    await pair.p.start()
    return pair
