"""``pd-cluster local``: a master and its prefill/decode nodes as processes on this machine, kept running.

Placement. With two or more GPUs the nodes are spread over them round-robin (prefill nodes
first), each node seeing only its GPU through ``CUDA_VISIBLE_DEVICES``. Nodes that share a GPU
get an explicit ``--gpu-memory-fraction``: the launcher measures the GPU's free memory once,
before any node starts, and splits it evenly, so no node sizes its KV pool from memory another
node is about to take. :func:`plan_placement` is that decision as a pure function.

Supervision. Each child writes to its own log file. A node that exits 0 drained and left the
cluster: it stays gone. A crash (non-zero exit, killed by a signal) is restarted with exponential
backoff, a bounded number of times per window; the master too. SIGINT and SIGTERM drain the
nodes, then stop the master, then the launcher exits 0. Every child gets
``PR_SET_PDEATHSIG=SIGTERM`` (Linux), so if the launcher is killed its children stop by themselves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import ConfigDict, Field

from pd_cluster.engine_flags import NodeEngineOptions
from pd_cluster.node_counts import node_count_problem
from pd_cluster.tls import client_context

logger = logging.getLogger("pd_cluster.local")

GiB = 2**30
MiB = 2**20
#: What a node process holds on its GPU outside torch's allocator (CUDA context, communicator and
#: kernel buffers): invisible to ``torch.cuda.memory_reserved``, so the launcher keeps it out of the fraction.
NODE_CONTEXT_BYTES = 1 * GiB
#: The engine's headroom for activations and CUDA graphs (``llm_engine.GPU_HEADROOM_BYTES``).
ENGINE_HEADROOM_BYTES = 768 * MiB
#: A shared GPU must leave at least this much KV per node.
MIN_KV_BYTES = 64 * MiB
POLL_S = 0.2
LOG_TAIL_LINES = 20


# ---- placement ------------------------------------------------------------------------------------


class PlacementError(ValueError):
    """The nodes cannot be placed as asked; the message says why and what to change."""


@dataclass(frozen=True)
class GPUMemory:
    free: int
    total: int


@dataclass(frozen=True)
class NodePlacement:
    name: str
    role: str
    gpu: int | None = None  # CUDA ordinal as the launcher sees it; None: CPU
    memory_fraction: float | None = None  # of the GPU's total memory; None: the node sizes itself
    kv_bytes: int | None = None  # the KV memory this plan leaves the node on a shared GPU
    shared_by: int = 1  # nodes on this GPU
    #: Tensor parallel: the node's GPUs (``gpu`` is the first), a whole set no other node uses.
    tp_gpus: tuple[int, ...] = ()
    tp: int = 1


def node_roles(prefill: int, decode: int, mixed: int = 0) -> list[str]:
    return ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * mixed


def _node_names(roles: Sequence[str]) -> list[str]:
    counters: dict[str, int] = {}
    names = []
    for role in roles:
        index = counters.get(role, 0)
        counters[role] = index + 1
        names.append(f"{role}-{index}")
    return names


def plan_tp_placement(roles: Sequence[str], gpus: Sequence[int], tps: Sequence[int]) -> list[NodePlacement]:
    """Place nodes of which some are tensor parallel: each node takes ``tp`` whole GPUs of
    ``gpus`` in order, none shared (on CPU, ``gpus`` empty: each node runs its ``tp`` processes)."""
    names = _node_names(roles)
    if not gpus:
        return [NodePlacement(name, role, tp=tp) for name, role, tp in zip(names, roles, tps)]
    if sum(tps) > len(gpus):
        raise PlacementError(f"the nodes' tensor parallelism needs {sum(tps)} GPUs ({' + '.join(map(str, tps))}) "
                             f"but {len(gpus)} are given; use fewer nodes, a smaller --*-tp or more GPUs (--gpus)")
    placements, first = [], 0
    for name, role, tp in zip(names, roles, tps):
        own = tuple(gpus[first:first + tp])
        placements.append(NodePlacement(name, role, own[0], tp_gpus=own, tp=tp))
        first += tp
    return placements


def plan_placement(roles: Sequence[str], gpus: Mapping[int, GPUMemory], weight_bytes: int) -> list[NodePlacement]:
    """Place nodes (named ``<role>-<i>``) round-robin over ``gpus`` (empty: every node on CPU).

    A node alone on its GPU sizes its KV pool itself (a fraction of what is free when it starts).
    The ``k`` nodes sharing a GPU split its free memory evenly: each may use ``free / k`` less its
    CUDA context, i.e. its weights, the engine's headroom and the rest as KV, given as a fraction
    of the GPU's total memory (what ``--gpu-memory-fraction`` takes).
    """
    names = _node_names(roles)
    if not gpus:
        return [NodePlacement(name, role) for name, role in zip(names, roles)]
    ids = list(gpus)
    assigned = [ids[i % len(ids)] for i in range(len(roles))]
    sharing = {gpu: assigned.count(gpu) for gpu in ids}
    placements = []
    for name, role, gpu in zip(names, roles, assigned):
        k = sharing[gpu]
        if k == 1:
            placements.append(NodePlacement(name, role, gpu))
            continue
        memory = gpus[gpu]
        share = memory.free // k
        kv_bytes = share - NODE_CONTEXT_BYTES - weight_bytes - ENGINE_HEADROOM_BYTES
        if kv_bytes < MIN_KV_BYTES:
            need = NODE_CONTEXT_BYTES + weight_bytes + ENGINE_HEADROOM_BYTES + MIN_KV_BYTES
            raise PlacementError(
                f"GPU {gpu} has {memory.free / GiB:.1f} GiB free: too little for {k} nodes "
                f"(each needs ~{need / GiB:.1f} GiB: {weight_bytes / GiB:.1f} GiB of weights, CUDA context, "
                f"headroom and some KV); use fewer nodes, more GPUs (--gpus) or a smaller model"
            )
        fraction = int((share - NODE_CONTEXT_BYTES) / memory.total * 10_000) / 10_000  # round down
        placements.append(NodePlacement(name, role, gpu, fraction, kv_bytes, k))
    return placements


def choose_gpus(device: str, requested: Sequence[int] | None, visible: int) -> list[int]:
    """The CUDA ordinals the nodes may use ([]: CPU) for ``--device`` and ``--gpus``."""
    name = device.strip().lower()
    if name == "cpu":
        if requested:
            raise PlacementError("--gpus places nodes on GPUs: it does not go with --device cpu")
        return []
    if name.startswith("cuda:"):
        index = name.removeprefix("cuda:")
        if not index.isdigit():
            raise PlacementError(f"--device {device!r} is not cuda:N")
        if requested and list(requested) != [int(index)]:
            raise PlacementError(f"--device {device} and --gpus {','.join(map(str, requested))} disagree")
        requested = [int(index)]
    elif name not in ("auto", "cuda"):
        raise PlacementError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if visible == 0:
        if name == "auto" and not requested:
            return []
        raise PlacementError(f"--device {device}: no CUDA device is visible")
    chosen = list(requested) if requested else list(range(visible))
    wrong = [i for i in chosen if not 0 <= i < visible]
    if wrong:
        raise PlacementError(f"GPU {wrong[0]} is not visible here ({visible} GPU(s): 0..{visible - 1})")
    if len(set(chosen)) != len(chosen):
        raise PlacementError("--gpus lists a GPU twice")
    return chosen


_GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(json.dumps([list(torch.cuda.mem_get_info(i)) for i in range(n)]))\n"
)


def probe_gpus(timeout: float = 180.0) -> list[GPUMemory]:
    """Free and total memory of each visible GPU, measured by a short-lived process so that the
    launcher holds no CUDA context (memory the nodes could not use for as long as it runs)."""
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout,
                             check=True, stdin=subprocess.DEVNULL).stdout
        return [GPUMemory(free=int(free), total=int(total)) for free, total in json.loads(out.splitlines()[-1])]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        logger.warning("could not measure the GPUs (%s): treating this machine as having none", e)
        return []


def visible_device_ids(count: int) -> list[str]:
    """What to put in a child's ``CUDA_VISIBLE_DEVICES`` for each ordinal this process sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    return [entry.strip() for entry in given.split(",") if entry.strip()][:count]


