"""The master's CPU a relayed token, in one process, without sockets: node frames in, SSE bytes out.

``python -m pd_cluster.bench.master_relay_path --streams 400 --steps 256`` builds a real master
app (the default model's tokenizer), registers synthetic decode nodes in its registry, admits
``--streams`` streaming chat requests and answers each through the master's own streamed
response with an ASGI ``send`` that only counts bytes. Then, a step at a time, every node's
``token_deltas`` frame (as :mod:`pd_cluster.bench.stamped_nodes` writes them) goes through the
master's frame handler, and the loop runs the streams' tasks until each wrote its token. It
prints the process's CPU microseconds a token (the nodes' frames are built before the clock
starts: only the master's work is timed). No socket, client or node process shares the
CPU, so two builds compare on a busy machine: run this file (``python
.../pd_cluster/bench/master_relay_path.py``) with ``PYTHONPATH`` at each checkout, several times
each, interleaved, and compare the lowest figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

from master.answer_shapes import SHAPES, StreamHead
from master import answers
from master.answers import _StreamWriter
from master.app import create_app
from master.config import MasterSettings
from master.event_stream import EventStreamResponse
from master.fanout import FanOut, PromptChoices
from master.node_ws import handle_frame
from pd_cluster import protocol
from pd_cluster.bench.master_load import kv_spec_for
from pd_cluster.bench.stamped_nodes import _STAMP, CAPACITY_TOKENS, _Job, delta_json, frames_of
from pd_cluster.default_model import resolve_model_path
from pd_cluster.sampling_params import SamplingParams


def _streamed(fan: FanOut, writer: _StreamWriter) -> Any:
    """The master's streamed response (a build before ``answers.streamed`` made it in place)."""
    if hasattr(answers, "streamed"):
        return answers.streamed(fan, writer)
    return EventStreamResponse(answers._stream(fan, writer), fan.hang_up)


def _register(ctx: Any, count: int) -> list[Any]:
    spec, context = kv_spec_for(resolve_model_path("default"))
    nodes = []
    for k in range(count):
        record = ctx.registry.add(protocol.Register(
            node_id=f"synthetic-decode-{k}", role="decode", model=spec.model, kv_spec=spec,
            data_address=f"127.0.0.1:{100 + k}", device="cpu",
            capacity=protocol.NodeCapacity(max_total_tokens=CAPACITY_TOKENS, max_running_requests=4096,
                                           max_model_len=context)))
        record.outbox = asyncio.Queue()  # nothing reads the jobs here
        nodes.append(record)
    return nodes


async def _open_streams(ctx: Any, streams: int, steps: int, sent: list[int]) -> tuple[list[asyncio.Task], dict]:
    """Admit the streams and start their responses; each node's jobs, by node id."""
    req = SimpleNamespace(logprobs=None, parses_tool_calls=False, tool_names=set(), include_usage=False)
    never = asyncio.get_running_loop().create_future()

    async def send(message: dict[str, Any]) -> None:
        sent[0] += len(message.get("body", b""))

    async def receive() -> dict[str, Any]:
        return await never

    tasks, jobs = [], {}
    for _ in range(streams):
        r = ctx.relay.create(ctx.relay.new_request_id("chatcmpl"), list(range(1, 513)),
                             SamplingParams(max_tokens=steps, seed=0), True, time.monotonic())
        fan = FanOut(ctx.relay, [PromptChoices([r], 1)])
        await fan.admit()
        writer = _StreamWriter(ctx, fan, req, StreamHead(r.request_id, SHAPES["chat"], 0, "m", False), None)
        response = _streamed(fan, writer)
        tasks.append(asyncio.create_task(response({"type": "http"}, receive, send)))
        jobs.setdefault(r.decode_id, []).append(_Job(r.current.attempt_id, steps, time.monotonic()))
    return tasks, jobs


def _node_frames(jobs: dict[str, list[_Job]], steps: int) -> list[list[tuple[str, str]]]:
    """Every step's frames, by node id, as the nodes would send them (stamped when built)."""
    steps_frames = []
    for _ in range(steps):
        now = time.monotonic()
        frames = []
        for node_id, node_jobs in jobs.items():
            deltas = []
            for job in node_jobs:
                job.remaining -= 1
                deltas.append(delta_json(job, now))
                job.first = False
            frames += [(node_id, frame.replace(_STAMP, f"{now:.6f}")) for frame in frames_of(deltas)]
        steps_frames.append(frames)
    return steps_frames


async def measure(streams: int, steps: int, nodes: int, settle_heap: bool) -> dict[str, float]:
    os.environ.setdefault("PD_CLUSTER_TOKEN", "relay-path-bench")
    app = create_app(MasterSettings())
    ctx = app.state.ctx
    if settle_heap:  # as a master process does once it has started
        from master.heap import settle

        settle(ctx.metrics)
    records = {record.node_id: record for record in _register(ctx, nodes)}
    sent = [0]
    tasks, jobs = await _open_streams(ctx, streams, steps, sent)
    await asyncio.sleep(0)
    steps_frames = _node_frames(jobs, steps)  # the nodes' work, before the master's is timed
    cpu, wall = time.process_time(), time.perf_counter()
    for frames in steps_frames:
        for node_id, frame in frames:
            handle_frame(ctx, records[node_id], frame)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    tokens = streams * steps
    return {"cpu_us_per_token": 1e6 * (time.process_time() - cpu) / tokens,
            "wall_us_per_token": 1e6 * (time.perf_counter() - wall) / tokens, "sse_bytes": sent[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--steps", type=int, default=256, help="tokens a stream")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--no-settle", action="store_true", help="leave the heap as it is (a build without master.heap)")
    args = p.parse_args(argv)
    settle_heap = not args.no_settle and _has_heap()
    result = asyncio.run(measure(args.streams, args.steps, args.nodes, settle_heap))
    sys.stdout.write(f"{result['cpu_us_per_token']:.2f} us a token (CPU), {result['wall_us_per_token']:.2f} wall, "
                     f"{result['sse_bytes']} SSE bytes, heap settled: {settle_heap}\n")
    return 0


def _has_heap() -> bool:
    import importlib.util

    return importlib.util.find_spec("master.heap") is not None


if __name__ == "__main__":
    raise SystemExit(main())
