"""Commands that start cluster processes: master, prefill, decode, local, node-drain.

``pd_cluster`` imports no role at module level; each command imports its role when run.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("pd_cluster")


def _engine_args(p: argparse.ArgumentParser) -> None:
    from pd_cluster.cli import _add_engine_args

    _add_engine_args(p)


def _node_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--master", required=True, help="the master's HTTP address, e.g. http://127.0.0.1:8000")
    p.add_argument("--node-id", default=None, help="unique node name (default: host-pid)")
    p.add_argument("--status-host", default="127.0.0.1")
    p.add_argument("--status-port", type=int, default=0, help="serve /livez, /readyz, /drain here (0: off)")
    p.add_argument("--drain-timeout", type=float, default=600.0)
    p.add_argument("--lease-s", type=float, default=30.0, help="KV reservation lease on decode nodes")
    if role == "decode":
        p.add_argument("--data-host", default="127.0.0.1", help="address prefill nodes dial (advertised)")
        p.add_argument("--data-bind", default=None, help="bind address of the data plane (default: --data-host)")
        p.add_argument("--data-port", type=int, default=0)
    else:
        p.add_argument("--max-channels", type=int, default=8)
    _engine_args(p)


def _node_settings(args: argparse.Namespace, role: str):
    from pd_cluster.cli import engine_config_from_args
    from pd_cluster.node_config import NodeSettings

    fields = {"master": args.master, "engine": engine_config_from_args(args), "status_host": args.status_host,
              "status_port": args.status_port, "drain_timeout_s": args.drain_timeout, "lease_s": args.lease_s}
    if args.node_id:
        fields["node_id"] = args.node_id
    if role == "decode":
        fields.update(data_host=args.data_host, data_bind=args.data_bind, data_port=args.data_port)
    else:
        fields["max_channels"] = args.max_channels
    if not os.environ.get("PD_CLUSTER_TOKEN"):
        raise SystemExit("PD_CLUSTER_TOKEN is not set: nodes authenticate to the master with it")
    return NodeSettings(**fields)


#: Where each role's process starts. The CLI lives in pd_cluster but must launch the roles;
#: they are looked up by name when a command runs, so no pd_cluster module imports a role.
ROLE_ENTRY_POINTS = {
    "prefill": ("prefill_node.main", "run_prefill_node"),
    "decode": ("decode_node.main", "run_decode_node"),
    "master": ("master.server", "run_master"),
}


def _role_entry(role: str):
    module, name = ROLE_ENTRY_POINTS[role]
    return getattr(importlib.import_module(module), name)


def cmd_node(args: argparse.Namespace) -> int:
    from pd_cluster.node_agent import RegistrationRefused

    try:
        _role_entry(args.command)(_node_settings(args, args.command))
    except RegistrationRefused as e:
        logger.error("the master refused this node: %s", e)
        return 2
    return 0


def cmd_master(args: argparse.Namespace) -> int:
    settings_cls = getattr(importlib.import_module("master.config"), "MasterSettings")
    config_error = getattr(importlib.import_module("master.app"), "ConfigError")

    given = {k: v for k, v in {
        "host": args.host, "port": args.port, "model": args.model, "policy": args.policy,
        "max_model_len": args.max_model_len, "request_timeout_s": args.request_timeout,
        "served_model_name": args.served_model_name,
    }.items() if v is not None}
    try:
        _role_entry("master")(settings_cls(**given))
    except config_error as e:
        logger.error("%s", e)
        return 2
    return 0


def cmd_node_drain(args: argparse.Namespace) -> int:
    import httpx

    base = f"http://127.0.0.1:{args.status_port}"
    deadline = time.monotonic() + args.timeout
    try:
        httpx.post(f"{base}/drain", timeout=5).raise_for_status()
        while time.monotonic() < deadline:
            if httpx.get(f"{base}/drain", timeout=5).json().get("done"):
                logger.info("node drained")
                return 0
            time.sleep(0.5)
    except httpx.HTTPError as e:
        logger.info("node status server gone (%s): treating the node as stopped", e)
        return 0
    logger.warning("node still busy after %.0fs", args.timeout)
    return 1


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _write_admin_token(token: str) -> Path:
    """Keep the local cluster's admin token in a file only the user can read (never printed)."""
    from pd_cluster.default_model import cache_home

    path = cache_home() / "local" / "admin-token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path


