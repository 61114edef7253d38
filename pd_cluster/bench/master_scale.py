"""The master at scale: the tokens a second one master (and several) relays at a latency bound.

``pd-cluster bench master --concurrency 250,500,1000 --masters 1,2,4``: for each number of
masters, that many ``pd-cluster master`` processes start; synthetic decode nodes
(:mod:`pd_cluster.bench.stamped_nodes`, in a few processes) join every one of them, as real
nodes given a list of masters do; then, for each concurrency, closed-loop client streams
(:mod:`pd_cluster.bench.scale_client`, in several processes so the client is never the limit)
spread over the masters send chat requests of ``--input-len`` prompt tokens for
``--output-len`` tokens each, and a window of steady load is measured:

* tokens a second relayed to the clients;
* dispatch p50/p99: a request's arrival at its master to its job leaving for a node (the
  masters' own request log, ``dispatch_s``);
* added ITL p50/p99: a token's frame leaving its node to its SSE chunk reaching the client (the
  master's share of every inter-token latency, wire included): the kernel's receive stamp of the
  chunk's bytes where Linux gives one (:mod:`pd_cluster.bench.sse_wire`), so that a client process
  busy with other reads does not add its own queue; the same at the client's read (``*_read_*``)
  shows that queue;
* TTFT p50/p99 at the client, and the masters' CPU (cores, and microseconds a token);
* the CPU of each client process and of the synthetic nodes: a client process near a whole
  core is itself the limit (its tokens wait for it, not for the master), and the run warns.

Where Linux allows it, the masters run on cores of their own, apart from the nodes and the
clients (:mod:`pd_cluster.bench.master_cores`; ``--no-pin`` turns it off); each level records the
split. ``--per-master`` reads ``--concurrency`` per master, so 1, 2 and 4 masters carry the same
load each and their sum shows how masters scale.

The key ``master_tokens_per_s_dispatch_p99_10ms`` is the most tokens a second one master
relayed with dispatch p99 <= 10 ms and added ITL p99 <= 1 ms; ``scaling`` holds the same figure
for each number of masters.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pd_cluster import protocol
from pd_cluster.bench.compare import log_seconds, percentile, server_lines
from pd_cluster.bench import master_load
from pd_cluster.bench.master_cores import CoreSplit, available_cores, split_cores
from pd_cluster.bench.master_load import CLUSTER_TOKEN, SERVED_NAME, MasterProcess
from pd_cluster.bench.scale_client import ClientPlan, ClientResult, client_main
from pd_cluster.bench.stamped_nodes import nodes_main

logger = logging.getLogger(__name__)

#: The bounds of the key figure.
DISPATCH_P99_BOUND_S = 0.010
ADDED_ITL_P99_BOUND_S = 0.001
#: Distinct prompts the clients take turns with.
PROMPTS = 256
#: After the ramp, before the window opens.
SETTLE_S = 0.5
#: A client process busier than this (cores) may be what limits the run.
CLIENT_CPU_WARN = 0.8


@dataclass
class ScaleOptions:
    model: str
    masters: list[int] = field(default_factory=lambda: [1])
    #: Worker processes of each master (``pd-cluster master --workers``): a list, one cluster each.
    master_workers: list[int] = field(default_factory=lambda: [1])
    concurrency: list[int] = field(default_factory=lambda: [1000])
    decode_nodes: int = 8
    step_ms: float = 10.0
    input_len: int = 512
    output_len: int = 256
    measure_s: float = 10.0
    client_procs: int = max(1, min(8, (os.cpu_count() or 2) // 4))
    node_procs: int = max(1, min(4, (os.cpu_count() or 2) // 8))
    port: int = 8100
    master_args: list[str] = field(default_factory=list)
    #: A checkout whose master is measured (an A/B against another build); None: this one's.
    master_pythonpath: str | None = None
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 120.0
    #: Run the masters on cores of their own, apart from the nodes and clients (where Linux allows).
    pin: bool = True
    #: ``concurrency`` counts streams per master (the level's total is that times the masters).
    per_master: bool = False
    #: Clusters of more master processes (masters x workers) than this are skipped (None: none).
    max_master_procs: int | None = None
    #: Levels of more streams in all than this are skipped (None: none).
    max_streams: int | None = None

    @property
    def ramp_s(self) -> float:
        """Streams start spread over one request's length, so their requests end spread too."""
        return self.output_len * self.step_ms / 1000


