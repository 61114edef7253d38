"""The Ray actors of a cluster: one per process (master, each node) plus a small state actor.

The classes are plain; the launcher wraps them with ``ray.remote`` and places them as named,
detached actors, so ``start`` can return and a later ``scale``, ``status`` or ``stop`` finds them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pd_cluster.ray_launcher.spec import NODE_ROLES, STATE_ACTOR, ClusterSpec, master_index
from pd_cluster.ray_launcher.supervisor import ProcessSupervisor

logger = logging.getLogger(__name__)

SECRETS_TIMEOUT_S = 60.0


class ClusterState:
    """What every later command needs: the spec, the tokens, the master's URL, node name counters.

    Tokens arrive through ``set_tokens`` rather than the constructor so they are not part of the
    actor's creation record.
    """

    def __init__(self, spec_json: str) -> None:
        self._spec_json = spec_json
        self._cluster_token: str | None = None
        self._admin_token: str | None = None
        self._master_url: str | None = None
        self._next_index = {role: 0 for role in NODE_ROLES}

    def set_tokens(self, cluster_token: str, admin_token: str) -> None:
        self._cluster_token, self._admin_token = cluster_token, admin_token

    def tokens(self) -> dict[str, str | None]:
        return {"cluster": self._cluster_token, "admin": self._admin_token}

    def process_env(self, role: str) -> dict[str, str]:
        """Environment entries of a role's process: nodes get only the cluster token."""
        if self._cluster_token is None:
            raise RuntimeError("the cluster tokens are not set yet")
        env = {"PD_CLUSTER_TOKEN": self._cluster_token}
        if role == "master" and self._admin_token:
            env["PD_ADMIN_TOKEN"] = self._admin_token
        return env

    def spec(self) -> str:
        return self._spec_json

    def set_master_url(self, url: str) -> None:
        self._master_url = url

    def master_url(self) -> str | None:
        return self._master_url

    def next_node_name(self, role: str) -> str:
        """A name never used before in this cluster: the actor's name and the node id."""
        if role not in self._next_index:
            raise ValueError(f"not a node role: {role!r}")
        index = self._next_index[role]
        self._next_index[role] = index + 1
        return f"{role}-{index}"


class RoleProcess:
    """Runs ``python -m pd_cluster.cli <role> ...`` on the Ray node it was placed on and supervises it.

    The process starts in the constructor, so if Ray restarts the actor (its node was lost) the
    process starts again. On GPU, Ray has already set ``CUDA_VISIBLE_DEVICES`` for this actor and
    the child inherits it.
    """

    def __init__(self, role: str, name: str, spec_json: str, master_url: str | None = None) -> None:
        import ray

        spec = ClusterSpec.model_validate_json(spec_json)
        self.role, self.name = role, name
        self.ip = _node_ip()
        if role == "master":
            index = master_index(name) or 0
            argv = spec.master_argv(index)
            self._address = spec.master_url(self.ip, index)
        else:
            if master_url is None:
                raise ValueError("a node needs the master's URL")
            argv = spec.node_argv(role, name, master_url, self.ip)
            self._address = self.ip
        state = ray.get_actor(STATE_ACTOR, namespace=spec.namespace)
        env = dict(os.environ)
        env.update(ray.get(state.process_env.remote(role), timeout=SECRETS_TIMEOUT_S))
        try:
            self._gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        except Exception:  # no accelerator manager on this node
            self._gpu_ids = []
        self.supervisor = ProcessSupervisor(argv, env, name=name, max_restarts=spec.max_restarts)
        self.supervisor.start()

    def address(self) -> str:
        """The master's HTTP URL, or a node's IP."""
        return self._address

    def pid(self) -> int | None:
        return self.supervisor.pid

    def alive(self) -> bool:
        return self.supervisor.alive

    def info(self) -> dict[str, Any]:
        s = self.supervisor
        return {"name": self.name, "role": self.role, "ip": self.ip, "address": self._address, "pid": s.pid,
                "alive": s.alive, "exited": s.exited, "returncode": s.returncode, "restarts": s.restarts,
                "gpu_ids": self._gpu_ids}

    def wait_exit(self, timeout: float) -> int | None:
        return self.supervisor.wait_exit(timeout)

    def drain(self, timeout: float) -> int | None:
        """SIGTERM: a node stops taking work, finishes its requests and leaves; None if not done in time."""
        return self.supervisor.terminate(timeout)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        return self.supervisor.stop(timeout)

    def log_tail(self, lines: int = 50) -> list[str]:
        return self.supervisor.tail(lines)


def _node_ip() -> str:
    """The address this actor's Ray node registered with (what other nodes reach it at)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()
