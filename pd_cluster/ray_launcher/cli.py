"""``pd-cluster ray start|scale|stop|status|token|logs``: the cluster as Ray actors.

Ray is imported only when one of these commands runs, so ``pd-cluster`` works without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from pd_cluster.engine_flags import PASSED_ON, add_engine_arguments, given_values

logger = logging.getLogger("pd_cluster")

POLICIES = ["cache_aware", "least_load", "round_robin"]


def _common(p: argparse.ArgumentParser) -> None:
    from pd_cluster.ray_launcher.spec import DEFAULT_NAMESPACE

    p.add_argument("--address", default="auto", help='the Ray cluster (default "auto": the one on this machine)')
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace holding this cluster's actors")


def _launcher(args: argparse.Namespace):
    from pd_cluster.ray_launcher.launcher import RayLauncher

    return RayLauncher(namespace=args.namespace, address=args.address)


def _masked(token: str | None) -> str:
    return f"{token[:4]}…" if token else "(none)"


def _run(args: argparse.Namespace, body) -> int:
    try:
        from pd_cluster.ray_launcher.launcher import LaunchError
    except ImportError as e:
        logger.error("Ray is not installed here (%s): pip install 'pd-cluster[ray]'", e)
        return 2

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin poll otherwise
    launcher = _launcher(args)
    try:
        return int(body(launcher) or 0)
    except LaunchError as e:
        logger.error("%s", e)
        return 1
    finally:
        launcher.disconnect()


def cmd_ray_start(args: argparse.Namespace) -> int:
    from pd_cluster.ray_launcher.spec import ClusterSpec

    spec = ClusterSpec(
        **given_values(args, PASSED_ON), namespace=args.namespace, model=args.model,
        served_model_name=args.served_model_name, policy=args.policy, host=args.host, port=args.port,
        master_workers=args.master_workers,
        device=args.device, gpus_per_node=args.gpus_per_node, gpu_memory_fraction=args.gpu_memory_fraction,
        cpus_per_node=args.cpus_per_node,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, mixed_tp=args.mixed_tp,
        masters=args.masters, master_cpus=args.master_cpus, master_resource=args.master_resource,
        prefill_resource=args.prefill_resource, decode_resource=args.decode_resource,
        mixed_resource=args.mixed_resource, drain_timeout_s=args.drain_timeout,
        max_restarts=args.max_restarts, log_level=args.log_level, node_args=args.node_arg,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, tls_name=args.tls_name,
    )
    chose_token = bool(os.environ.get("PD_ADMIN_TOKEN"))

    def body(launcher) -> int:
        url = launcher.start(spec, args.prefill, args.decode, timeout=args.ready_timeout, mixed=args.mixed)
        admin = launcher.tokens()["admin"]
        where = "from PD_ADMIN_TOKEN" if chose_token else f"generated: print it with `{_cmd(args, 'token')}`"
        mixed = f", {args.mixed} mixed" if args.mixed else ""
        sys.stdout.write(
            f"pd-cluster is serving at {url}/v1 ({args.prefill} prefill, {args.decode} decode{mixed}; "
            f"Ray namespace {args.namespace})\n"
            f"admin token: {_masked(admin)} ({where})\n"
            f"nodes:  {_cmd(args, 'status')}\n"
            f"scale:  {_cmd(args, 'scale')} --decode +1    (or --prefill -1: drains one first)\n"
            f"stop:   {_cmd(args, 'stop')}\n"
        )
        return 0

    return _run(args, body)


def cmd_ray_scale(args: argparse.Namespace) -> int:
    if not args.prefill and not args.decode and not args.mixed:
        logger.error("nothing to do: pass --prefill, --decode and/or --mixed, e.g. --decode +1")
        return 2

    def body(launcher) -> int:
        result = launcher.scale(prefill=args.prefill, decode=args.decode, mixed=args.mixed, timeout=args.timeout,
                                allow_empty=args.allow_empty)
        for name in result.added:
            sys.stdout.write(f"added   {name}\n")
        for name in result.removed:
            how = "killed after the drain deadline" if name in result.forced else "drained"
            held = result.in_flight.get(name)
            if held is not None:
                how += f"; {held} requests were in flight"
            sys.stdout.write(f"removed {name} ({how})\n")
        return 1 if result.forced else 0

    return _run(args, body)


def cmd_ray_stop(args: argparse.Namespace) -> int:
    def body(launcher) -> int:
        names = launcher.stop(timeout=args.timeout)
        if names:
            sys.stdout.write(f"stopped {len(names)} actors: {', '.join(sorted(names))}\n")
        else:
            sys.stdout.write(f"no pd-cluster actors in Ray namespace {args.namespace}\n")
        return 0

    return _run(args, body)


def cmd_ray_status(args: argparse.Namespace) -> int:
    def body(launcher) -> int:
        status = launcher.status()
        if args.json:
            sys.stdout.write(json.dumps(_status_dict(status), indent=2) + "\n")
        else:
            sys.stdout.write(format_status(status))
        return 0 if status.healthy else 1

    return _run(args, body)


def cmd_ray_token(args: argparse.Namespace) -> int:
    def body(launcher) -> int:
        token = launcher.tokens()["cluster" if args.cluster else "admin"]
        if not token:
            logger.error("no token stored")
            return 1
        sys.stdout.write(token + "\n")
        return 0

    return _run(args, body)


def cmd_ray_logs(args: argparse.Namespace) -> int:
    def body(launcher) -> int:
        for line in launcher.logs(args.name, args.lines):
            sys.stdout.write(line + "\n")
        return 0

    return _run(args, body)


def _cmd(args: argparse.Namespace, verb: str) -> str:
    extra = ""
    if args.namespace != "pd-cluster":
        extra += f" --namespace {args.namespace}"
    if args.address != "auto":
        extra += f" --address {args.address}"
    return f"pd-cluster ray {verb}{extra}"


def _status_dict(status) -> dict[str, Any]:
    return {"namespace": status.namespace, "master_url": status.master_url, "healthy": status.healthy,
            "actors": status.actors, "nodes": status.nodes}


def format_status(status) -> str:
    """A table of the cluster's processes joined with what the master knows of each node."""
    lines = [f"master: {status.master_url or '(unknown)'}  health: {'ok' if status.healthy else 'NOT READY'}  "
             f"namespace: {status.namespace}"]
    header = f"{'NAME':<14} {'ROLE':<8} {'STATE':<11} {'RAY NODE':<16} {'PID':>7} {'RUN':>4} {'WAIT':>5} " \
             f"{'KV USED':>8} {'RESTARTS':>8}"
    lines.append(header)
    nodes = status.nodes or {}
    for name in sorted(status.actors, key=lambda n: (n != "master", n)):
        info = status.actors[name]
        view = nodes.get(name, {})
        if not info.get("placed"):
            state = "pending"
        elif info.get("exited"):
            state = f"exited({info.get('returncode')})"
        elif name == "master":
            state = "serving" if status.healthy else "up"
        else:
            state = view.get("state", "joining" if status.nodes is not None else "?")
        load = view.get("load", {})
        used = view.get("kv", {}).get("used_fraction")
        lines.append(
            f"{name:<14} {info.get('role', ''):<8} {state:<11} {info.get('ip') or '-':<16} "
            f"{info.get('pid') or '-':>7} {load.get('running', '-'):>4} {load.get('waiting', '-'):>5} "
            f"{'-' if used is None else f'{used:.0%}':>8} {info.get('restarts', '-'):>8}"
        )
    strangers = sorted(set(nodes) - set(status.actors))
    for name in strangers:  # joined the master from outside Ray (e.g. started by hand)
        view = nodes[name]
        lines.append(f"{name:<14} {view['role']:<8} {view['state']:<11} {'(not Ray)':<16}")
    return "\n".join(lines) + "\n"