def model_weight_bytes(model_dir: Path) -> int:
    """The model's size from its safetensors files (an upper bound when served in a narrower dtype)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


# ---- process supervision ----------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that sends the child ``sig`` when the thread that spawned it ends (Linux
    ``PR_SET_PDEATHSIG``; the signal is tied to that thread, so spawn from one that lives as long as
    the parent). None where prctl is missing."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # between fork and exec: prctl was resolved before the fork
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


@dataclass(frozen=True)
class RestartPolicy:
    """Crashes are restarted after ``first_delay_s``, doubling up to ``max_delay_s``, at most
    ``max_restarts`` times within ``window_s``; past that the process stays down."""

    max_restarts: int = 5
    window_s: float = 300.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, crashes_in_window: int) -> float:
        return min(self.first_delay_s * 2 ** max(crashes_in_window - 1, 0), self.max_delay_s)


@dataclass(frozen=True)
class ProcessSpec:
    """One process the launcher runs and keeps running."""

    name: str
    role: str  # master | prefill | decode
    argv: tuple[str, ...]
    env: Mapping[str, str]
    stop_order: int = 0  # lower stops first: nodes drain while the master still relays their tokens
    clean_exit_is_final: bool = True  # a node exiting 0 drained and left; the master never should


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen | None = None
    state: str = "new"  # running | restarting | left | exited | failed | stopped
    starts: int = 0
    returncode: int | None = None
    restart_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)
    echo_offset: int = 0
    echo_partial: bytes = b""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 64 * 1024, 0))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-lines:]


class Supervisor:
    """Starts processes from their specs, restarts crashes, and stops them in order.

    Everything happens on the calling thread (the main one): children are spawned there, so
    ``PR_SET_PDEATHSIG`` ties them to the launcher's life, not to a helper thread's.
    """

    def __init__(self, specs: Sequence[ProcessSpec], log_dir: Path, policy: RestartPolicy = RestartPolicy(),
                 echo: IO[str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.echo_to = echo
        self.clock = clock
        self.processes: dict[str, ManagedProcess] = {}
        for spec in specs:
            log_path = self.log_dir / f"{spec.name}.log"
            log_path.write_bytes(b"")  # a fresh log per launcher run; restarts append
            self.processes[spec.name] = ManagedProcess(spec, log_path)

    def start_all(self) -> None:
        for managed in self.processes.values():
            self._spawn(managed)

    def _spawn(self, managed: ManagedProcess) -> None:
        spec = managed.spec
        with open(managed.log_path, "ab") as log:
            stamp = datetime.now().isoformat(timespec="seconds")
            log.write(f"---- {stamp} start {managed.starts + 1} of {spec.name}\n".encode())
            log.flush()
            managed.proc = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
            )
        managed.starts += 1
        managed.state = "running"
        managed.returncode = None
        if managed.starts == 1:
            logger.debug("%s: started pid %d", spec.name, managed.proc.pid)
        else:
            logger.info("%s: restarted as pid %d", spec.name, managed.proc.pid)

    def poll(self, restart: bool = True) -> list[ManagedProcess]:
        """Reap processes that exited since the last call (returned) and start the crashed ones
        whose backoff has passed. With ``restart`` False an exit is only recorded."""
        now = self.clock()
        exited = []
        for managed in self.processes.values():
            if managed.state == "running" and managed.proc is not None and managed.proc.poll() is not None:
                managed.returncode = managed.proc.returncode
                exited.append(managed)
                if restart:
                    self._after_exit(managed, now)
                else:
                    managed.state = "exited"
            elif managed.state == "restarting" and now >= managed.restart_at:
                try:
                    self._spawn(managed)
                except OSError as e:
                    managed.state = "failed"
                    logger.error("%s: could not be started again: %s", managed.spec.name, e)
        return exited

    def _after_exit(self, managed: ManagedProcess, now: float) -> None:
        name, code = managed.spec.name, managed.returncode
        assert code is not None
        if code == 0 and managed.spec.clean_exit_is_final:
            managed.state = "left"
            logger.info("%s (pid %d) exited cleanly: it drained and left the cluster; not restarting it",
                        name, managed.pid)
            return
        while managed.crashes and now - managed.crashes[0] > self.policy.window_s:
            managed.crashes.popleft()
        tail = "\n".join(f"    {line}" for line in log_tail(managed.log_path))
        if len(managed.crashes) >= self.policy.max_restarts:
            managed.state = "failed"
            logger.error("%s (pid %d) stopped with %s; it crashed %d times within %.0fs, not restarting it again. "
                         "Last lines of %s:\n%s", name, managed.pid, describe_exit(code), len(managed.crashes) + 1,
                         self.policy.window_s, managed.log_path, tail)
            return
        managed.crashes.append(now)
        delay = self.policy.delay(len(managed.crashes))
        managed.state = "restarting"
        managed.restart_at = now + delay
        logger.warning("%s (pid %d) crashed with %s; restart %d/%d in %.0fs. Last lines of %s:\n%s", name,
                       managed.pid, describe_exit(code), len(managed.crashes), self.policy.max_restarts, delay,
                       managed.log_path, tail)

    def stop(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM each stop group in order (nodes drain, then the master goes), waiting for each
        within ``timeout`` overall; SIGKILL whatever is left at the deadline or once ``force()``."""
        deadline = self.clock() + timeout
        for managed in self.processes.values():
            if managed.state in ("restarting", "new"):
                managed.state = "stopped"
        orders = sorted({m.spec.stop_order for m in self.processes.values()})
        reserve = min(5.0, timeout / 4)  # time kept for the later groups
        for position, order in enumerate(orders):
            group = [m for m in self.processes.values() if m.spec.stop_order == order and m.alive]
            for managed in group:
                self._signal(managed, signal.SIGTERM)
            group_deadline = deadline - reserve * (len(orders) - 1 - position)
            while any(m.alive for m in group) and self.clock() < group_deadline and not force():
                time.sleep(0.05)
            for managed in group:
                if managed.alive:
                    logger.warning("%s (pid %d) did not stop in time: killing it", managed.spec.name, managed.pid)
                    self._signal(managed, signal.SIGKILL)
        for managed in self.processes.values():
            if managed.proc is not None:
                try:
                    managed.proc.wait(10)
                except subprocess.TimeoutExpired:
                    logger.error("%s (pid %d) outlived SIGKILL", managed.spec.name, managed.pid)
            if managed.state == "running":
                managed.state = "stopped"
        self.echo()

    @staticmethod
    def _signal(managed: ManagedProcess, sig: int) -> None:
        try:
            if managed.proc is not None and managed.proc.poll() is None:
                managed.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def echo(self) -> None:
        """Copy what the children wrote since the last call to ``echo``, each line prefixed with its name."""
        if self.echo_to is None:
            return
        width = max(len(name) for name in self.processes)
        for managed in self.processes.values():
            try:
                with open(managed.log_path, "rb") as f:
                    f.seek(managed.echo_offset)
                    data = f.read(1 << 20)
            except OSError:
                continue
            managed.echo_offset += len(data)
            lines = (managed.echo_partial + data).split(b"\n")
            managed.echo_partial = lines.pop()
            for line in lines:
                self.echo_to.write(f"{managed.spec.name:<{width}} | {line.decode('utf-8', errors='replace')}\n")
        self.echo_to.flush()


