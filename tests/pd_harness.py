"""Runs a real prefill node service and a real decode node service in separate processes.

The test process drives them over multiprocessing pipes: it hands P a prefill job and reads
D's token stream, the way the master does over websockets. Commands are tuples
``(name, *args)``; every reply is ``("ok", value)`` or ``("error", message)``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.process_server import forkserver_context

# Forked from multiprocessing's fork server, which imports torch, transformers and the rest of the
# third-party libraries once (what a fresh "spawn" child spends most of its start on); the node
# services and everything of the project are imported in each child.
_ctx = forkserver_context()


def _command_reader(conn, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            item = ("stop",)
        loop.call_soon_threadsafe(queue.put_nowait, item)
        if item[0] == "stop":
            return


def decode_main(conn, config: dict, token: str, lease_check: bool = True, stall_push: bool = False) -> None:
    import logging

    import torch

    torch.set_num_threads(1)  # P and D share the runner's cores (see Cluster.env in cluster_harness.py)

    logging.basicConfig(level=logging.INFO)
    asyncio.run(_decode(conn, config, token, stall_push))


async def _decode(conn, config: dict, token: str, stall_push: bool) -> None:
    from decode_node.service import DecodeService
    from pd_cluster.config import EngineConfig
    from pd_cluster.handover.messages import PushKV
    from tests.pool_writes import PoolWrites

    send_lock = threading.Lock()

    def send(item: Any) -> None:
        with send_lock:
            conn.send(item)

    def on_tokens(updates) -> None:
        send(("tokens", [(u.request_id, u.token_id, u.text_delta, u.finish_reason) for u in updates]))

    service = DecodeService(EngineConfig(**config), node_id="d0", cluster_token=token, on_tokens=on_tokens)
    if stall_push:
        original = service._handle

        async def stalling(conn_, msg):
            if isinstance(msg, PushKV):
                send(("push_started", msg.lease_id))
                await asyncio.sleep(3600)  # killed by the test while P waits on the transfer
            return await original(conn_, msg)

        service.server._handler = stalling
    await service.start()
    writes = PoolWrites(service)
    send(("ready", service.data_address, service.engine.kv_spec.bytes_per_block, service.engine.pool.capacity))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_command_reader, args=(conn, loop, queue), daemon=True).start()
    while True:
        cmd = await queue.get()
        if cmd[0] == "stop":
            break
        try:
            if cmd[0] == "stats":
                value = await service.worker.call(lambda: {
                    "free": service.engine.pool.num_free,
                    "capacity": service.engine.pool.capacity,
                    "evictable": service.engine.cache.evictable_tokens,
                    "reservations": len(service.reservations.pending),
                    "running": len(service.engine.scheduler.running),
                    "bytes_received": service.counters.kv_bytes_received,
                    "expired_leases": service.counters.expired_leases,
                })
            elif cmd[0] == "flush":
                value = await service.worker.call(service.engine.cache.flush)
            elif cmd[0] == "abort":
                value = await service.abort(cmd[1])
            elif cmd[0] == "arm_writes":  # measure the KV written into the pool (tests/pool_writes.py)
                value = await writes.arm()
            elif cmd[0] == "writes":
                value = writes.bytes_at_commit
            else:
                raise ValueError(f"unknown command {cmd[0]}")
            send(("reply", "ok", value))
        except Exception as e:  # reported to the test
            send(("reply", "error", f"{type(e).__name__}: {e}"))
    await service.stop()


def prefill_main(conn, config: dict, token: str, lease_s: float) -> None:
    import logging

    import torch

    torch.set_num_threads(1)  # P and D share the runner's cores (see Cluster.env in cluster_harness.py)

    logging.basicConfig(level=logging.INFO)
    asyncio.run(_prefill(conn, config, token, lease_s))


async def _prefill(conn, config: dict, token: str, lease_s: float) -> None:
    from pd_cluster.config import EngineConfig
    from pd_cluster.handover.messages import MatchPrefix
    from pd_cluster.protocol import PrefillJob
    from prefill_node.failures import PrefillFailed
    from prefill_node.service import PrefillService

    service = PrefillService(EngineConfig(**config), node_id="p0", cluster_token=token, lease_s=lease_s)
    await service.start()
    conn.send(("ready", service.engine.kv_spec.bytes_per_block))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_command_reader, args=(conn, loop, queue), daemon=True).start()
    while True:
        cmd = await queue.get()
        if cmd[0] == "stop":
            break
        try:
            if cmd[0] == "job":
                job = PrefillJob.model_validate_json(cmd[1])
                firsts = []

                async def report(first) -> None:
                    firsts.append(first.model_dump())

                result = await service.run_job(job, report)
                channel = service.pool.peek(job.decode_address)
                value = {"first": firsts[0], "hit_blocks": result.hit_blocks, "transfer_bytes": result.transfer_bytes,
                         "committed": result.committed, "transport": channel.transport if channel else None}
            elif cmd[0] == "match_only":
                job = PrefillJob.model_validate_json(cmd[1])
                channel = await service.pool.get(job.decode_address)
                reply = await channel.request(
                    MatchPrefix(request_id=job.request_id, token_ids=job.token_ids, sampling=job.sampling,
                                lease_s=lease_s), 10.0)
                value = reply.model_dump()
            else:
                raise ValueError(f"unknown command {cmd[0]}")
            conn.send(("reply", "ok", value))
        except PrefillFailed as e:
            conn.send(("reply", "error", f"PrefillFailed(retryable={e.retryable}, decode_lost={e.decode_lost}): {e}"))
        except Exception as e:
            conn.send(("reply", "error", f"{type(e).__name__}: {e}"))
    await service.stop()


@dataclass
class NodeProcess:
    process: Any
    conn: Any
    info: tuple = ()
    tokens: dict[str, list] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    events: list = field(default_factory=list)

    def _pump(self, timeout: float) -> tuple | None:
        """Read one message; token streams and events are filed; replies are returned."""
        if not self.conn.poll(timeout):
            return None
        msg = self.conn.recv()
        if msg[0] == "tokens":
            for request_id, token_id, _text, finish in msg[1]:
                self.tokens.setdefault(request_id, []).append(token_id)
                if finish is not None:
                    self.finished[request_id] = finish
            return None
        if msg[0] == "reply":
            return msg
        self.events.append(msg)
        return None

    def call(self, *cmd, timeout: float = 120.0) -> Any:
        self.conn.send(cmd)
        return self.reply(timeout)

    def reply(self, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._pump(min(0.5, max(deadline - time.monotonic(), 0.01)))
            if msg is not None:
                _, status, value = msg
                if status == "error":
                    raise RuntimeError(value)
                return value
            if not self.process.is_alive():
                raise RuntimeError("node process died")
        raise TimeoutError(f"no reply within {timeout}s")

    def wait_finished(self, request_id: str, timeout: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while request_id not in self.finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} did not finish within {timeout}s")
            self._pump(0.2)
        return self.tokens[request_id]

    def wait_event(self, name: str, timeout: float = 60.0) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event[0] == name:
                    self.events.remove(event)
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} event within {timeout}s")
            self._pump(0.2)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


def start_node(target, *args, ready_timeout: float = 180.0) -> NodeProcess:
    parent, child = _ctx.Pipe()
    process = _ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    node = NodeProcess(process, parent)
    node.info = node.wait_event("ready", ready_timeout)
    return node
