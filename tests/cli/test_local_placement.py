"""Where `pd-cluster local` puts its nodes: the placement plan, a pure function (no GPU needed)."""

from __future__ import annotations

import pytest

from pd_cluster import local_cluster
from pd_cluster.local_cluster import (
    ENGINE_HEADROOM_BYTES,
    GiB,
    NODE_CONTEXT_BYTES,
    GPUMemory,
    LocalCluster,
    LocalOptions,
    PlacementError,
    choose_gpus,
    format_placement_table,
    node_roles,
    plan_placement,
    role_counts,
    with_role_counts,
)

H100 = 80 * GiB
WEIGHTS = 270 * 2**20  # SmolLM2-135M in bfloat16-ish


def test_cpu_nodes_get_no_gpu_and_no_fraction():
    plan = plan_placement(node_roles(1, 2), {}, WEIGHTS)
    assert [(p.name, p.role, p.gpu, p.memory_fraction) for p in plan] == [
        ("prefill-0", "prefill", None, None), ("decode-0", "decode", None, None), ("decode-1", "decode", None, None),
    ]


def test_two_gpus_put_prefill_and_decode_on_distinct_gpus_each_sizing_itself():
    gpus = {0: GPUMemory(free=79 * GiB, total=H100), 1: GPUMemory(free=79 * GiB, total=H100)}
    plan = plan_placement(node_roles(1, 1), gpus, WEIGHTS)
    assert [(p.name, p.gpu, p.memory_fraction) for p in plan] == [("prefill-0", 0, None), ("decode-0", 1, None)]


def test_one_gpu_is_split_evenly_by_explicit_fractions_of_its_total():
    free = 78 * GiB
    plan = plan_placement(node_roles(1, 1), {0: GPUMemory(free=free, total=H100)}, WEIGHTS)
    assert [p.gpu for p in plan] == [0, 0]
    assert plan[0].memory_fraction == plan[1].memory_fraction
    fraction = plan[0].memory_fraction
    # Each node may hold half of what was free, less its CUDA context (outside torch's allocator).
    assert fraction == pytest.approx((free / 2 - NODE_CONTEXT_BYTES) / H100, abs=1e-4)
    assert fraction <= (free / 2 - NODE_CONTEXT_BYTES) / H100  # rounded down, never over
    # Both together never ask for more than was free.
    assert 2 * (fraction * H100 + NODE_CONTEXT_BYTES) <= free
    assert plan[0].kv_bytes == free // 2 - NODE_CONTEXT_BYTES - WEIGHTS - ENGINE_HEADROOM_BYTES
    assert plan[0].shared_by == 2


def test_more_nodes_than_gpus_share_round_robin_and_only_shared_gpus_get_fractions():
    gpus = {0: GPUMemory(free=70 * GiB, total=H100), 1: GPUMemory(free=79 * GiB, total=H100)}
    plan = plan_placement(node_roles(1, 2), gpus, WEIGHTS)
    assert [(p.name, p.gpu) for p in plan] == [("prefill-0", 0), ("decode-0", 1), ("decode-1", 0)]
    assert plan[1].memory_fraction is None  # alone on GPU 1
    assert plan[0].memory_fraction == plan[2].memory_fraction
    assert plan[0].memory_fraction == pytest.approx((35 * GiB - NODE_CONTEXT_BYTES) / H100, abs=1e-4)


def test_the_split_follows_the_chosen_gpus():
    plan = plan_placement(node_roles(2, 2), {3: GPUMemory(40 * GiB, H100), 5: GPUMemory(40 * GiB, H100)}, WEIGHTS)
    assert [p.gpu for p in plan] == [3, 5, 3, 5]
    assert all(p.shared_by == 2 and p.memory_fraction is not None for p in plan)


def test_a_gpu_too_small_for_its_nodes_is_refused_with_the_reason():
    with pytest.raises(PlacementError, match="GPU 0 has 2.0 GiB free: too little for 2 nodes"):
        plan_placement(node_roles(1, 1), {0: GPUMemory(free=2 * GiB, total=8 * GiB)}, 1 * GiB)


