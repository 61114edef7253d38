"""``pd-cluster nodes`` and ``pd-cluster status``: the operator's view of a running cluster.

Both talk to the master's admin API over HTTP (``/admin/nodes``, ``/health``, ``/metrics``), so
they work against any master, local or on Kubernetes. The admin token comes from
``PD_ADMIN_TOKEN`` or, failing that, from the file ``pd-cluster local`` keeps it in; it is never
taken on the command line, where other users could read it in the process list.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

DEFAULT_MASTER = "http://127.0.0.1:8000"
TOKEN_ENV = "PD_ADMIN_TOKEN"
MASTER_ENV = "PD_MASTER_URL"


class AdminError(Exception):
    """A call the operator made could not be done; the message says why and what to try."""


def local_token_file() -> Path:
    from pd_cluster.local_cluster import admin_token_path

    return admin_token_path()


def resolve_token(token_file: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The admin token: ``PD_ADMIN_TOKEN``, else ``token_file``, else the local cluster's file."""
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip()
    path = Path(token_file).expanduser() if token_file else local_token_file()
    try:
        token = path.read_text().strip()
    except OSError:
        raise AdminError(f"no admin token: set {TOKEN_ENV}, or pass --token-file (looked in {path})") from None
    if not token:
        raise AdminError(f"the admin token file {path} is empty")
    return token


