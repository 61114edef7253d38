"""Checks shared by the tests of an on-by-default engine switch given on the command line."""

from __future__ import annotations


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