@pytest.mark.parametrize(("device", "gpus", "visible", "chosen"), [
    ("auto", None, 0, []),
    ("cpu", None, 4, []),
    ("auto", None, 2, [0, 1]),
    ("cuda", None, 1, [0]),
    ("cuda:1", None, 2, [1]),
    ("auto", [1, 0], 4, [1, 0]),
    ("cuda", [2], 4, [2]),
])
def test_device_and_gpus_choose_the_gpus(device, gpus, visible, chosen):
    assert choose_gpus(device, gpus, visible) == chosen


@pytest.mark.parametrize(("device", "gpus", "visible", "error"), [
    ("cuda", None, 0, "no CUDA device is visible"),
    ("cpu", [0], 2, "does not go with --device cpu"),
    ("auto", [2], 2, "GPU 2 is not visible"),
    ("cuda:0", [1], 2, "disagree"),
    ("auto", [0, 0], 2, "twice"),
    ("tpu", None, 0, "expected auto, cpu, cuda or cuda:N"),
])
def test_impossible_device_choices_are_refused(device, gpus, visible, error):
    with pytest.raises(PlacementError, match=error):
        choose_gpus(device, gpus, visible)


def test_the_engine_keeps_the_headroom_the_plan_reserves():
    from pd_cluster.engine.engine_setup import GPU_HEADROOM_BYTES

    assert GPU_HEADROOM_BYTES == ENGINE_HEADROOM_BYTES