@dataclass
class AdminClient:
    """The master's admin and monitoring endpoints."""

    base_url: str
    token: str
    timeout: float = 10.0

    def _call(self, method: str, path: str, auth: bool = True, body: dict[str, Any] | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
        url = self.base_url.rstrip("/") + path
        try:
            response = httpx.request(method, url, headers=headers, timeout=self.timeout, json=body)
        except httpx.HTTPError as e:
            raise AdminError(f"cannot reach the master at {self.base_url} ({e})") from None
        if response.status_code == 401:
            raise AdminError(f"the master at {self.base_url} refused the admin token (set {TOKEN_ENV} to the "
                             "token the master was started with)")
        if response.status_code == 404 and "node_not_found" in response.text:
            raise AdminError(_error_message(response))
        return response

    def nodes(self) -> dict[str, Any]:
        response = self._call("GET", "/admin/nodes")
        _check(response)
        return response.json()

    def drain(self, node_id: str) -> dict[str, Any]:
        response = self._call("POST", f"/admin/nodes/{node_id}/drain")
        _check(response)
        return response.json()

    def set_role(self, node_id: str, role: str) -> dict[str, Any]:
        response = self._call("POST", f"/admin/nodes/{node_id}/role", body={"role": role})
        _check(response)
        return response.json()

    def remove(self, node_id: str) -> dict[str, Any]:
        response = self._call("DELETE", f"/admin/nodes/{node_id}")
        _check(response)
        return response.json()

    def allow(self, node_id: str) -> dict[str, Any]:
        response = self._call("POST", f"/admin/nodes/{node_id}/allow")
        _check(response)
        return response.json()

    def health(self) -> dict[str, Any]:
        response = self._call("GET", "/health", auth=False)
        try:
            return {"http_status": response.status_code, **response.json()}
        except ValueError:
            return {"http_status": response.status_code, "status": "unknown"}

    def metrics_text(self) -> str:
        response = self._call("GET", "/metrics", auth=False)
        _check(response)
        return response.text


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise AdminError(_error_message(response))


# ---- what the tables show ------------------------------------------------------------------------


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


NODE_COLUMNS = ("ID", "ROLE", "STATE", "DEVICE", "LOAD", "KV USE", "PREFIX HIT", "KV MOVED", "WARM", "AGE")


def node_row(node: Mapping[str, Any], now: float) -> tuple[str, ...]:
    """One node of ``GET /admin/nodes`` as the table's cells (same order as :data:`NODE_COLUMNS`)."""
    load = node.get("load", {})
    kv = node.get("kv", {})
    running, waiting = load.get("running", 0), load.get("waiting", 0)
    limit = node.get("capacity", {}).get("max_running_requests")
    # The batch limit the node reported at registration (a decode node's: sized for decoding).
    load_text = f"{running}{f'/{limit}' if limit else ''} run / {waiting} wait"
    if load.get("queued_prefill_tokens"):
        load_text += f" / {load['queued_prefill_tokens']} tok"
    used = kv.get("used_fraction")
    kv_text = _percent(used)
    if kv.get("total_tokens"):
        kv_text += f" of {kv['total_tokens']}"
    warm = node.get("data_plane", {}).get("warm_peers", [])
    role = str(node.get("role", "?"))
    if node.get("pending_role"):
        role += f" -> {node['pending_role']}"
    return (
        str(node.get("id", "?")),
        role,
        str(node.get("state", "?")),
        str(node.get("device") or "-"),
        load_text,
        kv_text,
        _percent(node.get("prefix", {}).get("hit_rate")),
        format_bytes(node.get("kv_transfer_bytes")),
        ",".join(warm) if warm else "-",
        format_age(now - node["registered_at"]) if node.get("registered_at") else "-",
    )


_STATE_STYLE = {"active": "green", "draining": "yellow", "switching": "cyan"}


def nodes_table(nodes: Sequence[Mapping[str, Any]], now: float | None = None) -> Table:
    now = time.time() if now is None else now
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in NODE_COLUMNS:
        table.add_column(column, no_wrap=column in ("ID", "STATE", "AGE"))
    for node in nodes:
        cells = list(node_row(node, now))
        cells[2] = Text(cells[2], style=_STATE_STYLE.get(cells[2], "red"))
        table.add_row(*cells)
    if not nodes:
        table.add_row(*(["(no node registered)"] + [""] * (len(NODE_COLUMNS) - 1)))
    return table


# ---- cluster status from /metrics -------------------------------------------------------------------


def _parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def histogram_quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative ``(upper bound, count)`` pairs (None: empty)."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def metrics_summary(text: str) -> dict[str, Any]:
    """Totals since the master started: requests by outcome, latency percentiles, tokens, KV moved."""
    samples = _parse_metrics(text)

    def total(name: str) -> float:
        return sum(value for _, value in samples.get(name, []))

    def quantiles(name: str) -> dict[str, float | None]:
        buckets = [(float(labels["le"]), value) for labels, value in samples.get(f"{name}_bucket", [])]
        return {f"p{int(q * 100)}": histogram_quantile(buckets, q) for q in (0.5, 0.9, 0.99)}

    requests = {labels.get("status", "?"): int(value) for labels, value in samples.get("pdc_requests_total", [])}
    prompt = total("pdc_prompt_tokens_total")
    return {
        "requests": requests,
        "ttft_s": quantiles("pdc_time_to_first_token_seconds"),
        "tpot_s": quantiles("pdc_time_per_output_token_seconds"),
        "e2e_s": quantiles("pdc_e2e_request_latency_seconds"),
        "prompt_tokens": int(prompt),
        "generation_tokens": int(total("pdc_generation_tokens_total")),
        "prefix_hit_rate": total("pdc_prefix_hit_tokens_total") / prompt if prompt else None,
        "kv_transfer_bytes": int(total("pdc_kv_transfer_bytes_total")),
        "warm_channels": int(total("pdc_warm_channels")),
    }


def cluster_status(client: AdminClient) -> dict[str, Any]:
    """Everything ``pd-cluster status`` shows, as one JSON-able document."""
    return {
        "master": client.base_url,
        "health": client.health(),
        "summary": metrics_summary(client.metrics_text()),
        "nodes": client.nodes()["data"],
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def status_view(status: Mapping[str, Any], now: float | None = None) -> Group:
    health = status["health"]
    summary = status["summary"]
    ok = health.get("status") == "ok"
    requests = summary["requests"]
    lines = [
        Text.assemble(("pd-cluster ", "bold"), status["master"], "  ",
                      ("serving" if ok else str(health.get("status", "unknown")), "green" if ok else "red")),
        Text(f"nodes: {health.get('prefill_nodes', 0)} prefill, {health.get('decode_nodes', 0)} decode active; "
             f"warm pairs: {health.get('warm_pairs', 0)}"),
        Text("requests: " + (", ".join(f"{k} {v}" for k, v in sorted(requests.items())) or "none yet")),
        Text(f"TTFT p50 {_ms(summary['ttft_s']['p50'])}  p99 {_ms(summary['ttft_s']['p99'])}   "
             f"TPOT p50 {_ms(summary['tpot_s']['p50'])}  p99 {_ms(summary['tpot_s']['p99'])}   "
             f"E2E p50 {_ms(summary['e2e_s']['p50'])}"),
        Text(f"tokens: {summary['prompt_tokens']} prompt, {summary['generation_tokens']} generated; "
             f"prefix hit rate {_percent(summary['prefix_hit_rate'])}; "
             f"KV moved {format_bytes(summary['kv_transfer_bytes'])}"),
        Text(""),
    ]
    return Group(*lines, nodes_table(status["nodes"], now))


# ---- commands ---------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> AdminClient:
    # A log line per HTTP call would bury the table (and break a view refreshed in place).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    master = args.master or os.environ.get(MASTER_ENV) or DEFAULT_MASTER
    return AdminClient(master, resolve_token(args.token_file), timeout=args.timeout)


def _console() -> Console:
    """A console for the tables: the terminal's width, or a wide one when piped (no wrapped cells)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def _watch(render: Callable[[], Any], fetch: Callable[[], Any], args: argparse.Namespace) -> int:
    """Refresh ``render(fetch())`` in place every ``--interval`` s (``--count`` times; 0: until Ctrl-C)."""
    shown = 0
    if args.json:
        while args.count == 0 or shown < args.count:
            if shown:
                time.sleep(args.interval)
            sys.stdout.write(json.dumps(fetch()) + "\n")  # one document a line
            sys.stdout.flush()
            shown += 1
        return 0
    console = _console()
    with Live(render(fetch()), console=console, auto_refresh=False, transient=False) as live:
        shown = 1
        while args.count == 0 or shown < args.count:
            time.sleep(args.interval)
            live.update(render(fetch()), refresh=True)
            shown += 1
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
        action = args.action or "list"
        if action == "list":
            doc = client.nodes()
            if args.json:
                _print_json(doc)
            else:
                _console().print(nodes_table(doc["data"]))
        elif action == "watch":
            return _watch(lambda doc: nodes_table(doc["data"]), client.nodes, args)
        elif action == "drain":
            view = client.drain(args.node_id)
            if args.wait:
                _wait_gone(client, args.node_id, args.wait_timeout)
            if args.json:
                _print_json(view)
            else:
                left = " and left the cluster" if args.wait else ""
                sys.stdout.write(f"node {args.node_id} is draining: no new work reaches it{left}\n")
        elif action == "set-role":
            _set_role(client, args)
        elif action == "remove":
            doc = client.remove(args.node_id)
            if args.json:
                _print_json(doc)
            else:
                banned = ""
                if doc.get("banned"):
                    banned = f"; its id is refused until `pd-cluster nodes allow {args.node_id}`"
                sys.stdout.write(f"node {args.node_id} removed: its requests move to other nodes{banned}\n")
        elif action == "allow":
            doc = client.allow(args.node_id)
            if args.json:
                _print_json(doc)
            else:
                sys.stdout.write(f"node id {args.node_id} may join again\n")
    except AdminError as e:
        sys.stderr.write(f"pd-cluster nodes: {e}\n")
        return 1
    return 0


def _set_role(client: AdminClient, args: argparse.Namespace) -> None:
    view = client.set_role(args.node_id, args.role)
    if args.wait:
        view = _wait_role(client, args.node_id, args.role, args.wait_timeout)
    if args.json:
        _print_json(view)
    elif view.get("pending_role"):
        sys.stdout.write(f"node {args.node_id} is changing role {view['role']} -> {view['pending_role']}: it "
                         "finishes what it holds, then serves as the new role\n")
    else:
        sys.stdout.write(f"node {args.node_id} serves as {view['role']}\n")


def _wait_role(client: AdminClient, node_id: str, role: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view = next((n for n in client.nodes()["data"] if n["id"] == node_id), None)
        if view is None:
            raise AdminError(f"node {node_id} left the cluster while changing role")
        if not view.get("pending_role"):
            if view["role"] != role:
                raise AdminError(f"node {node_id} could not change role: it is still {view['role']} (its log says why)")
            return view
        if time.monotonic() > deadline:
            raise AdminError(f"node {node_id} is still changing role after {timeout:.0f}s")
        time.sleep(0.2)


def _wait_gone(client: AdminClient, node_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(n["id"] == node_id for n in client.nodes()["data"]):
        if time.monotonic() > deadline:
            raise AdminError(f"node {node_id} is still draining after {timeout:.0f}s")
        time.sleep(0.5)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
        if args.watch:
            return _watch(status_view, lambda: cluster_status(client), args)
        status = cluster_status(client)
    except AdminError as e:
        sys.stderr.write(f"pd-cluster status: {e}\n")
        return 1
    if args.json:
        _print_json(status)
    else:
        _console().print(status_view(status))
    return 0


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default=None,
                   help=f"the master's URL (default: ${MASTER_ENV}, else {DEFAULT_MASTER})")
    p.add_argument("--token-file", default=None,
                   help=f"file holding the admin token, used when ${TOKEN_ENV} is not set (default: the file "
                        "`pd-cluster local` writes)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each answer of the master")
    p.add_argument("--json", action="store_true",
                   help="print JSON for scripts instead of a table (watch: one document per line)")


def _add_watch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    """``nodes`` and ``status``, added to the ``pd-cluster`` parser."""
    nodes = sub.add_parser("nodes", help="list, watch, drain, change the role of, remove or allow the nodes of a running "
                           "cluster",
                           description="The nodes a master knows, through its admin API.")
    actions = nodes.add_subparsers(dest="action")
    for name, text in (("list", "print the nodes table once (the default)"),
                       ("watch", "keep the nodes table on screen, refreshed in place")):
        p = actions.add_parser(name, help=text)
        _add_connection_args(p)
        if name == "watch":
            _add_watch_args(p)
    drain = actions.add_parser("drain", help="stop routing new work to a node; it leaves once its requests end")
    drain.add_argument("node_id", help="the node's id, as the ID column shows it")
    drain.add_argument("--wait", action="store_true", help="return only once the node has left the cluster")
    drain.add_argument("--wait-timeout", type=float, default=600.0, help="seconds --wait waits before failing")
    _add_connection_args(drain)
    set_role = actions.add_parser(
        "set-role", help="change a node's role while it serves: it finishes what it holds, keeps its KV and "
        "prefix cache, and serves as ROLE (no restart, no request lost)")
    set_role.add_argument("node_id", help="the node's id, as the ID column shows it")
    set_role.add_argument("role", choices=["prefill", "decode", "mixed"], help="the role it serves as next")
    set_role.add_argument("--wait", action="store_true", help="return only once the node serves as ROLE")
    set_role.add_argument("--wait-timeout", type=float, default=600.0, help="seconds --wait waits before failing")
    _add_connection_args(set_role)
    remove = actions.add_parser(
        "remove", help="drop a node now: its in-flight requests are retried elsewhere (drain is the gentle way)")
    remove.add_argument("node_id", help="the node's id, as the ID column shows it")
    _add_connection_args(remove)
    allow = actions.add_parser("allow", help="let a removed node's id join the cluster again")
    allow.add_argument("node_id", help="the id `remove` took out")
    _add_connection_args(allow)
    # `pd-cluster nodes` alone lists, with the default connection.
    nodes.set_defaults(func=cmd_nodes, action="list", master=None, token_file=None, timeout=10.0, json=False)

    status = sub.add_parser("status", help="the cluster at a glance: health, traffic, latency, nodes")
    _add_connection_args(status)
    status.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    _add_watch_args(status)
    status.set_defaults(func=cmd_status)
