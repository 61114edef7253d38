"""Start, scale, inspect and stop a pd-cluster whose processes run as Ray actors.

Every actor is named and detached in one Ray namespace, so each command is a fresh Ray driver
that finds the cluster by name. Nodes join the master by themselves; removing one drains it
through the master's admin API first, so no request is lost.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from pd_cluster.node_counts import node_count_problem
from pd_cluster.ray_launcher.actors import ClusterState, RoleProcess
from pd_cluster.ray_launcher.master_client import MasterClient
from pd_cluster.ray_launcher.placement import release_nodes, reserve_node
from pd_cluster.ray_launcher.spec import (
    DEFAULT_NAMESPACE,
    NODE_ROLES,
    STATE_ACTOR,
    ClusterSpec,
    master_actor_name,
    master_index,
)

logger = logging.getLogger(__name__)

POLL_S = 0.5
CALL_TIMEOUT_S = 30.0
KILL_GRACE_S = 30.0
MAX_ACTOR_CONCURRENCY = 8

_remote_classes: dict[str, Any] = {}


def _remote(cls: type) -> Any:
    """``ray.remote(cls)``, made once per process."""
    if cls.__name__ not in _remote_classes:
        _remote_classes[cls.__name__] = ray.remote(cls)
    return _remote_classes[cls.__name__]


class LaunchError(RuntimeError):
    """A launcher command could not do what it was asked; the message says why and what to do."""


@dataclass
class ScaleResult:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    forced: list[str] = field(default_factory=list)  # did not finish draining in time and were killed
    in_flight: dict[str, int] = field(default_factory=dict)  # requests a removed node held when its drain began


@dataclass
class ClusterStatus:
    namespace: str
    master_url: str | None
    healthy: bool
    actors: dict[str, dict[str, Any]]  # actor name -> RoleProcess.info() (or {"placed": False})
    nodes: dict[str, dict[str, Any]] | None  # node id -> the master's admin view; None if unreachable


def first_master(urls: str) -> str:
    """The master the launcher asks (any master knows every node): the first of a node's list."""
    return urls.split(",")[0].strip()


def node_role(name: str) -> str | None:
    """The role of a node actor from its name (``decode-3`` -> ``decode``)."""
    role, _, index = name.rpartition("-")
    return role if role in NODE_ROLES and index.isdigit() else None


def check_node_counts(prefill: int, decode: int, mixed: int) -> None:
    """Refuse a cluster that could not serve: the same rules as ``pd-cluster local``."""
    problem = node_count_problem(prefill, decode, mixed)
    if problem is not None:
        raise LaunchError(problem)


def _node_index(name: str) -> int:
    return int(name.rpartition("-")[2])


def _in_flight(view: dict[str, Any]) -> int:
    """Requests a node holds: the master's count, or the node's own if its report is newer."""
    load = view.get("load", {})
    return max(int(load.get("routed_in_flight", 0)), int(load.get("running", 0)) + int(load.get("waiting", 0)))


def _probe(address: str | None, timeout: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on: ``ray.init`` would retry for minutes."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise LaunchError(f"no Ray cluster answers at {address} ({e}); start one with `ray up` or "
                          "`ray start --head`, or pass the right --address") from e


