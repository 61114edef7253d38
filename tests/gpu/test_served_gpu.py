"""The served cluster on a GPU, as users start it: ``pd-cluster local`` with default flags.

On a Llama-3-8B-shaped random model (written by ``pd_cluster.bench.random_model``, nothing is
downloaded) and on the default model (the real one when its package is installed, else its shape
with random weights): greedy answers through the master equal the offline engine's on the same
GPU, a short ``bench serve`` run ends with 0 errors, and draining a decode node under load fails
no request. With two or more GPUs, the nodes are placed one per GPU.

    python -m pytest -q -m gpu tests/gpu/test_served_gpu.py -s

``PD_GPU_MODEL_8B`` names an already written 8B-shape directory, to skip writing one (~30 s).
``PD_GPU_TOKENIZER`` names a tokenizer directory for the random-weight models, on a machine
without the default model's package.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pd_cluster.bench.local_process import LocalClusterProcess, placement_table
from tests.cluster_harness import free_port, wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
MAX_TOKENS = 24


def offline_answers(model: Path) -> list[str]:
    """The offline engine's greedy answers, on the same GPU, freed before the cluster starts."""
    from pd_cluster import LLM, SamplingParams

    llm = LLM(model=str(model))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # One at a time, as the served test sends them: the same batch shapes, the same kernels.
    texts = [llm.generate([prompt], params)[0].text for prompt in PROMPTS]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return texts


def start_local(model: Path, log_dir: Path, *extra: str) -> LocalClusterProcess:
    port = free_port()
    cluster = LocalClusterProcess(["--model", str(model), "--port", str(port), *extra], log_dir / "local.log", port)
    cluster.start(timeout=180)
    return cluster


def admin_token() -> str:
    from pd_cluster.default_model import cache_home

    return (cache_home() / "local" / "admin-token").read_text().strip()


def served_answers(cluster: LocalClusterProcess) -> list[str]:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    answers = []
    for prompt in PROMPTS:  # one at a time: the same batch shapes as the offline engine's
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        answers.append(reply.choices[0].text)
    return answers


def bench_serve(cluster: LocalClusterProcess, model: Path, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "pd_cluster.cli", "bench", "serve", "--base-url", cluster.url, "--tokenizer",
           str(model), "--json", str(out), "--no-progress", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PD_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("PD_ADMIN_TOKEN", raising=False)


def served_roles(table: str) -> dict[str, list[str]]:
    """The placement table's node rows by role (the master's row left out); each asserted placed on a
    GPU (a digit in its GPU column)."""
    rows = {line.split()[1]: line.split() for line in table.splitlines()[1:] if line.split()[1] != "master"}
    assert rows and all(row[2].isdigit() for row in rows.values()), table
    return rows


@pytest.mark.parametrize("which", ["model_8b", "small_model"])
def test_default_flags_serve_the_offline_engines_answers(which, request, tmp_path):
    model = request.getfixturevalue(which)
    expected = offline_answers(model)
    cluster = start_local(model, tmp_path)
    try:
        roles = served_roles(placement_table(cluster.wait_for_line("NODE  ", 60)))
        # The default split (pd_cluster.local_placement.default_roles): one mixed node on one GPU,
        # a prefill and a decode node on several.
        one_gpu = torch.cuda.device_count() == 1
        assert set(roles) == ({"mixed"} if one_gpu else {"prefill", "decode"}), roles
        assert served_answers(cluster) == expected
        result = bench_serve(cluster, model, tmp_path / "bench.json", "--num-requests", "16", "--input-len", "1024",
                             "--output-len", "32", "--rate", "8")
        run = result["results"][0]
        assert run["failed"] == 0 and run["completed"] == 16, run["errors"]
        if one_gpu:
            assert not run["kv_bytes_per_prompt_token"], run  # a mixed node moves no KV
    finally:
        assert cluster.stop() == 0, cluster.log_tail()


def test_a_prefill_and_a_decode_node_serve_the_offline_engines_answers(small_model, tmp_path):
    """P -> D asked for explicitly (the default on several GPUs): the same answers, and prompts
    longer than the local-prefill threshold (512 tokens by default) move their KV."""
    expected = offline_answers(small_model)
    cluster = start_local(small_model, tmp_path, "--prefill", "1", "--decode", "1", "--mixed", "0")
    try:
        roles = served_roles(placement_table(cluster.wait_for_line("NODE  ", 60)))
        assert set(roles) == {"prefill", "decode"}, roles
        assert served_answers(cluster) == expected
        result = bench_serve(cluster, small_model, tmp_path / "bench.json", "--num-requests", "16", "--input-len",
                             "1024", "--output-len", "32", "--rate", "8")
        run = result["results"][0]
        assert run["failed"] == 0 and run["completed"] == 16, run["errors"]
        assert run["kv_bytes_per_prompt_token"] and run["kv_bytes_per_prompt_token"] > 0
    finally:
        assert cluster.stop() == 0, cluster.log_tail()


def test_drain_a_decode_node_under_load_fails_nothing(small_model, tmp_path):
    cluster = start_local(small_model, tmp_path, "--decode", "2")
    try:
        headers = {"Authorization": f"Bearer {admin_token()}"}
        nodes = httpx.get(cluster.url + "/admin/nodes", headers=headers, timeout=10).json()["data"]
        decode = sorted(n["id"] for n in nodes if n["role"] == "decode")
        assert len(decode) == 2
        result: dict = {}
        load = threading.Thread(target=lambda: result.update(bench_serve(
            cluster, small_model, tmp_path / "load.json", "--num-requests", "64", "--input-len", "256",
            "--output-len", "64", "--rate", "16")))
        load.start()

        def serving() -> bool:
            text = httpx.get(cluster.url + "/metrics", timeout=10).text
            return "pdc_requests_total" in text and 'status="ok"' in text
        wait_until(serving, 120, "the first requests to finish")
        httpx.post(f"{cluster.url}/admin/nodes/{decode[0]}/drain", headers=headers, timeout=10).raise_for_status()
        load.join(600)
        assert not load.is_alive()
        run = result["results"][0]
        assert run["failed"] == 0 and run["completed"] == 64, run["errors"]
        assert cluster.proc is not None and cluster.proc.poll() is None  # the launcher still serves
    finally:
        assert cluster.stop() == 0, cluster.log_tail()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU per node needs a machine with 2+ GPUs")
def test_two_gpus_get_one_node_each(small_model, tmp_path):
    cluster = start_local(small_model, tmp_path)
    try:
        table = placement_table(cluster.wait_for_line("NODE  ", 60))
        gpus = {line.split()[2] for line in table.splitlines()[1:] if line.split()[1] in ("prefill", "decode")}
        assert len(gpus) == 2, table
        assert served_answers(cluster)
    finally:
        assert cluster.stop() == 0, cluster.log_tail()