# ---- the local cluster --------------------------------------------------------------------------------


class LocalOptions(NodeEngineOptions):
    """What ``pd-cluster local`` was asked for: its own options, and the engine flags every node gets
    (each None unless given: the node's default)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    #: Node counts of each role; None for all three: :func:`default_roles` picks by the GPUs. Some given,
    #: the others keep 1 prefill, 1 decode, 0 mixed.
    prefill: int | None = None
    decode: int | None = None
    #: Mixed nodes (prefill and decode in one engine: the colocated baseline).
    mixed: int | None = None
    #: The master's local_prefill_max_tokens (None: its default).
    local_prefill_max_tokens: int | None = None
    #: The master's planner (None: its default, off) and latency targets (None: none).
    planner: Literal["off", "slo"] | None = None
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None
    #: The master's worker processes behind its one port (1: one process).
    master_workers: int = Field(default=1, ge=1)
    #: The master's and every node's model.
    model: str = "default"
    #: Tensor parallelism of each role's nodes (GPUs, or processes on CPU, a node).
    prefill_tp: int = Field(default=1, ge=1)
    decode_tp: int = Field(default=1, ge=1)
    mixed_tp: int = Field(default=1, ge=1)
    #: Where the nodes run: auto, cpu, cuda or cuda:N (the one GPU every node shares).
    device: str = "auto"
    gpus: list[int] | None = None
    policy: str = "cache_aware"
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    log_dir: Path | None = None
    echo_logs: bool = False
    log_level: str = "INFO"
    log_format: str = "text"  # the master's: json makes every line (a request's too) one JSON object
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    #: The master's certificate and key (HTTPS, wss://), also each decode node's on its data plane.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: What every node (and this launcher) checks those certificates against.
    tls_ca: Path | None = None

    def tls_argv(self, role: str) -> list[str]:
        """The TLS flags of one process of this cluster (none without TLS)."""
        if self.tls_cert is None or self.tls_key is None:
            return []
        files = ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)]
        if role == "master":
            return files
        ca = ["--tls-ca", str(self.tls_ca)] if self.tls_ca is not None else []
        return ca + (files if role in ("decode", "mixed") else []) + ["--data-tls"]


def admin_token_path() -> Path:
    """Where ``pd-cluster local`` keeps its admin token (``pd-cluster nodes`` and ``status`` read it)."""
    from pd_cluster.default_model import cache_home

    return cache_home() / "local" / "admin-token"


def write_admin_token(token: str) -> Path:
    """Keep the local cluster's admin token in a file only the user can read (never printed)."""
    path = admin_token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path


