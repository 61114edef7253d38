"""`pd-cluster bench serve` as a user runs it: a subprocess against a real 1P1D cluster on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_cluster.bench.serve.plots import PLOT_FILES
from pd_cluster.model.config import ModelConfig
from pd_cluster.bench.local_process import LocalClusterProcess
from tests.cluster_harness import free_port

MODEL = "SmolLM2-135M-Instruct"
DISTRIBUTIONS = ("ttft", "tpot", "itl", "e2e")
NUMBERS = ("duration_s", "request_throughput", "output_throughput", "total_token_throughput", "goodput",
           "slo_attainment", "slo_ttft_s", "slo_tpot_s", "prompt_tokens", "output_tokens", "requested_output_tokens",
           "cached_prompt_tokens", "kv_transfer_bytes", "kv_bytes_per_prompt_token")


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    """`pd-cluster local` on CPU, as a user starts it (master + 1 prefill + 1 decode node)."""
    home = tmp_path_factory.mktemp("bench-serve-home")
    env = {k: v for k, v in os.environ.items() if k not in ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN")}
    # Every request through the prefill node: the KV-bytes figures this file checks need transfers.
    env.update(PD_CLUSTER_HOME=str(home), PYTHONUNBUFFERED="1", PD_LOCAL_PREFILL_MAX_TOKENS="0")
    port = free_port()
    c = LocalClusterProcess(["--model", str(default_model_dir), "--port", str(port), "--device", "cpu",
                      "--max-total-tokens", "4096"], home / "local.log", port, env=env)
    try:
        c.start(timeout=180)
        yield c
    finally:
        assert c.stop() == 0, c.log_tail()


@pytest.fixture(scope="module")
def kv_bytes_per_token(default_model_dir) -> int:
    """K and V of one token over all layers, float32 as the harness runs the nodes."""
    config = ModelConfig.from_path(default_model_dir)
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


def bench_serve(cluster: LocalClusterProcess, out: Path, *args: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "pd_cluster.cli", "bench", "serve", "--base-url", cluster.url, "--model", MODEL,
           "--json", str(out), "--save-requests", "--no-progress", "--seed", "3", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text()), run.stdout


def assert_complete_result(result: dict, requests: int) -> None:
    assert result["errors"] == {} and result["failed"] == 0
    assert result["completed"] == result["num_requests"] == requests == len(result["requests"])
    for name in DISTRIBUTIONS:
        assert set(result[name]) == {"mean", "p50", "p90", "p99"}
        assert all(v is not None and v > 0 for v in result[name].values()), (name, result[name])
        assert result[name]["p50"] <= result[name]["p90"] <= result[name]["p99"]
    for name in NUMBERS:
        assert result[name] is not None, name
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert 0 <= result["goodput"] <= result["request_throughput"] and 0 <= result["slo_attainment"] <= 1
    assert (result["slo_ttft_s"], result["slo_tpot_s"]) == (1.0, 0.05)


@pytest.mark.slow
def test_random_workload_reports_every_metric_table_json_and_plots(cluster, tmp_path, kv_bytes_per_token):
    plots = tmp_path / "plots"
    doc, stdout = bench_serve(cluster, tmp_path / "random.json", "--workload", "random", "--num-requests", "6",
                              "--input-len", "32", "--output-len", "8", "--rate", "4", "--plot-dir", str(plots))
    assert doc["model"] == MODEL and doc["config"]["workload"] == "random" and doc["config"]["rates"] == [4.0]
    [result] = doc["results"]
    assert result["rate"] == 4.0
    assert_complete_result(result, 6)
    # ignore_eos holds every output to max_tokens; the prompts are exactly the asked length.
    assert result["output_tokens"] == result["requested_output_tokens"] == 6 * 8
    assert all(r["prompt_tokens"] == 32 and r["output_tokens"] == 8 for r in result["requests"])
    # P sent D the KV of the prompt tokens D lacked: at most one token's K and V per prompt token.
    assert 0 < result["kv_bytes_per_prompt_token"] <= kv_bytes_per_token
    assert result["kv_transfer_bytes"] == pytest.approx(result["kv_bytes_per_prompt_token"] * 6 * 32)
    assert "done/sent" in stdout and " 6/6 " in stdout
    for name in PLOT_FILES:
        assert (plots / name).stat().st_size > 1000, name


@pytest.mark.slow
def test_multi_turn_later_turns_reuse_the_cached_history(cluster, tmp_path, kv_bytes_per_token):
    doc, _ = bench_serve(cluster, tmp_path / "multi.json", "--workload", "multi-turn", "--num-conversations", "2",
                         "--turns", "2", "--input-len", "24", "--output-len", "8", "--rate", "4")
    [result] = doc["results"]
    assert doc["config"]["endpoint"] == "chat"
    assert_complete_result(result, 4)
    by_turn = {(r["conversation"], r["turn"]): r for r in result["requests"]}
    ids = {r["request_id"] for r in result["requests"]}  # the master's, to find each in its request log
    assert len(ids) == 4 and all(i and i.startswith("chatcmpl-") for i in ids)
    for conversation in range(2):
        first, second = by_turn[(conversation, 0)], by_turn[(conversation, 1)]
        assert second["start"] >= first["end"]  # turn 2 left only after turn 1's answer arrived
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]  # history grew
        assert second["cached_tokens"] > 0
    assert result["cached_prompt_tokens"] > 0
    # Prefix hits on D mean fewer bytes moved than one token's KV per prompt token.
    assert 0 < result["kv_bytes_per_prompt_token"] < kv_bytes_per_token


def test_the_served_suite_records_each_nodes_batch_limit_and_kv_size(cluster, monkeypatch):
    """The figures say what each node ran with: its batch limit (auto on decode) and KV tokens."""
    from pd_cluster.bench.local_process import node_capacities

    monkeypatch.setenv("PD_CLUSTER_HOME", str(cluster.log_path.parent))
    nodes = node_capacities(cluster.url)
    assert sorted(n["role"] for n in nodes) == ["decode", "prefill"]
    for node in nodes:
        assert node["capacity"]["max_running_requests"] > 0
        assert node["kv_total_tokens"] == node["capacity"]["max_total_tokens"] > 0
