"""Synthetic decode nodes that join several masters and stamp every token with its send time.

A node registers with each master it is given (as a real node does with ``--master a,b``) and
answers every ``GenerateJob`` on the link it came from: the first token at its next step, then
one token a step. Each token's text is the time the frame left the node (``time.monotonic()``,
one clock for every process of the host), so a client that reads the text knows how long the
token spent in the master and on the wire after the node let go of it.

Frames are written by hand (every step's frame holds a delta per running request, and pydantic
encoding of them would make the nodes, not the master, the limit); their shape is
``protocol.TokenDeltas``'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_cluster import aio, protocol
from pd_cluster.bench.master_cores import pin
from pd_cluster.bench.master_load import PREFILL_TOKENS_PER_S, kv_spec_for
from pd_cluster.kv_spec import KVSpec
from pd_cluster.node.agent import node_ws_url
from pd_cluster.node.master_proof import prove_to_master

logger = logging.getLogger(__name__)

#: Stands for a frame's send time in its text until the frame is sent.
_STAMP = "@STAMP@"
#: The token id every synthetic token carries (any ordinary id: the master relays the node's text).
TOKEN_ID = 1000
CAPACITY_TOKENS = 1 << 24


@dataclass
class _Job:
    request_id: str
    remaining: int
    received: float
    first: bool = True


@dataclass
class _Link:
    """One master's socket and the jobs it sent."""

    ws: Any
    jobs: dict[str, _Job] = field(default_factory=dict)


def delta_json(job: _Job, now: float) -> str:
    """One job's ``TokenDelta`` of this step, its text the frame's stamp (filled in at send)."""
    done = job.remaining <= 0
    extra = ""
    if job.first:  # the node prefilled it itself: its first delta says so
        extra = f',"cached_tokens":0,"node_ttft_s":{max(now - job.received, 0.0):.6f}'
    finish = ',"finish_reason":"length"' if done else ""
    return (f'{{"type":"token_delta","request_id":{json.dumps(job.request_id)},"token_ids":[{TOKEN_ID}],'
            f'"text":"{_STAMP}"{finish}{extra}}}')


def frames_of(deltas: list[str], max_bytes: int = protocol.MAX_MESSAGE_BYTES // 2) -> list[str]:
    """The step's deltas as ``token_deltas`` frames, none over ``max_bytes``."""
    frames, part, size = [], [], 0
    for d in deltas:
        if part and size + len(d) > max_bytes:
            frames.append('{"type":"token_deltas","deltas":[' + ",".join(part) + "]}")
            part, size = [], 0
        part.append(d)
        size += len(d) + 1
    if part:
        frames.append('{"type":"token_deltas","deltas":[' + ",".join(part) + "]}")
    return frames


class StampedDecode:
    """One synthetic decode node linked to every master in ``urls``."""

    def __init__(self, urls: list[str], node_id: str, spec: KVSpec, max_model_len: int, step_s: float,
                 token: str) -> None:
        self.urls, self.node_id, self.spec = urls, node_id, spec
        self.max_model_len, self.step_s, self.token = max_model_len, step_s, token
        self.links: list[_Link] = []

    async def run(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            pending, seen = list(self.urls), set()
            while pending:
                url = pending.pop(0)
                if url in seen:
                    continue
                seen.add(url)
                ws, workers = await self._join(url)
                # A master of several workers names them: link to each instead, as real nodes do.
                if workers and url not in workers:
                    await ws.close()
                    pending += workers
                    continue
                stack.push_async_callback(ws.close)
                self.links.append(_Link(ws))
            tasks = [self._steps()]
            for link in self.links:
                tasks += [self._read(link), self._heartbeat(link)]
            await asyncio.gather(*tasks)

    async def _join(self, url: str, timeout_s: float = 120.0) -> tuple[Any, list[str]]:
        """A registered socket to ``url`` and the worker URLs its master named; a refusal that may
        pass (the id still held by a link just closed) is retried until ``timeout_s``."""
        from websockets.asyncio.client import connect

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ws = await connect(url, max_size=2 * protocol.MAX_MESSAGE_BYTES, compression=None)
            except OSError:  # a worker named by its master may not be listening yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
                continue
            await prove_to_master(ws, self.token, self.node_id)
            reply = await self._register(ws)
            if isinstance(reply, protocol.Registered):
                return ws, [node_ws_url(m) for m in reply.masters]
            await ws.close()
            if not reply.retryable or time.monotonic() > deadline:
                raise RuntimeError(f"{self.node_id} was not registered: {reply}")
            await asyncio.sleep(0.1)

    async def _register(self, ws: Any) -> protocol.Registered | protocol.Refused:
        register = protocol.Register(
            node_id=self.node_id, role="decode", model=self.spec.model, kv_spec=self.spec,
            data_address=f"127.0.0.1:{9 + len(self.node_id)}", device="cpu",
            capacity=protocol.NodeCapacity(max_total_tokens=CAPACITY_TOKENS, max_running_requests=4096,
                                           max_model_len=self.max_model_len),
        )
        await ws.send(protocol.encode(register))
        reply = protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 30.0))
        if not isinstance(reply, (protocol.Registered, protocol.Refused)):
            raise RuntimeError(f"{self.node_id} was not registered: {reply}")
        return reply

    async def _read(self, link: _Link) -> None:
        async for frame in link.ws:
            msg = protocol.parse_master_message(frame)
            if isinstance(msg, protocol.GenerateJob):
                link.jobs[msg.request_id] = _Job(msg.request_id, msg.sampling.max_tokens, time.monotonic())
            elif isinstance(msg, protocol.Abort):
                link.jobs.pop(msg.request_id, None)

    async def _steps(self) -> None:
        """Every step, one token for every job; a job that came in during a step starts at the next."""
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            tick += self.step_s
            await asyncio.sleep(max(0.0, tick - loop.time()))
            now = time.monotonic()
            for link in self.links:
                deltas = []
                for job in list(link.jobs.values()):
                    job.remaining -= 1
                    deltas.append(delta_json(job, now))
                    job.first = False
                    if job.remaining <= 0:
                        del link.jobs[job.request_id]
                for frame in frames_of(deltas):
                    await link.ws.send(frame.replace(_STAMP, f"{time.monotonic():.6f}"))

    async def _heartbeat(self, link: _Link) -> None:
        while True:
            running = sum(len(lk.jobs) for lk in self.links)
            await link.ws.send(protocol.encode(protocol.NodeStatus(
                running=running, free_kv_tokens=CAPACITY_TOKENS - 1024 * running, total_kv_tokens=CAPACITY_TOKENS,
                prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_step_base_s=self.step_s,
            )))
            await asyncio.sleep(0.5)


def nodes_main(urls: list[str], model_dir: str, node_ids: list[str], step_s: float, token: str,
               cpus: list[int] | None = None) -> None:
    """A child process that runs some of the synthetic nodes (on ``cpus``, when given) until it is
    terminated."""
    pin(cpus or [])
    spec, context = kv_spec_for(Path(model_dir))

    async def main() -> None:
        nodes = [StampedDecode(urls, node_id, spec, context, step_s, token) for node_id in node_ids]
        await asyncio.gather(*(n.run() for n in nodes))

    aio.run(main())
