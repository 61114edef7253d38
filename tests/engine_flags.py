"""Checks shared by the tests of the engine's command-line flags."""

from __future__ import annotations

from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster.engine_flags import EngineFlag


def sample_value(flag: EngineFlag) -> Any:
    """A value the engine takes for the flag, other than its default (a whole number past 1e6 where
    the field has no upper bound, which the Helm chart must still write without an exponent)."""
    info = EngineConfig.model_fields[flag.field]
    if flag.kind is bool:
        return info.default is not True
    if flag.choices:
        return flag.choices[-1]
    if flag.kind is list:
        return [64, 256]
    if flag.kind is float:
        return 0.5
    if flag.kind is str:
        return "cpu" if flag.field == "device" else "some/model"
    high = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    return high if high is not None else 4_000_000


def check_switch_reaches_every_node(flag: str, field: str) -> None:
    """``--<flag>`` is on by default and ``--no-<flag>`` turns ``EngineConfig.<field>`` off on a node
    command; ``pd-cluster local`` hands ``--no-<flag>`` to each node it starts."""
    from pd_cluster.cli import build_parser, engine_config_from_args
    from pd_cluster.local_cluster import LocalCluster, LocalOptions

    parser = build_parser()
    configs = [engine_config_from_args(parser.parse_args(["decode", "--master", "http://m", *extra]), "decode")
               for extra in ([], [f"--{flag}"], [f"--no-{flag}"])]
    assert [getattr(c, field) for c in configs] == [True, True, False]
    local = parser.parse_args(["local", "--device", "cpu", f"--no-{flag}"])
    cluster = LocalCluster(LocalOptions(device="cpu", **{field: getattr(local, field)}))
    cluster.plan()
    nodes = [spec.argv for spec in cluster.process_specs("token", "admin") if spec.name != "master"]
    assert nodes and all(f"--no-{flag}" in argv for argv in nodes)
