"""The master alone under a served load: its share of TTFT and its CPU per request and token.

Synthetic decode nodes (this module's, in a child process) register with a real master
(``pd-cluster master``, a child process) and answer every job as an engine with a fixed step
time would: the first token at its next step, then one token a step, with the KV events of the
prompt's blocks. The client load is ``pd-cluster bench serve``'s multi-turn workload, streamed
through the master's OpenAI API. No model runs and no GPU is needed, so what is measured is the
master's: arrival to dispatch (template, tokenizing, routing), the hops, and the master
process's CPU time. A change to the master is measured here, on any machine, before it is
measured in the served system.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pd_cluster import protocol
from pd_cluster.block_hash import block_hashes
from pd_cluster.kv_spec import KVSpec
from pd_cluster.node.master_proof import prove_to_master

logger = logging.getLogger(__name__)

#: The name clients ask the master for.
SERVED_NAME = "master-load"
CLUSTER_TOKEN = "master-load-cluster-token"
ADMIN_TOKEN = "master-load-admin-token"
#: Prompt tokens a synthetic node claims to prefill a second (its first token waits for the
#: next step whatever the prompt; this only feeds the master's routing estimates).
PREFILL_TOKENS_PER_S = 50_000.0


@dataclass
class LoadOptions:
    """One run: the nodes the master sees, and the conversations sent through it."""

    model: str
    decode_nodes: int = 2
    step_ms: float = 8.0
    conversations: int = 24
    turns: int = 4
    rate: float = 2.0
    first_turn_len: int = 1024
    turn_len: int = 128
    output_len: int = 128
    #: "any" or "words" (ServeBenchConfig.prompt_vocab)
    prompt_vocab: str = "any"
    port: int = 8100
    master_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 120.0


# ---- synthetic decode nodes ------------------------------------------------------------------


@dataclass
class _Job:
    request_id: str
    remaining: int
    received: float
    blocks: list[int]
    cached_tokens: int
    first: bool = True


class SyntheticDecode:
    """A decode node that speaks the control protocol and streams a fixed token at a fixed step
    time: the master cannot tell it from an engine that fast."""

    def __init__(self, url: str, node_id: str, spec: KVSpec, max_model_len: int, step_s: float,
                 token_id: int, text: str) -> None:
        self.url, self.node_id, self.spec = url, node_id, spec
        self.max_model_len, self.step_s = max_model_len, step_s
        self.token_id, self.text = token_id, text
        self.capacity = 1 << 22
        self.jobs: dict[str, _Job] = {}
        #: Blocks "in its prefix cache": what it announced (and reports as the next prompts' hits).
        self.stored: set[int] = set()

    async def run(self) -> None:
        from websockets.asyncio.client import connect

        async with connect(self.url, max_size=2 * protocol.MAX_MESSAGE_BYTES,
                           compression=None) as ws:  # as a node's link dials
            await prove_to_master(ws, CLUSTER_TOKEN, self.node_id)
            register = protocol.Register(
                node_id=self.node_id, role="decode", model=self.spec.model, kv_spec=self.spec,
                data_address=f"127.0.0.1:{9 + len(self.node_id)}", device="cpu",
                capacity=protocol.NodeCapacity(max_total_tokens=self.capacity, max_running_requests=1024,
                                               max_model_len=self.max_model_len),
            )
            await ws.send(protocol.encode(register))
            reply = protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 30.0))
            if not isinstance(reply, protocol.Registered):
                raise RuntimeError(f"{self.node_id} was not registered: {reply}")
            await asyncio.gather(self._read(ws), self._steps(ws), self._heartbeat(ws))

    async def _read(self, ws: Any) -> None:
        async for frame in ws:
            msg = protocol.parse_master_message(frame)
            if isinstance(msg, protocol.GenerateJob):
                blocks = block_hashes(msg.token_ids, self.spec.block_size)
                held = next((i for i, h in enumerate(blocks) if h not in self.stored), len(blocks))
                self.jobs[msg.request_id] = _Job(msg.request_id, msg.sampling.max_tokens, time.monotonic(), blocks,
                                                 held * self.spec.block_size)
            elif isinstance(msg, protocol.Abort):
                self.jobs.pop(msg.request_id, None)

    async def _steps(self, ws: Any) -> None:
        """Every step, one token for every job (a job that came in during a step starts at the
        next one, as on an engine)."""
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            tick += self.step_s
            await asyncio.sleep(max(0.0, tick - loop.time()))
            now = time.monotonic()
            deltas: list[protocol.TokenDelta] = []
            stored: list[list[int]] = []
            for job in list(self.jobs.values()):
                job.remaining -= 1
                done = job.remaining <= 0
                deltas.append(protocol.TokenDelta(
                    request_id=job.request_id, token_ids=[self.token_id], text=self.text,
                    finish_reason="length" if done else None,
                    cached_tokens=job.cached_tokens if job.first else None,
                    node_ttft_s=now - job.received if job.first else None,
                ))
                if job.first:
                    job.first = False
                    self.stored.update(job.blocks)
                    stored.append(job.blocks)
                if done:
                    del self.jobs[job.request_id]
            # What a decode node sends after a step: the step's deltas in one frame, and the blocks
            # each new request stored (its prefix cache reports an insert at a time).
            if deltas:
                for frame in protocol.encode_frames(protocol.TokenDeltas(deltas=deltas)):
                    await ws.send(frame)
            for blocks in stored:
                await ws.send(protocol.encode(protocol.KVEvents(stored=blocks)))

    async def _heartbeat(self, ws: Any) -> None:
        while True:
            running = len(self.jobs)
            await ws.send(protocol.encode(protocol.NodeStatus(
                running=running, free_kv_tokens=self.capacity - 2048 * running, total_kv_tokens=self.capacity,
                prefill_tokens_per_s=PREFILL_TOKENS_PER_S, decode_step_base_s=self.step_s,
            )))
            await asyncio.sleep(0.5)


def kv_spec_for(model_dir: Path, block_size: int = 16) -> tuple[KVSpec, int]:
    """The KV spec an engine would register for this model (bfloat16), and its context length."""
    from pd_cluster.model.config import ModelConfig

    config = ModelConfig.from_path(model_dir)
    spec = KVSpec(model=config.name, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                  head_dim=config.head_dim, dtype="bfloat16", block_size=block_size)
    return spec, config.max_position_embeddings


def _nodes_main(url: str, model_dir: str, count: int, step_s: float) -> None:
    """The child process that runs the synthetic decode nodes until it is terminated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_id = tokenizer.encode(" the", add_special_tokens=False)[0]
    text = tokenizer.decode([token_id])
    spec, context = kv_spec_for(Path(model_dir))

    async def main() -> None:
        nodes = [SyntheticDecode(url, f"synthetic-decode-{i}", spec, context, step_s, token_id, text)
                 for i in range(count)]
        await asyncio.gather(*(n.run() for n in nodes))

    asyncio.run(main())