def served_name(model: str) -> str:
    from pd_cluster.default_model import DEFAULT_MODEL_NAME

    if model == "default":
        return DEFAULT_MODEL_NAME
    from pd_cluster.model.config import ModelConfig

    return ModelConfig.from_path(model).name


def _dial_host(host: str) -> str:
    """Where the nodes reach a master bound to ``host`` (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def format_placement_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ("NODE", "ROLE", "GPU", "MEM FRACTION", "KV SLOTS", "PID")
    cells = [header] + [tuple(str(row.get(key.lower().replace(" ", "_"), "-")) for key in header) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells) + "\n"


def default_roles(num_gpus: int) -> tuple[int, int, int]:
    """(prefill, decode, mixed) nodes when none are asked for. On one GPU, one mixed node: a prefill
    and a decode node sharing it serve 0.75x the requests a second of one mixed node at saturation
    (8B shape, 1024 in / 128 out, one H200; docs/benchmarks), since a split leaves one side idle
    while the other queues. Elsewhere (CPU, several GPUs), one prefill and one decode node."""
    return (0, 0, 1) if num_gpus == 1 else (1, 1, 0)


def with_role_counts(options: LocalOptions, num_gpus: int) -> LocalOptions:
    """``options`` with every node count set: those left out from :func:`default_roles` when none
    was given, else 1 prefill, 1 decode, 0 mixed."""
    given = (options.prefill, options.decode, options.mixed)
    if given == (None, None, None):
        prefill, decode, mixed = default_roles(num_gpus)
    else:
        prefill, decode, mixed = (v if v is not None else d for v, d in zip(given, (1, 1, 0)))
    return options.model_copy(update={"prefill": prefill, "decode": decode, "mixed": mixed})


def _check_counts(prefill: int, decode: int, mixed: int) -> None:
    problem = node_count_problem(prefill, decode, mixed)
    if problem is not None:
        raise PlacementError(problem)


def role_counts(options: LocalOptions) -> tuple[int, int, int]:
    """(prefill, decode, mixed) of options whose counts are set (:func:`with_role_counts`)."""
    if options.prefill is None or options.decode is None or options.mixed is None:
        raise ValueError("node counts are not resolved yet (with_role_counts)")
    return options.prefill, options.decode, options.mixed


class LocalCluster:
    """Plans, starts and supervises a master plus P prefill and D decode nodes on this machine."""

    def __init__(self, options: LocalOptions) -> None:
        if (options.prefill, options.decode, options.mixed) != (None, None, None):
            options = with_role_counts(options, 0)  # the GPUs choose only when no count is given
            _check_counts(*role_counts(options))
        self.options = options
        if (options.tls_cert is None) != (options.tls_key is None):
            raise PlacementError("--tls-cert and --tls-key go together")
        scheme = "https" if options.tls_cert is not None else "http"
        self.url = f"{scheme}://{_dial_host(options.host)}:{options.port}"
        #: How this launcher checks the master's certificate (its own polls of /health and /admin).
        self.verify: ssl.SSLContext | bool = client_context(options.tls_ca) if options.tls_cert is not None else True
        self.placements: list[NodePlacement] = []
        self.device_ids: list[str] = []  # CUDA_VISIBLE_DEVICES entry of each ordinal
        self.supervisor: Supervisor | None = None
        self._signals = 0
        self._admin_token = ""

    # ---- plan -------------------------------------------------------------------------------

    def plan(self) -> list[NodePlacement]:
        measured = [] if self.options.device.strip().lower() == "cpu" else probe_gpus()
        chosen = choose_gpus(self.options.device, self.options.gpus, len(measured))
        self.options = o = with_role_counts(self.options, len(chosen))
        roles = node_roles(*role_counts(o))
        self.device_ids = visible_device_ids(len(measured))
        memory = {i: measured[i] for i in chosen}
        tps = [{"prefill": o.prefill_tp, "decode": o.decode_tp, "mixed": o.mixed_tp}[role] for role in roles]
        if max(tps) > 1:
            self.placements = plan_tp_placement(roles, chosen, tps)
            return self.placements
        weights = 0
        if len(chosen) < len(roles) and chosen:  # some GPU is shared: its memory is split by the plan
            from pd_cluster.default_model import resolve_model_path

            weights = model_weight_bytes(resolve_model_path(o.model))
        placements = plan_placement(roles, memory, weights)
        if o.max_total_tokens:  # the pool size is given: nothing to split
            placements = [dataclasses.replace(p, memory_fraction=None, kv_bytes=None) for p in placements]
        self.placements = placements
        return placements

    # ---- processes --------------------------------------------------------------------------

    def _base_argv(self) -> list[str]:
        return [sys.executable, "-m", "pd_cluster.cli", "--log-level", self.options.log_level]

    def process_specs(self, cluster_token: str, admin_token: str) -> list[ProcessSpec]:
        o = self.options
        env = {k: v for k, v in os.environ.items() if k not in ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN")}
        env.update(PD_CLUSTER_TOKEN=cluster_token, PYTHONUNBUFFERED="1")
        master_argv = self._base_argv() + ["master", "--host", o.host, "--port", str(o.port), "--model", o.model,
                                           "--policy", o.policy, "--log-format", o.log_format]
        if o.local_prefill_max_tokens is not None:
            master_argv += ["--local-prefill-max-tokens", str(o.local_prefill_max_tokens)]
        for flag, value in (("--planner", o.planner), ("--slo-tpot-ms", o.slo_tpot_ms), ("--slo-ttft-ms", o.slo_ttft_ms)):
            if value is not None:
                master_argv += [flag, str(value)]
        if o.master_workers > 1:
            master_argv += ["--workers", str(o.master_workers)]
        master_argv += o.tls_argv("master")
        specs = [ProcessSpec("master", "master", tuple(master_argv),
                             {**env, "PD_ADMIN_TOKEN": admin_token, "CUDA_VISIBLE_DEVICES": ""},
                             stop_order=1, clean_exit_is_final=False)]
        for p in self.placements:
            argv = self._base_argv() + [p.role, "--master", self.url, "--node-id", p.name, "--model", o.model,
                                        "--device", "cpu" if p.gpu is None else "cuda", *o.engine_argv(),
                                        *o.tls_argv(p.role)]
            if p.memory_fraction is not None:
                argv += ["--gpu-memory-fraction", f"{p.memory_fraction:.4f}"]
            if p.tp > 1:
                argv += ["--tp", str(p.tp)]
            node_env = dict(env)
            if p.gpu is not None:
                # A tensor-parallel node sees its set only: rank r runs on cuda:r.
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(self.device_ids[g] for g in p.tp_gpus or (p.gpu,))
            specs.append(ProcessSpec(p.name, p.role, tuple(argv), node_env, stop_order=0))
        return specs

    # ---- run --------------------------------------------------------------------------------

    def run(self) -> int:
        """Start everything, wait until it serves, supervise until SIGINT/SIGTERM; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1  # acted on by the loop; a second signal kills instead of waiting

    def _run(self) -> int:
        from pd_cluster.default_model import cache_home

        o = self.options
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health poll otherwise
        try:
            if o.model == "default":  # converted here once, not by every process at the same time
                from pd_cluster.default_model import default_model_path

                default_model_path()
            self.plan()
        except (PlacementError, FileNotFoundError) as e:
            logger.error("%s", e)
            return 2
        if self._signals:  # interrupted while preparing: nothing was started
            return 0
        cluster_token = os.environ.get("PD_CLUSTER_TOKEN") or secrets.token_urlsafe(24)
        self._admin_token = os.environ.get("PD_ADMIN_TOKEN") or secrets.token_urlsafe(24)
        token_file = write_admin_token(self._admin_token)
        log_dir = Path(o.log_dir) if o.log_dir else cache_home() / "local" / "logs"
        self.supervisor = Supervisor(self.process_specs(cluster_token, self._admin_token), log_dir, o.restart,
                                     echo=sys.stderr if o.echo_logs else None)
        for p in self.placements:
            logger.info("%s (%s): %s", p.name, p.role, self._where(p))
        logger.info("logs of every process: %s/<name>.log", log_dir)
        self.supervisor.start_all()
        try:
            ready = self._wait_ready()
            if ready is None:
                return 0
            if not ready:
                return 1
            self._announce(token_file, log_dir)
            return self._supervise()
        finally:
            if self._signals:
                logger.info("stopping: the nodes drain, then the master stops (signal again to kill at once)")
            self.supervisor.stop(o.stop_timeout_s, force=lambda: self._signals >= 2)
            logger.info("stopped")

    def _where(self, p: NodePlacement) -> str:
        if p.gpu is None:
            return "CPU" if p.tp == 1 else f"CPU, tp {p.tp} ({p.tp} processes)"
        if p.tp_gpus:
            return f"GPUs {self._gpu_names(p)} (tp {p.tp})"
        text = f"GPU {self.device_ids[p.gpu]}"
        if p.memory_fraction is not None:
            text += (f" shared by {p.shared_by} nodes: --gpu-memory-fraction {p.memory_fraction:.4f} "
                     f"(~{(p.kv_bytes or 0) / GiB:.1f} GiB of KV)")
        elif self.options.max_total_tokens:
            text += f", {self.options.max_total_tokens} KV slots"
        else:
            text += " alone: its KV pool takes a fraction of the free memory"
        return text

    def _gpu_names(self, p: NodePlacement) -> str:
        """The node's GPUs as CUDA_VISIBLE_DEVICES names them (``cpu`` on CPU)."""
        if p.gpu is None:
            return "cpu" if p.tp == 1 else f"cpu x{p.tp}"
        return ",".join(self.device_ids[g] for g in p.tp_gpus or (p.gpu,))

    def _wait_ready(self) -> bool | None:
        """True once the master's /health says it routes; False on a deadline or an early exit;
        None when a signal asked to stop first."""
        import httpx

        assert self.supervisor is not None
        deadline = time.monotonic() + self.options.ready_timeout_s
        while time.monotonic() < deadline:
            if self._signals:
                return None
            exited = self.supervisor.poll(restart=False)
            if exited:
                for managed in exited:
                    tail = "\n".join(f"    {line}" for line in log_tail(managed.log_path))
                    logger.error("%s exited during startup with %s; last lines of %s:\n%s", managed.spec.name,
                                 describe_exit(managed.returncode or 0), managed.log_path, tail)
                logger.error("the cluster did not start; stopping the rest")
                return False
            self.supervisor.echo()
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200 and self._all_joined(health.json()):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(POLL_S)
        logger.error("the cluster was not ready within %.0fs; see the logs in %s", self.options.ready_timeout_s,
                     self.supervisor.log_dir)
        return False

    def _all_joined(self, health: Mapping[str, Any]) -> bool:
        """Every node of this launcher is active (a decode node alone already makes /health say ok)."""
        prefill, decode, mixed = role_counts(self.options)
        return (health.get("prefill_nodes", 0) >= prefill and health.get("decode_nodes", 0) >= decode
                and health.get("mixed_nodes", 0) >= mixed)

    def registered_nodes(self, wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """The master's view of the nodes (``GET /admin/nodes``), waiting up to ``wait_s`` for all of ours."""
        import httpx

        deadline = time.monotonic() + wait_s
        expected = {p.name for p in self.placements}
        nodes: dict[str, dict[str, Any]] = {}
        while True:
            try:
                response = httpx.get(f"{self.url}/admin/nodes", timeout=5, verify=self.verify,
                                     headers={"Authorization": f"Bearer {self._admin_token}"})
                if response.status_code == 200:
                    nodes = {n["id"]: n for n in response.json()["data"]}
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if expected <= set(nodes) or time.monotonic() >= deadline or self._signals:
                return nodes
            if self.supervisor is not None:
                self.supervisor.poll()
            time.sleep(POLL_S)

    def placement_rows(self, nodes: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
        assert self.supervisor is not None
        procs = self.supervisor.processes
        rows: list[dict[str, Any]] = [{"node": "master", "role": "master", "gpu": "-", "pid": procs["master"].pid}]
        for p in self.placements:
            view = nodes.get(p.name)
            if p.memory_fraction is not None:
                fraction = f"{p.memory_fraction:.4f}"
            else:
                fraction = "auto" if p.gpu is not None and not self.options.max_total_tokens else "-"
            slots = view["capacity"]["max_total_tokens"] if view else "(not registered)"
            rows.append({"node": p.name, "role": p.role, "gpu": self._gpu_names(p),
                         "mem_fraction": fraction, "kv_slots": slots, "pid": procs[p.name].pid})
        return rows

    def _announce(self, token_file: Path, log_dir: Path) -> None:
        o = self.options
        nodes = self.registered_nodes(wait_s=min(60.0, o.ready_timeout_s))
        table = format_placement_table(self.placement_rows(nodes))
        url = self.url
        sys.stderr.write(
            f"\npd-cluster is serving at {url}/v1 ({o.prefill} prefill, {o.decode} decode"
            f"{f', {o.mixed} mixed' if o.mixed else ''})\n\n{table}\n"
            f"try:\n  curl {f'--cacert {o.tls_ca} ' if o.tls_ca and o.tls_cert else ''}{url}/v1/chat/completions "
            f"-H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{served_name(o.model)}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"Hello!\"}}]}}'\n"
            f"admin API token (for /admin/nodes): in {token_file} (readable by you only)\n"
            f"logs: {log_dir}/<node>.log{' (also echoed here)' if o.echo_logs else ''}\n"
            f"A crashed process is restarted; a drained node stays gone. Ctrl-C (or SIGTERM) stops everything.\n\n"
        )
        sys.stderr.flush()

    def _supervise(self) -> int:
        assert self.supervisor is not None
        processes = self.supervisor.processes
        warned_empty = False
        while not self._signals:
            self.supervisor.poll()
            self.supervisor.echo()
            if processes["master"].state == "failed":
                logger.error("the master keeps crashing; stopping the cluster")
                return 1
            nodes_gone = all(m.state in ("left", "failed") for m in processes.values() if m.spec.role != "master")
            if nodes_gone and not warned_empty:
                logger.warning("no node of this launcher is running; the master stays up for nodes started by hand "
                               "(pd-cluster prefill|decode|mixed --master %s)", self.url)
            warned_empty = nodes_gone
            time.sleep(POLL_S)
        return 0
