"""``pd-cluster local``: a master and its prefill/decode nodes as processes on this machine, kept running.

The launcher plans where the nodes go (:mod:`pd_cluster.local_placement`), starts the master and
the nodes under a :class:`~pd_cluster.process_supervisor.Supervisor`, waits until the master
routes to all of them, and supervises: a drained node stays gone, a crash is restarted, the master
too. SIGINT and SIGTERM drain the nodes, then stop the master, then the launcher exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import ssl
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_cluster.local_options import LocalOptions, role_counts, with_role_counts
from pd_cluster.local_placement import (  # noqa: F401 (re-exported)
    _GPU_PROBE,
    ENGINE_HEADROOM_BYTES,
    MIN_KV_BYTES,
    NODE_CONTEXT_BYTES,
    GiB,
    GPUMemory,
    MiB,
    NodePlacement,
    PlacementError,
    _node_names,
    choose_gpus,
    default_roles,
    format_placement_table,
    model_weight_bytes,
    node_roles,
    plan_placement,
    plan_tp_placement,
    probe_gpus,
    visible_device_ids,
)
from pd_cluster.process_supervisor import (  # noqa: F401 (re-exported)
    _PR_SET_PDEATHSIG,
    _PRCTL,
    LOG_TAIL_LINES,
    ManagedProcess,
    ProcessSpec,
    RestartPolicy,
    Supervisor,
    _load_prctl,
    describe_exit,
    die_with_parent,
    log_tail,
)
from pd_cluster.node_counts import node_count_problem
from pd_cluster.tls import client_context

logger = logging.getLogger("pd_cluster.local")

POLL_S = 0.2


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


def _check_counts(prefill: int, decode: int, mixed: int) -> None:
    problem = node_count_problem(prefill, decode, mixed)
    if problem is not None:
        raise PlacementError(problem)


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