# ---- the master ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MasterProcess:
    """``pd-cluster master`` as a child process, its log in a file."""

    def __init__(self, model: str, port: int, log_path: Path, extra: list[str], pythonpath: str | None = None,
                 cpus: list[int] | None = None) -> None:
        self.port, self.log_path = port, log_path
        #: Where the master's code is imported from (another build's checkout); None: this one's.
        self.pythonpath = pythonpath
        #: The cores it (and every process it starts) runs on; None: any.
        self.cpus = cpus
        # ``-m`` puts the working directory first on the path: run from a checkout, its own master
        # would be imported whatever PYTHONPATH says. ``-P`` leaves it out (another build's is measured).
        isolated = ["-P"] if pythonpath is not None else []
        self.args = [sys.executable, *isolated, "-m", "pd_cluster.cli", "master", "--host", "127.0.0.1",
                     "--port", str(port), "--model", model, "--served-model-name", SERVED_NAME, *extra]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PD_CLUSTER_TOKEN": CLUSTER_TOKEN, "PD_ADMIN_TOKEN": ADMIN_TOKEN}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = self.pythonpath
        self._log = self.log_path.open("w")
        cpus = self.cpus
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # in the child, before it runs
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)

    def wait_for_nodes(self, count: int, timeout: float, url: str | None = None) -> None:
        """Until ``count`` decode nodes are active (0: until the master answers) as seen at ``url``
        (default: the master's public address; a worker's private address sees that worker's)."""
        import httpx

        assert self.proc is not None
        url = url or self.url
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the master exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                nodes = httpx.get(url + "/admin/nodes", headers=headers, timeout=5).json()["data"]
                if sum(1 for n in nodes if n.get("state") == "active") >= count:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{count} synthetic decode nodes not active after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()