class RayLauncher:
    def __init__(self, namespace: str = DEFAULT_NAMESPACE, address: str | None = "auto") -> None:
        self.namespace = namespace
        self.address = address
        self._connected_here = False

    # ---- connection -----------------------------------------------------------------------

    def connect(self) -> None:
        """Join the running Ray cluster (or reuse this process's connection)."""
        if ray.is_initialized():
            return
        _probe(self.address)
        try:
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     logging_level=logging.WARNING)
        except ConnectionError as e:
            raise LaunchError(f"no Ray cluster at {self.address!r} ({e}); start one with `ray up` or "
                              f"`ray start --head`, or pass --address") from e
        self._connected_here = True

    def disconnect(self) -> None:
        if self._connected_here and ray.is_initialized():
            ray.shutdown()
        self._connected_here = False

    # ---- commands -------------------------------------------------------------------------

    def start(self, spec: ClusterSpec, prefill: int, decode: int, timeout: float = 600.0, mixed: int = 0) -> str:
        """Master, then ``prefill`` P, ``decode`` D and ``mixed`` actors; returns the master's URL once all joined."""
        if spec.namespace != self.namespace:
            raise ValueError("the spec's namespace differs from the launcher's")
        check_node_counts(prefill, decode, mixed)
        self.connect()
        existing = self.actor_names()
        if existing:
            raise LaunchError(f"namespace {self.namespace!r} already has actors ({', '.join(sorted(existing))}): "
                              "use `pd-cluster ray scale` or `pd-cluster ray stop` first")
        deadline = time.monotonic() + timeout
        spec_json = spec.model_dump_json()
        cluster_token = os.environ.get("PD_CLUSTER_TOKEN") or secrets.token_urlsafe(32)
        admin_token = os.environ.get("PD_ADMIN_TOKEN") or secrets.token_urlsafe(32)
        try:
            state = _remote(ClusterState).options(
                name=STATE_ACTOR, namespace=self.namespace, lifetime="detached", num_cpus=0,
                resources=spec.pin_resources(),
            ).remote(spec_json)
            self._get(state.set_tokens.remote(cluster_token, admin_token), deadline,
                      f"the state actor (CPU: 0{self._pin_hint(spec)}) was not placed")
            started: dict[str, Any] = {}
            urls: list[str] = []
            for index in range(spec.masters):
                name = master_actor_name(index)
                started[name] = _remote(RoleProcess).options(
                    name=name, namespace=self.namespace, lifetime="detached", num_cpus=spec.master_cpus,
                    num_gpus=0, resources=spec.pin_resources(), max_restarts=spec.max_restarts,
                    max_concurrency=MAX_ACTOR_CONCURRENCY,
                ).remote("master", name, spec_json)
            for name in list(started):
                urls.append(self._get(started[name].address.remote(), deadline,
                                      f"the {name} actor (CPU: {spec.master_cpus}{self._pin_hint(spec)}) was not placed"))
                logger.info("%s placed: %s", name, urls[-1])
            # Nodes get every master (they register with each); the state keeps the list.
            url = ",".join(urls)
            self._get(state.set_master_url.remote(url), deadline, "the state actor did not answer")
            for role, count in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
                for _ in range(count):
                    name = self._get(state.next_node_name.remote(role), deadline, "the state actor did not answer")
                    started[name] = self._create_node(spec, role, name, url)
            for master_url in urls:  # every master sees every node
                with MasterClient(master_url, admin_token, verify=spec.client_tls()) as client:
                    self._wait_joined(client, started, deadline, spec)
        except BaseException:
            logger.error("starting the cluster failed; removing what was started")
            try:
                self.stop(timeout=KILL_GRACE_S)
            except Exception:
                logger.exception("cleanup after a failed start failed; run `pd-cluster ray stop`")
            raise
        return url

    def scale(self, prefill: int = 0, decode: int = 0, timeout: float | None = None,
              allow_empty: bool = False, mixed: int = 0) -> ScaleResult:
        """Add (delta > 0) or drain and remove (delta < 0) prefill, decode and mixed nodes."""
        self.connect()
        state = self._state()
        spec = ClusterSpec.model_validate_json(self._call(state.spec.remote()))
        url = self._call(state.master_url.remote())
        admin_token = self._call(state.tokens.remote())["admin"]
        deadline = time.monotonic() + (timeout if timeout is not None else spec.drain_timeout_s + 60.0)
        deltas = {"prefill": prefill, "decode": decode, "mixed": mixed}
        result = ScaleResult()
        with MasterClient(first_master(url), admin_token, verify=spec.client_tls()) as client:
            victims = self._pick_victims(client, deltas, allow_empty)
            added: dict[str, Any] = {}
            for role, delta in deltas.items():
                for _ in range(max(delta, 0)):
                    name = self._call(state.next_node_name.remote(role))
                    added[name] = self._create_node(spec, role, name, url)
            if added:
                try:
                    self._wait_joined(client, added, deadline, spec)
                except BaseException:
                    self._stop_processes(self._placed(added), KILL_GRACE_S)
                    self._kill(added)
                    release_nodes(self.namespace, list(added))
                    raise
                result.added = list(added)
            if victims:
                result.forced = self._remove_nodes(client, victims, deadline, result.in_flight)
                result.removed = victims
        return result

    def stop(self, timeout: float | None = None) -> list[str]:
        """Drain every node (SIGTERM), stop the master, kill every actor; returns the actors' names."""
        self.connect()
        names = self.actor_names()
        if not names:
            release_nodes(self.namespace)
            return []
        drain_s = timeout
        if drain_s is None:
            try:
                drain_s = ClusterSpec.model_validate_json(self._call(self._state().spec.remote())).drain_timeout_s
            except (LaunchError, RayError):
                drain_s = KILL_GRACE_S
        handles = {n: h for n in names if (h := self._handle(n)) is not None}
        placed = self._placed({n: h for n, h in handles.items() if n != STATE_ACTOR})
        self._stop_processes({n: h for n, h in placed.items() if node_role(n)}, drain_s)
        masters = {n: h for n, h in placed.items() if master_index(n) is not None}
        if masters:
            self._stop_processes(masters, KILL_GRACE_S)
        self._kill(handles)
        release_nodes(self.namespace)
        deadline = time.monotonic() + KILL_GRACE_S
        while (left := self.actor_names()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if left:
            raise LaunchError(f"actors still listed after stop: {', '.join(sorted(left))}")
        return names

    def status(self) -> ClusterStatus:
        self.connect()
        names = [n for n in self.actor_names() if n != STATE_ACTOR]
        refs = {}
        for name in names:
            handle = self._handle(name)
            if handle is not None:
                refs[name] = handle.info.remote()
        actors: dict[str, dict[str, Any]] = {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0) if refs else ([], [])
        for name, ref in refs.items():
            if ref not in ready:
                actors[name] = {"name": name, "role": node_role(name) or name, "placed": False}
                continue
            try:
                actors[name] = {**ray.get(ref), "placed": True}
            except RayError as e:
                actors[name] = {"name": name, "role": node_role(name) or name, "placed": False, "error": str(e)}
        url, nodes, healthy = None, None, False
        try:
            state = self._state()
            url = self._call(state.master_url.remote())
            admin_token = self._call(state.tokens.remote())["admin"]
            verify = ClusterSpec.model_validate_json(self._call(state.spec.remote())).client_tls()
        except LaunchError:
            admin_token, verify = None, True
        if url:
            with MasterClient(first_master(url), admin_token, verify=verify) as client:
                healthy = client.healthy()
                nodes = client.try_nodes()
        return ClusterStatus(self.namespace, url, healthy, actors, nodes)

    def tokens(self) -> dict[str, str | None]:
        self.connect()
        return self._call(self._state().tokens.remote())

    def logs(self, name: str, lines: int = 100) -> list[str]:
        self.connect()
        handle = self._handle(name)
        if handle is None:
            raise LaunchError(f"no actor {name!r} in namespace {self.namespace!r}")
        return self._call(handle.log_tail.remote(lines))

    def actor_names(self) -> list[str]:
        """Names of this cluster's live actors (pending ones included)."""
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == self.namespace]

    # ---- placing and joining --------------------------------------------------------------

    def _create_node(self, spec: ClusterSpec, role: str, name: str, master_url: str) -> Any:
        return _remote(RoleProcess).options(
            name=name, namespace=self.namespace, lifetime="detached", max_restarts=spec.max_restarts,
            max_concurrency=MAX_ACTOR_CONCURRENCY, **spec.node_actor_options(role), **reserve_node(spec, role, name),
        ).remote(role, name, spec.model_dump_json(), master_url)

    def _wait_joined(self, client: MasterClient, actors: dict[str, Any], deadline: float,
                     spec: ClusterSpec) -> None:
        """Until every node in ``actors`` is active on the master and /health is 200 (bounded)."""
        placed_refs = {name: h.address.remote() for name, h in actors.items()}
        placed: set[str] = set()
        expected = {n for n in actors if node_role(n)}
        while True:
            waiting = [ref for name, ref in placed_refs.items() if name not in placed]
            if waiting:
                ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                for name, ref in placed_refs.items():
                    if ref in ready:
                        try:
                            ray.get(ref)
                        except RayError as e:
                            raise LaunchError(f"actor {name} failed to start: {e}") from e
                        placed.add(name)
            infos = self._infos({n: actors[n] for n in placed})
            for name, info in infos.items():
                if info.get("dead"):
                    raise LaunchError(f"actor {name} died: {info.get('error')}")
                if info.get("exited"):
                    tail = "\n  ".join(self._call(actors[name].log_tail.remote(30)))
                    raise LaunchError(f"{name} exited with code {info.get('returncode')}; its last lines:\n  {tail}")
            nodes = client.try_nodes()
            joined = {n for n in expected if nodes is not None and nodes.get(n, {}).get("state") == "active"}
            if joined == expected and client.healthy():
                return
            if time.monotonic() > deadline:
                unplaced = sorted(set(actors) - placed)
                hint = ""
                if unplaced:
                    roles = sorted({role for n in unplaced if (role := node_role(n))})
                    needs = "; ".join(f"{role}: GPU {spec.node_gpus(role)}, CPU {spec.node_cpus(role)}"
                                      + "".join(f", {r} 1" for r in [spec.role_resource(role)] if r)
                                      + (f" on one Ray node (tp {spec.node_tp(role)})" if spec.node_tp(role) > 1 else "")
                                      for role in roles)
                    hint = f"; not placed: {', '.join(unplaced)} (a node needs {needs}: see `ray status`)"
                missing = sorted(expected - joined - set(unplaced))
                if missing:
                    hint += f"; not joined yet: {', '.join(missing)} (see `pd-cluster ray logs NAME`)"
                raise LaunchError(f"the cluster was not ready in time{hint}")
            time.sleep(POLL_S)

    # ---- removing ---------------------------------------------------------------------------

    def _pick_victims(self, client: MasterClient, deltas: dict[str, int], allow_empty: bool) -> list[str]:
        """Per role: nodes that already left first, then the least loaded, newest first on ties.

        Removing the last active prefill or decode node is refused (without ``allow_empty``); mixed
        nodes are often an addition to P and D, so the last one goes unless no decode node is left
        to serve either."""
        wanted = {role: -d for role, d in deltas.items() if d < 0}
        if not wanted:
            return []
        nodes = client.nodes()
        names = self.actor_names()
        victims: list[str] = []
        for role, count in wanted.items():
            mine = [n for n in names if node_role(n) == role]
            if count > len(mine):
                raise LaunchError(f"cannot remove {count} {role} nodes: the cluster has {len(mine)}")
            gone = [n for n in mine if n not in nodes]
            registered = sorted((n for n in mine if n in nodes), key=lambda n: (_in_flight(nodes[n]), -_node_index(n)))
            chosen = (sorted(gone, key=_node_index) + registered)[:count]
            victims += chosen
            serving = ("decode", "mixed") if role == "mixed" else (role,)
            active_left = [n for n, view in nodes.items() if view.get("role") in serving and n not in victims
                           and view.get("state") == "active"]
            if not active_left and not allow_empty:
                left = "no active decode or mixed node" if role == "mixed" else f"no active {role} node"
                raise LaunchError(f"removing {count} {role} node(s) would leave {left} "
                                  "(pass --allow-empty to do it anyway)")
        return victims

    def _remove_nodes(self, client: MasterClient, victims: list[str], deadline: float,
                      in_flight: dict[str, int]) -> list[str]:
        """Drain through the master (SIGTERM if it does not know the node), wait until each left and
        exited, then kill the actors. Returns the nodes that had to be killed at the deadline."""
        handles = {n: self._handle(n) for n in victims}
        for name, handle in handles.items():
            try:
                view = client.drain_node(name)
            except Exception as e:  # master unreachable: the node drains on SIGTERM just the same
                logger.warning("the master did not take the drain of %s (%s); sending SIGTERM", name, e)
                view = None
            if view is None:
                if handle is not None:
                    handle.drain.remote(max(deadline - time.monotonic(), 1.0))
                logger.info("draining %s (SIGTERM)", name)
            else:
                in_flight[name] = _in_flight(view)
                logger.info("draining %s (%d requests in flight)", name, in_flight[name])
        pending = {n for n, h in handles.items() if h is not None}
        while pending and time.monotonic() < deadline:
            nodes = client.try_nodes()
            infos = self._infos({n: handles[n] for n in pending})
            for name in list(pending):
                left = nodes is not None and name not in nodes
                if left and infos.get(name, {}).get("exited"):
                    pending.discard(name)
            if pending:
                time.sleep(POLL_S)
        if pending:
            logger.warning("not drained in time, stopping: %s", ", ".join(sorted(pending)))
        self._stop_processes({n: h for n, h in handles.items() if h is not None}, KILL_GRACE_S)
        self._kill({n: h for n, h in handles.items() if h is not None})
        release_nodes(self.namespace, victims)
        return sorted(pending)

    def _stop_processes(self, handles: dict[str, Any], timeout: float) -> None:
        """``stop`` on every actor at once: SIGTERM, SIGKILL after ``timeout``; bounded even if unplaced."""
        refs = {name: h.stop.remote(timeout) for name, h in handles.items()}
        if not refs:
            return
        ready, not_ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + KILL_GRACE_S)
        for name, ref in refs.items():
            if ref in ready:
                try:
                    logger.info("%s stopped (exit code %s)", name, ray.get(ref))
                except RayError as e:
                    logger.info("%s: actor already gone (%s)", name, type(e).__name__)
            else:
                logger.warning("%s did not answer stop in time; killing its actor", name)

    @staticmethod
    def _placed(handles: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """The process actors that exist on some Ray node (a pending one has no process to stop)."""
        refs = {name: h.address.remote() for name, h in handles.items()}
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        return {name: handles[name] for name, ref in refs.items() if ref in ready}

    def _kill(self, handles: dict[str, Any]) -> None:
        for name, handle in handles.items():
            try:
                ray.kill(handle, no_restart=True)
            except (RayError, ValueError) as e:
                logger.info("%s: %s", name, e)

    # ---- small helpers ----------------------------------------------------------------------

    def _infos(self, handles: dict[str, Any]) -> dict[str, dict[str, Any]]:
        refs = {name: h.info.remote() for name, h in handles.items()}
        out: dict[str, dict[str, Any]] = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except RayActorError as e:
                out[name] = {"name": name, "exited": True, "dead": True, "error": str(e)}
            except GetTimeoutError:
                logger.warning("actor %s did not answer within %.0fs", name, CALL_TIMEOUT_S)
        return out

    def _state(self) -> Any:
        handle = self._handle(STATE_ACTOR)
        if handle is None:
            raise LaunchError(f"no pd-cluster in Ray namespace {self.namespace!r}: start one with "
                              "`pd-cluster ray start`")
        return handle

    def _handle(self, name: str) -> Any | None:
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None

    @staticmethod
    def _call(ref: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as e:
            raise LaunchError(f"an actor did not answer within {timeout:.0f}s") from e

    @staticmethod
    def _get(ref: Any, deadline: float, what: str) -> Any:
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
        except GetTimeoutError as e:
            raise LaunchError(f"{what} in time (see `ray status`)") from e
        except RayActorError as e:
            raise LaunchError(f"{what}: {e}") from e

    @staticmethod
    def _pin_hint(spec: ClusterSpec) -> str:
        return f", {spec.master_resource}: 0.001" if spec.master_resource else ""