def test_shared_gpu_nodes_get_their_gpu_and_fraction_on_the_command_line(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cluster = LocalCluster(LocalOptions(prefill=1, decode=1, device="cuda"))
    cluster.device_ids = ["0"]
    cluster.placements = plan_placement(node_roles(1, 1), {0: GPUMemory(78 * GiB, H100)}, WEIGHTS)
    specs = {s.name: s for s in cluster.process_specs("cluster-token", "admin-token")}
    assert specs["master"].env["CUDA_VISIBLE_DEVICES"] == "" and specs["master"].env["PD_ADMIN_TOKEN"] == "admin-token"
    for name in ("prefill-0", "decode-0"):
        argv, env = list(specs[name].argv), specs[name].env
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and "PD_ADMIN_TOKEN" not in env
        assert env["PD_CLUSTER_TOKEN"] == "cluster-token"
        assert argv[argv.index("--device") + 1] == "cuda"
        assert float(argv[argv.index("--gpu-memory-fraction") + 1]) == cluster.placements[0].memory_fraction
        assert argv[argv.index("--node-id") + 1] == name
    assert "cluster-token" not in " ".join(specs["decode-0"].argv)  # secrets travel in the environment only
    assert "--prefill-chunk-tokens" not in specs["prefill-0"].argv  # unset: the nodes' own default


def test_node_engine_options_reach_every_node_command_line(monkeypatch):
    from pd_cluster.cli import build_parser, engine_config_from_args

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cluster = LocalCluster(LocalOptions(prefill=1, decode=1, device="cpu", prefill_chunk_tokens=256))
    cluster.plan()
    specs = {s.name: s for s in cluster.process_specs("cluster-token", "admin-token")}
    for name in ("prefill-0", "decode-0"):
        argv = list(specs[name].argv)
        assert argv[argv.index("--prefill-chunk-tokens") + 1] == "256"
        node_args = build_parser().parse_args(argv[argv.index(specs[name].role):])
        assert engine_config_from_args(node_args, specs[name].role).prefill_chunk_tokens == 256


def test_local_with_tls_serves_https_and_hands_the_files_to_every_process(monkeypatch, tmp_path):
    from pd_cluster.cli import _node_settings, build_parser
    from tests.tls_files import make_tls_files

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PD_CLUSTER_TOKEN", "cluster-token")
    tls = make_tls_files(tmp_path)
    args = build_parser().parse_args(["local", "--device", "cpu", "--tls-cert", str(tls.cert), "--tls-key",
                                      str(tls.key), "--tls-ca", str(tls.ca)])
    cluster = LocalCluster(LocalOptions(prefill=1, decode=1, device="cpu", tls_cert=args.tls_cert,
                                        tls_key=args.tls_key, tls_ca=args.tls_ca))
    assert cluster.url == "https://127.0.0.1:8000"
    cluster.plan()
    specs = {s.name: s for s in cluster.process_specs("cluster-token", "admin-token")}
    master = list(specs["master"].argv)
    assert master[master.index("--tls-cert") + 1] == str(tls.cert) and "--tls-ca" not in master
    for name in ("prefill-0", "decode-0"):
        argv = list(specs[name].argv)
        settings = _node_settings(build_parser().parse_args(argv[argv.index(specs[name].role):]), specs[name].role)
        assert settings.master.startswith("https://") and settings.tls_ca == tls.ca and settings.data_plane_tls
        assert (settings.tls_cert is not None) == (name == "decode-0")  # only D presents one (its data plane)


def test_placement_table_lists_every_node():
    table = format_placement_table([
        {"node": "master", "role": "master", "gpu": "-", "pid": 10},
        {"node": "prefill-0", "role": "prefill", "gpu": "0", "mem_fraction": "0.4700", "kv_slots": 1234567, "pid": 11},
    ])
    lines = table.splitlines()
    assert lines[0].split() == ["NODE", "ROLE", "GPU", "MEM", "FRACTION", "KV", "SLOTS", "PID"]
    assert lines[2].split() == ["prefill-0", "prefill", "0", "0.4700", "1234567", "11"]


@pytest.mark.parametrize("counts, error", [
    ({"prefill": 0, "decode": 0, "mixed": 0}, "needs a decode node or a mixed node"),
    ({"prefill": 1, "decode": 0, "mixed": 1}, "prefill nodes need a decode node"),
    ({"prefill": -1, "decode": 1}, "cannot be negative"),
])
def test_node_counts_that_cannot_serve_are_refused(counts, error):
    with pytest.raises(PlacementError, match=error):
        LocalCluster(LocalOptions(**counts))


def test_mixed_nodes_are_placed_like_the_others():
    cluster = LocalCluster(LocalOptions(prefill=0, decode=0, mixed=2, device="cpu"))
    assert [(p.name, p.role) for p in cluster.plan()] == [("mixed-0", "mixed"), ("mixed-1", "mixed")]


@pytest.mark.parametrize("device, gpus, visible, roles", [
    ("cpu", None, 0, [("prefill-0", "prefill"), ("decode-0", "decode")]),
    ("auto", None, 1, [("mixed-0", "mixed")]),
    ("cuda:1", None, 2, [("mixed-0", "mixed")]),
    ("auto", [0], 4, [("mixed-0", "mixed")]),
    ("auto", None, 2, [("prefill-0", "prefill"), ("decode-0", "decode")]),
])
def test_with_no_counts_given_one_gpu_gets_one_mixed_node_and_more_a_prefill_and_a_decode_node(
        monkeypatch, device, gpus, visible, roles):
    monkeypatch.setattr(local_cluster, "probe_gpus", lambda: [GPUMemory(free=79 * GiB, total=H100)] * visible)
    cluster = LocalCluster(LocalOptions(device=device, gpus=gpus))
    assert [(p.name, p.role) for p in cluster.plan()] == roles
    assert role_counts(cluster.options) == (roles.count(("prefill-0", "prefill")), roles.count(("decode-0", "decode")),
                                            roles.count(("mixed-0", "mixed")))


def test_a_count_given_keeps_the_others_defaults_on_one_gpu():
    assert role_counts(with_role_counts(LocalOptions(mixed=1), 1)) == (1, 1, 1)
    assert role_counts(with_role_counts(LocalOptions(decode=2), 1)) == (1, 2, 0)
    assert role_counts(LocalCluster(LocalOptions(prefill=2)).options) == (2, 1, 0)