def add_ray_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``ray`` and its subcommands to the ``pd-cluster`` parser."""
    ray_p = sub.add_parser("ray", help="run the cluster as Ray actors: start, scale, stop, status")
    ray_sub = ray_p.add_subparsers(dest="ray_command", required=True)

    start = ray_sub.add_parser("start", help="place the master and the nodes as detached Ray actors")
    _common(start)
    start.add_argument("--prefill", type=int, default=1, help="prefill nodes to start")
    start.add_argument("--decode", type=int, default=1, help="decode nodes to start")
    start.add_argument("--mixed", type=int, default=0,
                       help="mixed nodes to start (prefill and decode in one engine); --prefill 0 --decode 0 "
                            "--mixed 1 is the colocated baseline")
    start.add_argument("--model", default="default", help='"default" or a model directory on every Ray node')
    start.add_argument("--served-model-name", default=None, help="the name clients put in `model`")
    start.add_argument("--policy", default="cache_aware", choices=POLICIES,
                       help="how the master chooses a (prefill, decode) pair per request")
    start.add_argument("--host", default="0.0.0.0", help="the master's bind address")
    start.add_argument("--port", type=int, default=8000, help="the master's port")
    start.add_argument("--master-workers", type=int, default=1,
                       help="worker processes of each master behind its port (pd-cluster master --workers)")
    start.add_argument("--device", default=None, help="node device (default: cuda if --gpus-per-node > 0, else cpu)")
    start.add_argument("--gpus-per-node", type=float, default=1.0,
                       help="Ray GPUs per node actor (0: CPU nodes; 0.5: a P and a D share each GPU)")
    start.add_argument("--gpu-memory-fraction", type=float, default=None,
                       help="share of its GPU's memory each node may use (default: from a fractional "
                            "--gpus-per-node, e.g. 0.5 -> 0.45)")
    start.add_argument("--cpus-per-node", type=float, default=1.0,
                       help="Ray CPUs each node actor reserves (per rank of a tensor-parallel node)")
    for role in ("prefill", "decode", "mixed"):
        start.add_argument(f"--{role}-tp", type=int, default=1, metavar="N",
                           help=f"tensor parallelism of each {role} node: N ranks, each with --gpus-per-node GPUs, "
                                "reserved together on one Ray node by a placement group (on CPU: N processes); "
                                "default 1")
    start.add_argument("--masters", type=int, default=1,
                       help="master actors (peers: every node registers with each; master i serves on --port + i)")
    start.add_argument("--master-cpus", type=float, default=1.0, help="Ray CPUs the master actor reserves")
    start.add_argument("--master-resource", default=None,
                       help="custom Ray resource that pins the master, e.g. pd_master on the head node")
    start.add_argument("--prefill-resource", default=None,
                       help="custom Ray resource each prefill actor takes 1 of (e.g. pd_prefill: its node type)")
    start.add_argument("--decode-resource", default=None,
                       help="custom Ray resource each decode actor takes 1 of (e.g. pd_decode)")
    start.add_argument("--mixed-resource", default=None,
                       help="custom Ray resource each mixed actor takes 1 of (e.g. pd_mixed)")
    start.add_argument("--drain-timeout", type=float, default=600.0,
                       help="seconds a draining node waits for its requests before it leaves anyway")
    start.add_argument("--max-restarts", type=int, default=3, help="restarts of a crashed process")
    start.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the cluster to serve")
    start.add_argument("--node-arg", action="append", default=[],
                       help="extra argument for every node's command (repeat; e.g. --node-arg=--lease-s=60)")
    tls = start.add_argument_group(
        "TLS", "paths present on every Ray node (the cluster yaml's file_mounts): the masters serve HTTPS with the "
        "certificate, decode and mixed nodes their data plane, and nodes check both against the CA")
    tls.add_argument("--tls-cert", default=None, help="certificate (PEM); it must name the master's Ray node IP")
    tls.add_argument("--tls-key", default=None, help="the key of --tls-cert")
    tls.add_argument("--tls-ca", default=None, help="CA (PEM) certificates are checked against (default: the system's)")
    tls.add_argument("--tls-name", default=None,
                     help="a name the certificate holds: prefill nodes check data planes against it instead of "
                          "each decode or mixed node's Ray node IP")
    add_engine_arguments(start.add_argument_group(
        "engine flags", "given to every node, also those `scale` adds; left out, a node keeps its default"), PASSED_ON)
    start.set_defaults(func=cmd_ray_start)

    scale = ray_sub.add_parser("scale", help="add (+N) or drain and remove (-N) nodes")
    _common(scale)
    scale.add_argument("--prefill", type=int, default=0, help="+N adds, -N drains and removes")
    scale.add_argument("--decode", type=int, default=0, help="+N adds, -N drains and removes")
    scale.add_argument("--mixed", type=int, default=0, help="+N adds, -N drains and removes")
    scale.add_argument("--timeout", type=float, default=None, help="default: the drain timeout + 60 s")
    scale.add_argument("--allow-empty", action="store_true", help="allow removing the last node of a role")
    scale.set_defaults(func=cmd_ray_scale)

    stop = ray_sub.add_parser("stop", help="drain every node, stop the master, remove every actor")
    _common(stop)
    stop.add_argument("--timeout", type=float, default=None, help="drain deadline (default: the cluster's)")
    stop.set_defaults(func=cmd_ray_stop)

    status = ray_sub.add_parser("status", help="the master, the nodes and their load")
    _common(status)
    status.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")
    status.set_defaults(func=cmd_ray_status)

    token = ray_sub.add_parser("token", help="print the admin token (or --cluster: the node token)")
    _common(token)
    token.add_argument("--cluster", action="store_true", help="print the node (cluster) token instead")
    token.set_defaults(func=cmd_ray_token)

    logs = ray_sub.add_parser("logs", help="the last lines a process printed (master, prefill-0, ...)")
    _common(logs)
    logs.add_argument("name", help="the process: master, prefill-0, decode-0, mixed-0, ...")
    logs.add_argument("--lines", type=int, default=100, help="how many of the last lines to print")
    logs.set_defaults(func=cmd_ray_logs)


def build_parser() -> argparse.ArgumentParser:
    """A parser with only the ``ray`` command (``python -m pd_cluster.ray_launcher ray ...``)."""
    parser = argparse.ArgumentParser(prog="pd-cluster")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_ray_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)