# ---- one run ---------------------------------------------------------------------------------


def run_master_load(options: LoadOptions, work_dir: Path) -> dict[str, Any]:
    """Start the master and the synthetic nodes, send the conversations, and report."""
    from pd_cluster.bench.compare import log_seconds, percentile, server_lines, ttft_parts, turn_summary
    from pd_cluster.bench.serve.config import ServeBenchConfig
    from pd_cluster.bench.serve.runner import run_serve_bench
    from pd_cluster.default_model import resolve_model_path

    model_dir = resolve_model_path(options.model)
    work_dir.mkdir(parents=True, exist_ok=True)
    master = MasterProcess(str(model_dir), options.port, work_dir / "master.log", options.master_args)
    nodes = multiprocessing.get_context("spawn").Process(
        target=_nodes_main, daemon=True,
        args=(f"ws://127.0.0.1:{options.port}{protocol.NODE_WS_PATH}", str(model_dir), options.decode_nodes,
              options.step_ms / 1000),
    )
    master.start()
    try:
        master.wait_for_nodes(0, options.ready_timeout_s)
        nodes.start()
        master.wait_for_nodes(options.decode_nodes, options.ready_timeout_s)
        config = ServeBenchConfig(
            base_url=master.url, model=SERVED_NAME, tokenizer=str(model_dir), endpoint="chat",
            workload="multi-turn", num_conversations=options.conversations, turns=options.turns,
            first_turn_len=options.first_turn_len, input_len=options.turn_len, output_len=options.output_len,
            rates=[options.rate], save_requests=True, progress=False, seed=77, prompt_vocab=options.prompt_vocab,
            request_timeout=options.request_timeout_s,
        )
        assert master.proc is not None
        cpu_before, wall_before = cpu_seconds(master.proc.pid), time.monotonic()
        sweep = run_serve_bench(config)
        cpu_after, wall = cpu_seconds(master.proc.pid), time.monotonic() - wall_before
    finally:
        if nodes.pid is not None:  # started
            nodes.terminate()
            nodes.join(10)
        master.stop()
    records = sweep.results[0].records
    lines = server_lines((work_dir / "master.log").read_text(errors="replace"))
    tokens = sum(r.output_tokens for r in records if r.ok)
    cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    dispatch = [d for d in (log_seconds(f, "dispatch_s") for f in lines.values()) if d is not None]
    # Cache-aware routing at work: a conversation's later turns find its earlier turns' blocks on
    # the decode node that served them, and stay there.
    later = [r for r in records if r.ok and r.turn > 0]
    homes: dict[int, set[str]] = {}
    for r in records:
        node = lines.get(r.request_id or "", {}).get("decode")
        if r.ok and node:
            homes.setdefault(r.conversation, set()).add(node)
    return {
        "options": {k: v for k, v in options.__dict__.items() if k != "model"},
        "model": model_dir.name,
        **turn_summary(records),
        "ttft_later_parts_p50_s": ttft_parts(records, lines),
        "dispatch_p50_s": statistics.median(dispatch) if dispatch else None,
        "dispatch_p90_s": percentile(dispatch, 0.9),
        "later_turns_cached_fraction": (sum(r.cached_tokens or 0 for r in later)
                                        / max(sum(r.prompt_tokens or 0 for r in later), 1)),
        "conversations_on_one_decode": sum(1 for h in homes.values() if len(h) == 1) / max(len(homes), 1),
        "output_tokens": tokens,
        "duration_s": wall,
        "master_cpu_s": cpu,
        "master_cpu_share": cpu / wall if cpu is not None else None,
        "master_cpu_ms_per_request": 1000 * cpu / len(records) if cpu is not None and records else None,
        "master_cpu_us_per_token": 1e6 * cpu / tokens if cpu is not None and tokens else None,
    }