def make_prompts(model_dir: Path, input_len: int, count: int = PROMPTS, seed: int = 7) -> list[str]:
    """``count`` distinct user messages of whole words, each ``input_len`` tokens once templated."""
    from transformers import AutoTokenizer

    from pd_cluster.bench.words import whole_word_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = whole_word_ids(tokenizer)
    template = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=True,
                                             add_generation_prompt=True)
    overhead = len(template["input_ids"] if isinstance(template, dict) else template)
    rng = random.Random(seed)
    length = max(input_len - overhead, 1)
    return [tokenizer.decode(rng.choices(words, k=length)).strip() for _ in range(count)]


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and every process below it (Linux ``/proc``; 0 elsewhere)."""
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == p]
    return total


class _Cluster:
    """``count`` masters and the synthetic nodes that joined all of them."""

    def __init__(self, options: ScaleOptions, model_dir: Path, count: int, work_dir: Path, workers: int = 1) -> None:
        self.options, self.model_dir, self.workers = options, model_dir, workers
        ids = [f"synthetic-decode-{i}" for i in range(options.decode_nodes)]
        procs = max(1, min(options.node_procs, len(ids)))
        self.cores = (split_cores(available_cores(), [workers] * count, procs, options.client_procs) if options.pin
                      else CoreSplit(note="not pinned (--no-pin)"))
        logger.info("cores: %s %s", self.cores.note, self.cores.as_dict() if self.cores.pinned else "")
        # A master of W workers takes its port and the W after it (the workers' private ports).
        step = workers + 1 if workers > 1 else 1
        extra = ["--workers", str(workers)] if workers > 1 else []
        self.masters = [MasterProcess(str(model_dir), options.port + i * step, work_dir / f"master{i}.log",
                                      [*options.master_args, *extra], options.master_pythonpath,
                                      self.cores.masters[i] if self.cores.pinned else None)
                        for i in range(count)]
        urls = [f"ws://127.0.0.1:{m.port}{protocol.NODE_WS_PATH}" for m in self.masters]
        ctx = multiprocessing.get_context("spawn")
        self.nodes = [ctx.Process(target=nodes_main, daemon=True,
                                  args=(urls, str(model_dir), ids[k::procs], options.step_ms / 1000, CLUSTER_TOKEN,
                                        self.cores.nodes))
                      for k in range(procs)]

    def start(self) -> None:
        for m in self.masters:
            m.start()
        for m in self.masters:
            m.wait_for_nodes(0, self.options.ready_timeout_s)
        for p in self.nodes:
            p.start()
        for m in self.masters:
            m.wait_for_nodes(self.options.decode_nodes, self.options.ready_timeout_s)
            # Every worker, at its private port (the public one answers from any one of them).
            for i in range(self.workers if self.workers > 1 else 0):
                m.wait_for_nodes(self.options.decode_nodes, self.options.ready_timeout_s,
                                 f"http://127.0.0.1:{m.port + 1 + i}")

    def stop(self) -> None:
        for p in self.nodes:
            if p.pid is not None:
                p.terminate()
                p.join(10)
        for m in self.masters:
            m.stop()

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds so far of the masters (every process of each) and of the synthetic nodes."""
        return (sum(tree_cpu_seconds(m.proc.pid) for m in self.masters if m.proc is not None),
                sum(tree_cpu_seconds(p.pid) for p in self.nodes if p.pid is not None))


def _run_clients(options: ScaleOptions, cluster: _Cluster, concurrency: int,
                 prompts: list[str]) -> tuple[list[ClientResult], tuple[float, float]]:
    """The client processes for one concurrency: start them, then time the window; returns
    their results and the masters' and the nodes' CPU seconds inside the window."""
    ctx = multiprocessing.get_context("spawn")
    procs = max(1, min(options.client_procs, concurrency))
    pipes, children = [], []
    urls = [m.url for m in cluster.masters]
    for k in range(procs):
        plan = ClientPlan(urls=urls, streams=list(range(k, concurrency, procs)), total_streams=concurrency,
                          prompts=prompts, model=SERVED_NAME, max_tokens=options.output_len, start=0.0,
                          ramp_s=options.ramp_s, window_start=0.0, end=0.0,
                          request_timeout_s=options.request_timeout_s, cpus=cluster.cores.clients)
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=client_main, args=(plan, theirs), daemon=True)
        child.start()
        pipes.append(ours)
        children.append(child)
    try:
        for pipe in pipes:  # each one imported what it needs and waits for the start
            if not pipe.poll(options.ready_timeout_s):
                raise TimeoutError("a load client process did not start")
            pipe.recv()
        start = time.monotonic() + 0.2
        window_start = start + options.ramp_s + SETTLE_S
        end = window_start + options.measure_s
        for pipe in pipes:
            pipe.send((start, window_start, end))
        time.sleep(max(0.0, window_start - time.monotonic()))
        masters_before, nodes_before = cluster.cpu_seconds()
        time.sleep(max(0.0, end - time.monotonic()))
        masters_after, nodes_after = cluster.cpu_seconds()
        cpu = (masters_after - masters_before, nodes_after - nodes_before)
        results = []
        for pipe in pipes:
            if not pipe.poll(options.request_timeout_s + 30):
                raise TimeoutError("a load client process did not report")
            results.append(pipe.recv())
        return results, cpu
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.terminate()


