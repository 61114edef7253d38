"""The one-shot all-reduce on two GPUs: the sums equal NCCL's, also replayed from a CUDA graph,
large messages stay on NCCL, and a TP 2 engine gives the same tokens with either.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tp_allreduce_gpu.py -s
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pd_cluster import LLM, SamplingParams
from pd_cluster.bench.random_model import TOKENIZER_FILES, shape_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _rank(rank: int, port: int, conn) -> None:
    from pd_cluster.engine.tp_group import TPGroup

    try:
        device = torch.device(f"cuda:{rank}")
        store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=dt.timedelta(seconds=60))
        group = TPGroup(store, rank, 2, device, all_reduce_mode="oneshot")
        gen = torch.Generator(device=device).manual_seed(rank)
        checks = {}
        for rows in (1, 3, 64):
            x = torch.randn((rows, 4096), generator=gen, device=device).to(torch.bfloat16)
            ours, nccl = x.clone(), x.clone()
            assert group.one_shot.takes(ours)
            group.all_reduce(ours)
            group.group_all_reduce(nccl)
            checks[f"rows{rows}"] = bool(torch.equal(ours, nccl))
        big = torch.ones((1024, 4096), dtype=torch.bfloat16, device=device)
        checks["large_on_nccl"] = not group.one_shot.takes(big)
        static = torch.full((1, 4096), float(rank + 1), dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            group.all_reduce(static.clone())
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            group.all_reduce(static)
        for value in (1.0, 5.0):
            static.fill_(value * (rank + 1))
            graph.replay()
            torch.cuda.synchronize(device)
            checks[f"graph{value}"] = bool((static == value * 3).all())
        conn.send(checks)
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def test_one_shot_sums_equal_nccls_and_replay_in_a_graph():
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, store.port, pipes[r][1]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = []
        for parent, _ in pipes:
            assert parent.poll(180), "a rank did not report"
            results.append(parent.recv())
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for checks in results:
        assert "error" not in checks, checks
        assert all(checks.values()), checks


@pytest.fixture(scope="module")
def kv4_dir(tmp_path_factory):
    # PD_GPU_TOKENIZER: a tokenizer directory, for a machine without the default model's package.
    from pd_cluster.default_model import default_model_path

    tokenizer = Path(os.environ["PD_GPU_TOKENIZER"]) if os.environ.get("PD_GPU_TOKENIZER") else default_model_path()
    out = tmp_path_factory.mktemp("kv4-dummy")
    (out / "config.json").write_text(json.dumps(shape_config("tiny-kv4")))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


def _engine_tokens(model_dir: str, mode: str, prompts: list[list[int]], conn) -> None:
    """A TP 2 engine of its own process (a process sets up one one-shot): its greedy tokens."""
    llm = LLM(model=model_dir, device="cuda:0", dtype="float32", tp=2, max_total_tokens=4096,
              load_format="dummy", tp_allreduce=mode)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        conn.send([list(o.token_ids) for o in outs])
    finally:
        llm.close()


def test_tp2_engine_tokens_are_the_same_with_the_one_shot_and_with_nccl(kv4_dir):
    prompts = [[5, 17, 300, 42, 9], list(range(100, 400))]
    tokens = {}
    ctx = mp.get_context("spawn")
    for mode in ("oneshot", "nccl"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_tokens, args=(str(kv4_dir), mode, prompts, child))
        proc.start()
        assert parent.poll(300), f"the {mode} engine gave no tokens within 300 s"
        tokens[mode] = parent.recv()
        proc.join(60)
        assert proc.exitcode == 0, f"the {mode} engine's process exited with {proc.exitcode}"
    assert tokens["oneshot"] == tokens["nccl"]