def markdown(doc: dict[str, Any]) -> str:
    """One run's table."""
    o, parts = doc["options"], doc["ttft_later_parts_p50_s"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.2f} ms"

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return "\n".join([
        f"# The master under load, on {doc['device']} ({doc['date']})", "",
        f"`pd-cluster master` serving `{doc['model']}`'s template and tokenizer to {o['decode_nodes']} synthetic "
        f"decode nodes ({o['step_ms']:g} ms a step); {o['conversations']} conversations of {o['turns']} turns at "
        f"{o['rate']:g}/s, first message {o['first_turn_len']} tokens, later ones {o['turn_len']}, answers "
        f"{o['output_len']} tokens" + ("; messages of whole words" if o.get("prompt_vocab") == "words" else "")
        + (f"; master flags `{' '.join(o['master_args'])}`" if o["master_args"] else "")
        + ".", "",
        "| requests | failed | TTFT turns 2+ p50 | http | master (dispatch) | node | hops | master CPU | "
        "CPU per request | CPU per token |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {doc['requests']} | {doc['failed']} | {ms(doc['ttft_later_p50_s'])} | {ms(parts['http'])} | "
        f"{ms(parts['master'])} | {ms(parts['node'])} | {ms(parts['hops'])} | "
        f"{num(doc['master_cpu_share'] and 100 * doc['master_cpu_share'], '.0f')}% of a core | "
        f"{num(doc['master_cpu_ms_per_request'], '.2f')} ms | {num(doc['master_cpu_us_per_token'], '.0f')} us |",
        "",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LoadOptions(model="default")
    p.add_argument("--model", default="default", help='"default" or an HF model directory (template, tokenizer)')
    p.add_argument("--decode-nodes", type=int, default=None,
                   help=f"synthetic decode nodes (default {d.decode_nodes}; with --concurrency 8)")
    p.add_argument("--step-ms", type=float, default=None,
                   help=f"their decode step, one token a request (default {d.step_ms:g}; with --concurrency 10)")
    p.add_argument("--conversations", type=int, default=d.conversations, help="multi-turn conversations sent")
    p.add_argument("--turns", type=int, default=d.turns, help="turns a conversation")
    p.add_argument("--rate", type=float, default=d.rate, help="conversations started a second")
    p.add_argument("--first-turn-len", type=int, default=d.first_turn_len, help="tokens of a first message")
    p.add_argument("--turn-len", type=int, default=d.turn_len, help="tokens of each later message")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"tokens of each answer (default {d.output_len}; with --concurrency 256)")
    p.add_argument("--prompt-vocab", choices=["any", "words"], default=d.prompt_vocab,
                   help="messages from any ordinary token or from whole words only (text the tokenizer's word cache "
                        "holds, as real text)")
    p.add_argument("--port", type=int, default=d.port, help="the master's port on 127.0.0.1")
    p.add_argument("--master-args", default="", help="extra flags of pd-cluster master")
    p.add_argument("--repeat", type=int, default=1, help="runs, each on a fresh master (the report's median)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"),
                   help="where master-load-cpu-<date>[-tag].{json,md} and each run's master log go")
    p.add_argument("--tag", default="", help="appended to the results' names")


def run_from_args(args: argparse.Namespace) -> int:
    """``pd-cluster bench master``: the runs, their JSON and table (exit 1 when a request failed)."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    d = LoadOptions(model=args.model)
    options = LoadOptions(model=args.model, decode_nodes=_given(args.decode_nodes, d.decode_nodes),
                          step_ms=_given(args.step_ms, d.step_ms), conversations=args.conversations, turns=args.turns,
                          rate=args.rate, first_turn_len=args.first_turn_len, turn_len=args.turn_len,
                          output_len=_given(args.output_len, d.output_len),
                          prompt_vocab=args.prompt_vocab, port=args.port, master_args=args.master_args.split())
    date = dt.date.today().isoformat()
    stem = f"master-load-cpu-{date}" + (f"-{args.tag}" if args.tag else "")
    runs = [run_master_load(replace(options), args.out / f"{stem}-run{i + 1}") for i in range(args.repeat)]
    doc = median_run(runs)
    doc.update(device="cpu", date=date, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = markdown(doc)
    (args.out / f"{stem}.md").write_text(text)
    sys.stdout.write(f"\n{text}\nresults: {args.out / stem}.json\n")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose later turns' master part is the median of the runs'."""
    ordered = sorted(runs, key=lambda r: r["ttft_later_parts_p50_s"]["master"] or 0.0)
    return dict(ordered[len(ordered) // 2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-cluster bench master", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