def _served_name(model: str) -> str:
    from pd_cluster.default_model import DEFAULT_MODEL_NAME

    if model == "default":
        return DEFAULT_MODEL_NAME
    from pd_cluster.model.config import ModelConfig

    return ModelConfig.from_path(model).name


def cmd_local(args: argparse.Namespace) -> int:
    """Master + P prefill + D decode nodes as separate processes on this machine."""
    env = dict(os.environ)
    env.setdefault("PD_CLUSTER_TOKEN", secrets.token_urlsafe(24))
    env.setdefault("PD_ADMIN_TOKEN", secrets.token_urlsafe(24))
    token_file = _write_admin_token(env["PD_ADMIN_TOKEN"])
    base = [sys.executable, "-m", "pd_cluster.cli", "--log-level", args.log_level]
    url = f"http://{args.host}:{args.port}"
    engine = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--block-size",
              str(args.block_size)]
    if args.max_total_tokens:
        engine += ["--max-total-tokens", str(args.max_total_tokens)]
    gpus = _gpu_count() if args.device in ("auto", "cuda") else 0
    procs: list[subprocess.Popen] = []

    def spawn(cmd: list[str], gpu: int | None = None) -> None:
        child_env = dict(env)
        if gpu is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        procs.append(subprocess.Popen(cmd, env=child_env))

    spawn(base + ["master", "--host", args.host, "--port", str(args.port), "--model", args.model,
                  "--policy", args.policy])
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    for index, role in enumerate(roles):
        gpu = index % gpus if gpus >= 2 else None
        name = f"{role}-{index}"
        spawn(base + [role, "--master", url, "--node-id", name] + engine, gpu)
    served = _served_name(args.model)
    try:
        if not _wait_ready(url, procs, args.ready_timeout):
            logger.error("the cluster did not become ready (see the logs above)")
            return 1
        sys.stderr.write(
            f"\npd-cluster is serving at {url}/v1 ({args.prefill} prefill, {args.decode} decode)\n"
            f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
            f"admin API token (for /admin/nodes): in {token_file} (readable by you only)\n"
            f"Ctrl-C stops everything.\n\n"
        )
        sys.stderr.flush()
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        logger.error("a cluster process exited; stopping the rest")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()


def add_commands(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("master", help="run the master (OpenAI API, node registry, routing)")
    m.add_argument("--host", default=None)
    m.add_argument("--port", type=int, default=None)
    m.add_argument("--model", default=None, help='"default" or an HF model directory (tokenizer, chat template)')
    m.add_argument("--served-model-name", default=None)
    m.add_argument("--policy", default=None, choices=["cache_aware", "least_load", "round_robin"])
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--request-timeout", type=float, default=None)
    m.set_defaults(func=cmd_master)

    p = sub.add_parser("prefill", help="run a prefill node that joins --master")
    _node_args(p, "prefill")
    p.set_defaults(func=cmd_node)

    d = sub.add_parser("decode", help="run a decode node that joins --master")
    _node_args(d, "decode")
    d.set_defaults(func=cmd_node)

    loc = sub.add_parser("local", help="master + prefill + decode nodes on this machine")
    loc.add_argument("--host", default="127.0.0.1")
    loc.add_argument("--port", type=int, default=8000)
    loc.add_argument("--prefill", type=int, default=1)
    loc.add_argument("--decode", type=int, default=1)
    loc.add_argument("--model", default="default")
    loc.add_argument("--device", default="auto")
    loc.add_argument("--dtype", default="auto")
    loc.add_argument("--block-size", type=int, default=1)
    loc.add_argument("--max-total-tokens", type=int, default=None)
    loc.add_argument("--policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"])
    loc.add_argument("--ready-timeout", type=float, default=300.0)
    loc.set_defaults(func=cmd_local)

    drain = sub.add_parser("node-drain", help="ask the node on this host to drain and wait for it (preStop)")
    drain.add_argument("--status-port", type=int, default=9000)
    drain.add_argument("--timeout", type=float, default=600.0)
    drain.set_defaults(func=cmd_node_drain)

    from pd_cluster.ray_launcher.cli import add_ray_commands

    add_ray_commands(sub)
