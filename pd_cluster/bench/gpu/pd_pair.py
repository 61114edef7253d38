"""A prefill node and a decode node on two GPUs for (d) and (e): P's service in this process on
the benchmark engine, D in a child process (its engine thread must not share P's GIL), one
channel between them; and a raw NCCL pair to compare that channel with."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import multiprocessing as mp
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from pd_cluster.bench.gpu.models import build_engine, random_prompt
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.handover.messages import MatchPrefix, MatchResult
from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.transfer import DataMessage

TOKEN = "bench-token"


class BenchSink(DataMessage):
    """Bench only: D receives the announced tensors and answers; measures the bare channel."""

    type: Literal["bench.sink"] = "bench.sink"
    shapes: list[list[int]]
    dtype: str


class BenchAck(DataMessage):
    type: Literal["bench.ack"] = "bench.ack"
    nbytes: int


@dataclass
class PDPair:
    """P's service and its channel to D, with what the figures need to drive handovers."""

    p: Any  # prefill_node.service.PrefillService
    channel: Any
    d_address: str
    p_engine: LLMEngine
    greedy: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=2,
                                                                          ignore_eos=True))
    d_counters: dict | None = None

    @property
    def vocab(self) -> int:
        return self.p_engine.model_config.vocab_size

    async def lease(self, n: int, gen: torch.Generator) -> tuple[str, list[int]]:
        """A KV lease on D for a fresh ``n``-token random prompt (no prefix hit)."""
        match, prompt = await self.match(n, gen)
        assert match.lease_id is not None
        return match.lease_id, prompt

    async def match(self, n: int, gen: torch.Generator, direct: bool = False) -> tuple[MatchResult, list[int]]:
        """D's answer to a fresh ``n``-token random prompt; ``direct``: with its reserved slots."""
        prompt = random_prompt(self.vocab, n, gen)
        match = await self.channel.request(MatchPrefix(request_id=uuid.uuid4().hex, token_ids=prompt,
                                                       sampling=self.greedy, lease_s=120.0, direct=direct), 30.0)
        assert isinstance(match, MatchResult) and match.lease_id and match.hit_blocks == 0, match
        return match, prompt

    async def job(self, prompt: list[int]) -> dict:
        """One whole prefill job P -> D, as the master would send it: handover and first-token times."""
        spec_job = PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt, sampling=self.greedy,
                              decode_node_id="d0", decode_address=self.d_address, deadline_s=120.0)
        marks: dict[str, float] = {}

        async def report(first) -> None:
            marks["first"] = time.perf_counter()

        start = time.perf_counter()
        result = await self.p.run_job(spec_job, report)
        end = time.perf_counter()
        assert result.committed
        return {"handover_ms": (end - start) * 1e3, "first_token_ms": (marks["first"] - start) * 1e3,
                "bytes": result.transfer_bytes, "hit_blocks": result.hit_blocks,
                "transfer_s": result.transfer_seconds, "visible_s": result.visible_seconds}


@contextlib.asynccontextmanager
async def pd_pair(p_engine: LLMEngine, plan: Plan, config_file: Path, d_dev: torch.device,
                  share_across_gpus: bool = False, kv_ipc: bool = True,
                  d_engine_options: dict | None = None) -> AsyncIterator[PDPair]:
    """Start D (random weights of ``config_file``) on ``d_dev`` and P's service on ``p_engine``;
    stop both on exit, D's counters left in ``d_counters``. ``d_engine_options``: more of D's
    engine settings (e.g. its ``tp``)."""
    from prefill_node.service import PrefillService

    d_options = {"max_total_tokens": plan.d_kv_tokens, "max_model_len": plan.max_model_len,
                 "max_num_batched_tokens": 4096, "block_size": plan.block_size, "cuda_graph_batch_sizes": [1, 2, 4],
                 "max_running_requests": 8, "share_kv_across_gpus": share_across_gpus, **(d_engine_options or {})}
    parent, child = mp.get_context("spawn").Pipe()
    d_proc = mp.get_context("spawn").Process(target=decode_node_main, args=(child, str(config_file), str(d_dev), d_options),
                                             daemon=True)
    d_proc.start()
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, parent.poll, 600):
        d_proc.kill()
        raise RuntimeError("the decode node did not start")
    ready = parent.recv()
    if ready[0] != "ready":
        d_proc.join(10)
        raise RuntimeError(f"the decode node failed: {ready}")
    d_address = ready[1]
    p = PrefillService(p_engine.config, node_id="p0", cluster_token=TOKEN, engine=p_engine, layerwise_min_tokens=0,
                       kv_ipc=kv_ipc)
    await p.start()
    pair = PDPair(p=p, channel=None, d_address=d_address, p_engine=p_engine)
    try:
        pair.channel = await p.pool.get(d_address)
        yield pair
    finally:
        await p.stop()
        with contextlib.suppress(OSError):
            parent.send(("stop",))
        if await loop.run_in_executor(None, parent.poll, 30):
            pair.d_counters = parent.recv()[1]
        d_proc.join(30)
        if d_proc.is_alive():
            d_proc.kill()


def decode_node_main(conn, config_file: str, device: str, options: dict) -> None:
    """Child process: a decode node service (random weights) that also sinks bench tensors."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s D %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_decode_node(conn, Path(config_file), device, options))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise


async def _decode_node(conn, config_file: Path, device: str, options: dict) -> None:
    from decode_node.service import DecodeService

    across = bool(options.pop("share_kv_across_gpus", False))
    engine = build_engine(config_file, device, seed=1, **options)
    d = DecodeService(engine.config, node_id="d0", cluster_token=TOKEN, on_tokens=lambda updates: None, engine=engine,
                      share_kv_across_gpus=across)
    original = d.server._handler

    async def handler(peer, msg):
        if isinstance(msg, BenchSink):
            received = await peer.recv_tensors([(s, msg.dtype) for s in msg.shapes], 60.0)
            return BenchAck(nbytes=sum(t.numel() * t.element_size() for t in received))
        return await original(peer, msg)

    d.server._handler = handler
    await d.start()
    conn.send(("ready", d.data_address))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    counters = {"kv_bytes_received": d.counters.kv_bytes_received, "kv_transfers": d.counters.kv_transfers,
                "hit_tokens": d.counters.hit_tokens}
    await d.stop()
    conn.send(("counters", counters))


class RawNccl:
    """A plain 2-rank NCCL pair (GPU a sends, GPU b receives), made the way our channel makes its
    own but used without any of our code in between."""

    def __init__(self, sender: torch.device, receiver: torch.device) -> None:
        self.devices = [sender, receiver]
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
        self.groups: list[Any] = [None, None]
        errors: list[BaseException] = []

        def make(rank: int) -> None:
            try:
                torch.cuda.set_device(self.devices[rank])
                st = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False,
                                                           timeout=dt.timedelta(seconds=60))
                group = dist.ProcessGroupNCCL(dist.PrefixStore("raw", st), rank, 2, dist.ProcessGroupNCCL.Options())
                probe = torch.ones(1, device=self.devices[rank])
                work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
                work.wait()
                torch.cuda.synchronize(self.devices[rank])
                self.groups[rank] = group
            except BaseException as e:  # reported by the caller
                errors.append(e)

        threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors or None in self.groups:
            raise RuntimeError(f"raw NCCL pair failed: {errors}")
        self._store = store

    def send_recv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        w0 = self.groups[0].send([src], 1, 0)
        w1 = self.groups[1].recv([dst], 0, 0)
        w0.wait()
        w1.wait()

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(Exception):
                group.abort()
