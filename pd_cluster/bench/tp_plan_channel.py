"""What sending a tensor-parallel step's plan to the other ranks costs on the host, on CPU: gloo's
two broadcasts (header, then payload: what the plans took before) against one message of the
shared-memory ring (:class:`~pd_cluster.engine.tp_channel.PlanChannel`).

Rank 0 sends a plan every ``--gap-ms`` (a decode step's length: the ranks wait for it as they do
in service), stamped with the monotonic clock every process of the host shares; each other rank
notes when the plan is in its hands. Printed per payload size: the delivery's median and p90 and
rank 0's time in the send, for both ways, and their ratios (gloo / ring). Payloads: a replayed
decode step's words at batch 1 and 64, and one over a slot (it goes over gloo either way).

    python -m pd_cluster.bench.tp_plan_channel [--ranks 2] [--steps 2000] [--words 12,705,70000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import time

import numpy as np
import torch
import torch.distributed as dist

from pd_cluster.engine.tp_channel import PlanChannel
from pd_cluster.engine.tp_group import make_store

KINDS = ("gloo", "ring")
HEADER_LEN = 8
TIMEOUT_S = 60.0


class _Ways:
    """One rank's two ways of moving a plan: the control group's broadcasts, and the channel."""

    def __init__(self, port: int, rank: int, size: int) -> None:
        self.store = make_store("127.0.0.1", port, size, leader=rank == 0)
        self.timeout = dt.timedelta(seconds=TIMEOUT_S)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, size, self.timeout)
        self.channel = PlanChannel.open(self.store, self.control, rank, size)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.control.broadcast(tensor, 0, self.timeout).wait(self.timeout)

    def send(self, kind: str, head: list[int], payload: np.ndarray) -> None:
        if kind == "ring":
            self.channel.send(head, [payload], TIMEOUT_S)
            return
        self._broadcast(torch.tensor(head, dtype=torch.int64))
        self._broadcast(torch.from_numpy(payload))

    def receive(self, kind: str) -> list[int]:
        """The next plan's header (its payload taken in too)."""
        if kind == "ring":
            return self.channel.receive(TIMEOUT_S)[0]
        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._broadcast(head)
        self._broadcast(torch.empty(int(head[1]), dtype=torch.int64))
        return head.tolist()


def _plans(words: list[int], steps: int):
    for kind in KINDS:
        for n in words:
            for _ in range(steps):
                yield kind, n


def _reader(port: int, rank: int, size: int, words: list[int], steps: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    ways = _Ways(port, rank, size)
    delays: dict[str, list[int]] = {}
    for kind, n in _plans(words, steps):
        head = ways.receive(kind)
        delays.setdefault(f"{kind}/{n}", []).append(time.perf_counter_ns() - head[2])
    ways.channel.close()
    out.put(delays)


def _quantile(ns: list[int], q: float) -> float:
    return round(float(np.quantile(np.array(ns), q)) / 1e3, 1)


def measure(ranks: int, steps: int, words: list[int], gap_ms: float) -> dict:
    """Every figure (microseconds) by payload size and way, and the ratios."""
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_port = _free_port()
    readers = [ctx.Process(target=_reader, args=(store_port, r, ranks, words, steps, out), daemon=True)
               for r in range(1, ranks)]
    for proc in readers:
        proc.start()
    ways = _Ways(store_port, 0, ranks)
    sends: dict[str, list[int]] = {}
    payloads = {n: np.arange(n, dtype=np.int64) for n in words}
    for kind, n in _plans(words, steps):
        time.sleep(gap_ms / 1e3)
        start = time.perf_counter_ns()
        ways.send(kind, [1, n, start, 0, 0, 0, 0, 0], payloads[n])
        sends.setdefault(f"{kind}/{n}", []).append(time.perf_counter_ns() - start)
    delays: dict[str, list[int]] = {}
    for _ in readers:
        for key, ns in out.get(timeout=600).items():
            delays.setdefault(key, []).extend(ns)
    for proc in readers:
        proc.join(30)
    ways.channel.close()
    result: dict = {"ranks": ranks, "steps": steps, "gap_ms": gap_ms, "slot_words": ways.channel.ring.capacity,
                    "words": {}}
    for n in words:
        row = {}
        for kind in KINDS:
            key = f"{kind}/{n}"
            row[kind] = {"deliver_p50_us": _quantile(delays[key], 0.5), "deliver_p90_us": _quantile(delays[key], 0.9),
                         "send_p50_us": _quantile(sends[key], 0.5)}
        row["deliver_gloo_vs_ring"] = round(row["gloo"]["deliver_p50_us"] / max(row["ring"]["deliver_p50_us"], 0.1), 1)
        row["send_gloo_vs_ring"] = round(row["gloo"]["send_p50_us"] / max(row["ring"]["send_p50_us"], 0.1), 1)
        result["words"][str(n)] = row
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--words", default="12,705,70000", help="payload sizes (int64 words), comma-separated")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="time between two plans")
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.steps, [int(w) for w in args.words.split(",")], args.gap_ms)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