def _dispatch_seconds(cluster: _Cluster, requests: list[tuple[int, str]], timeout_s: float = 15.0) -> list[float]:
    """The masters' dispatch_s of ``requests`` (each is logged when it ends: cut-off streams
    once their master saw the client leave)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [server_lines(m.log_path.read_text(errors="replace")) for m in cluster.masters]
        found = [lines[m].get(rid) for m, rid in requests]
        if all(f is not None for f in found) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [d for d in (log_seconds(f, "dispatch_s") for f in found if f is not None) if d is not None]


def _level(options: ScaleOptions, cluster: _Cluster, concurrency: int, prompts: list[str]) -> dict[str, Any]:
    results, (cpu, node_cpu) = _run_clients(options, cluster, concurrency, prompts)
    added = sorted(x for r in results for x in r.added_s)
    read_added = sorted(x for r in results for x in r.read_added_s)
    ttft = sorted(x for r in results for x in r.ttft_s)
    requests = [q for r in results for q in r.requests]
    dispatch = sorted(_dispatch_seconds(cluster, requests))
    tokens = sum(r.tokens for r in results)
    level = {
        "masters": len(cluster.masters),
        "workers": cluster.workers,
        "concurrency": concurrency,
        "tokens_per_s": tokens / options.measure_s,
        "tokens": tokens,
        "requests": len(requests),
        "requests_by_master": [sum(1 for m, _ in requests if m == i) for i in range(len(cluster.masters))],
        "completed": sum(r.completed for r in results),
        "failed": sum(r.failed for r in results),
        "errors": [e for r in results for e in r.errors][:5],
        "dispatch_p50_s": statistics.median(dispatch) if dispatch else None,
        "dispatch_p99_s": percentile(dispatch, 0.99),
        "added_itl_p50_s": statistics.median(added) if added else None,
        "added_itl_p99_s": percentile(added, 0.99),
        "added_itl_stamped_by": "kernel" if all(r.kernel_stamps for r in results) else "read",
        "added_itl_read_p50_s": statistics.median(read_added) if read_added else None,
        "added_itl_read_p99_s": percentile(read_added, 0.99),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99),
        "master_cpu_cores": cpu / options.measure_s,
        "master_cpu_us_per_token": 1e6 * cpu / tokens if tokens else None,
        "node_cpu_cores": node_cpu / options.measure_s,
        "client_cpu_cores": [r.cpu_s / options.measure_s for r in results],
        "cores": cluster.cores.as_dict(),
    }
    level["client_limited"] = max(level["client_cpu_cores"]) > CLIENT_CPU_WARN
    if level["client_limited"]:
        logger.warning("a client process used %.2f of a core (over %.1f): the clients may be what limits this level; "
                       "give them more processes (--client-procs) or cores", max(level["client_cpu_cores"]),
                       CLIENT_CPU_WARN)
    level["within_bounds"] = within_bounds(level)
    logger.info("%d master(s) of %d worker(s), %d streams: %.0f tokens/s, dispatch p99 %s s, added ITL p99 %s s, "
                "%d failed", level["masters"], cluster.workers, concurrency, level["tokens_per_s"], level["dispatch_p99_s"],
                level["added_itl_p99_s"], level["failed"])
    return level


def within_bounds(level: dict[str, Any]) -> bool:
    """Served without failures at dispatch p99 <= 10 ms and added ITL p99 <= 1 ms."""
    return (level["failed"] == 0 and level["tokens"] > 0
            and level["dispatch_p99_s"] is not None and level["dispatch_p99_s"] <= DISPATCH_P99_BOUND_S
            and level["added_itl_p99_s"] is not None and level["added_itl_p99_s"] <= ADDED_ITL_P99_BOUND_S)


def best_within_bounds(levels: list[dict[str, Any]]) -> float | None:
    rates = [lv["tokens_per_s"] for lv in levels if lv["within_bounds"]]
    return max(rates) if rates else None


def run_scale(options: ScaleOptions, work_dir: Path) -> dict[str, Any]:
    """Every (masters, workers, concurrency) level of ``options``, and the key figures: one master's
    best within the bounds (any worker count), and the best of each number of masters."""
    from pd_cluster.default_model import resolve_model_path

    model_dir = resolve_model_path(options.model)
    prompts = make_prompts(model_dir, options.input_len)
    levels: list[dict[str, Any]] = []
    clusters, skipped = plan_levels(options)
    for count, workers, streams in clusters:
        logs = work_dir / (f"masters{count}" + (f"-workers{workers}" if workers > 1 else ""))
        cluster = _Cluster(options, model_dir, count, logs, workers)
        logs.mkdir(parents=True, exist_ok=True)
        cluster.start()
        try:
            levels += [_level(options, cluster, total, prompts) for total in streams]
        finally:
            cluster.stop()
    scaling = {str(count): best_within_bounds([lv for lv in levels if lv["masters"] == count])
               for count in options.masters}
    most = {str(count): max((lv["tokens_per_s"] for lv in levels if lv["masters"] == count), default=None)
            for count in options.masters}
    return {
        "options": {k: v for k, v in options.__dict__.items() if k != "model"},
        "model": model_dir.name,
        "master_tokens_per_s_dispatch_p99_10ms": scaling.get("1"),
        "scaling": scaling,
        "most_tokens_per_s": most,
        "by_workers": {str(w): best_within_bounds([lv for lv in levels if lv["masters"] == 1 and lv["workers"] == w])
                       for w in options.master_workers},
        "scaling_by_load": scaling_by_load(levels),
        "skipped": skipped,
        "levels": levels,
    }


def plan_levels(options: ScaleOptions) -> tuple[list[tuple[int, int, list[int]]], list[str]]:
    """The clusters to run, (masters, workers each, each level's streams in all), and a line for
    each cluster or level skipped by ``max_master_procs`` or ``max_streams``."""
    clusters, skipped = [], []
    for count in options.masters:
        for workers in options.master_workers:
            if options.max_master_procs is not None and count * workers > options.max_master_procs:
                skipped.append(f"{count} masters x {workers} workers: over {options.max_master_procs} master processes")
                continue
            streams = []
            for c in options.concurrency:
                total = c * count if options.per_master else c
                if options.max_streams is not None and total > options.max_streams:
                    skipped.append(f"{count} masters x {workers} workers at {total} streams: over {options.max_streams}")
                else:
                    streams.append(total)
            if streams:
                clusters.append((count, workers, streams))
    return clusters, skipped


def scaling_by_load(levels: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each load a master (its workers, its streams), the levels of each number of masters:
    masters that scale linearly relay the same tokens/s each."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for lv in levels:
        key = f"{lv['workers']} workers, {lv['concurrency'] // lv['masters']} streams a master"
        out.setdefault(key, {})[str(lv["masters"])] = {
            "tokens_per_s": lv["tokens_per_s"], "tokens_per_s_a_master": lv["tokens_per_s"] / lv["masters"],
            "within_bounds": lv["within_bounds"]}
    return out


def markdown(doc: dict[str, Any]) -> str:
    o = doc["options"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.2f}"

    rows = [f"| {lv['masters']} | {lv['concurrency']} | {lv.get('workers', 1)} | {lv['tokens_per_s']:.0f} | {ms(lv['dispatch_p50_s'])} | "
            f"{ms(lv['dispatch_p99_s'])} | {ms(lv['added_itl_p50_s'])} | {ms(lv['added_itl_p99_s'])} | "
            f"{ms(lv.get('added_itl_read_p99_s'))} | "
            f"{ms(lv['ttft_p50_s'])} | {lv['master_cpu_cores']:.2f} | {max(lv.get('client_cpu_cores', []), default=0):.2f} | {lv['failed']} | "
            f"{'yes' if lv['within_bounds'] else 'no'} |" for lv in doc["levels"]]
    key = doc["master_tokens_per_s_dispatch_p99_10ms"]
    return "\n".join([
        f"# The master at scale, on {doc['device']} ({doc['date']})", "",
        f"{o['decode_nodes']} synthetic decode nodes ({o['step_ms']:g} ms a step) joined to every master; closed-loop "
        f"chat streams of {o['input_len']} prompt tokens and {o['output_len']} output tokens from "
        f"{o['client_procs']} client processes; {o['measure_s']:g} s measured a level"
        + (f"; master flags `{' '.join(o['master_args'])}`" if o["master_args"] else "") + ".", "",
        f"Tokens/s of one master at dispatch p99 <= 10 ms and added ITL p99 <= 1 ms: "
        f"{'-' if key is None else f'{key:.0f}'}; by masters: "
        + ", ".join(f"{k}: {'-' if v is None else f'{v:.0f}'}" for k, v in doc["scaling"].items()), "",
        *[f"Same load a master ({load}): " + ", ".join(
            f"{m} masters {v['tokens_per_s']:.0f} tokens/s ({v['tokens_per_s_a_master']:.0f} a master"
            f"{'' if v['within_bounds'] else ', out of bounds'})" for m, v in by_masters.items()) + "  "
          for load, by_masters in doc.get("scaling_by_load", {}).items() if len(by_masters) > 1],
        *[f"Skipped: {line}.  " for line in doc.get("skipped", [])], "",
        "| masters | streams | workers each | tokens/s | dispatch p50 ms | dispatch p99 ms | added ITL p50 ms | added ITL p99 ms | "
        "added ITL p99 at the client's read ms | "
        "TTFT p50 ms | master CPU (cores) | busiest client (cores) | failed | within bounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
    ])


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pd-cluster bench master``'s flags: :mod:`master_load`'s, and the concurrency mode's."""
    master_load.add_arguments(p)
    d = ScaleOptions(model="default")
    g = p.add_argument_group("concurrency mode", "closed-loop streams through one or several masters")
    g.add_argument("--concurrency", type=_int_list, default=None,
                   help="concurrent client streams (a comma-separated list: one measurement each); given, the run "
                        "measures tokens/s at dispatch and added-ITL bounds instead of the multi-turn load")
    g.add_argument("--masters", type=_int_list, default=d.masters,
                   help="master processes, nodes joined to all, clients spread over them (a list: one cluster each)")
    g.add_argument("--master-workers", type=_int_list, default=d.master_workers,
                   help="worker processes of each master (a list: one cluster each, for every --masters count)")
    g.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens of each request")
    g.add_argument("--measure-s", type=float, default=d.measure_s, help="seconds measured at each concurrency")
    g.add_argument("--client-procs", type=int, default=d.client_procs, help="load client processes")
    g.add_argument("--node-procs", type=int, default=d.node_procs, help="processes the synthetic nodes run in")
    g.add_argument("--per-master", action="store_true",
                   help="--concurrency counts streams per master (a level's total is that times --masters)")
    g.add_argument("--max-master-procs", type=int, default=None,
                   help="skip the clusters of more master processes (masters x workers) than this")
    g.add_argument("--max-streams", type=int, default=None, help="skip the levels of more streams in all than this")
    g.add_argument("--pin", action=argparse.BooleanOptionalAction, default=d.pin,
                   help="run each master on cores of its own, apart from the nodes and clients (Linux)")
    g.add_argument("--master-pythonpath", default=None,
                   help="run the masters from this checkout (PYTHONPATH), e.g. another build's, to compare it")


def run_from_args(args: argparse.Namespace) -> int:
    """``pd-cluster bench master``: with ``--concurrency`` this module's runs, else the
    multi-turn load's; the JSON and table (exit 1 on failures)."""
    if args.concurrency is None:
        return master_load.run_from_args(args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    d = ScaleOptions(model=args.model)
    options = ScaleOptions(
        model=args.model, masters=args.masters, master_workers=args.master_workers, concurrency=args.concurrency,
        decode_nodes=args.decode_nodes if args.decode_nodes is not None else d.decode_nodes,
        step_ms=args.step_ms if args.step_ms is not None else d.step_ms, input_len=args.input_len,
        output_len=args.output_len if args.output_len is not None else d.output_len, measure_s=args.measure_s,
        client_procs=args.client_procs, node_procs=args.node_procs, port=args.port,
        master_args=args.master_args.split(), master_pythonpath=args.master_pythonpath, pin=args.pin,
        per_master=args.per_master, max_master_procs=args.max_master_procs, max_streams=args.max_streams)
    date = dt.date.today().isoformat()
    stem = f"master-load-scale-{date}" + (f"-{args.tag}" if args.tag else "")
    doc = run_scale(replace(options), args.out / f"{stem}-logs")
    doc.update(device="cpu", date=date, cpus=os.cpu_count())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = markdown(doc)
    (args.out / f"{stem}.md").write_text(text)
    sys.stdout.write(f"\n{text}\nresults: {args.out / stem}.json\n")
    return 0 if all(lv["failed"] == 0 for lv in doc["levels"]) else 1
