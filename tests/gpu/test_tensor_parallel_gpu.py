"""Tensor parallelism on two GPUs (NCCL all-reduces, Triton kernels on each rank's own KV heads):
TP 2 gives a TP 1 engine's greedy tokens in float32, eagerly and replaying CUDA graphs with the
overlap schedule (every rank replays the graph rank 0 plans, its all-reduces captured inside), and
the KV a handover reads (every head, gathered from the ranks) is TP 1's.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -s
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.bench.random_model import write_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

PROMPTS = [[5, 17, 300, 42, 9], [7] * 3, list(range(100, 400)), [5, 17, 300, 42, 9, 11, 12]]
#: Few graph shapes (decode batches up to 8, mixed chunks of 32 and 128 tokens): quick captures,
#: and the 300-token prompt takes 128-token chunks replayed as mixed graphs.
GRAPHS = {"max_running_requests": 8, "max_num_batched_tokens": 256, "mixed_graph_tokens": [32, 128]}


@pytest.fixture(scope="module")
def kv4_model(tmp_path_factory):
    # PD_GPU_TOKENIZER: a tokenizer directory, for a machine without the default model's package.
    tokenizer = Path(os.environ["PD_GPU_TOKENIZER"]) if os.environ.get("PD_GPU_TOKENIZER") else None
    return write_random_model("tiny-kv4", tmp_path_factory.mktemp("kv4"), tokenizer, dtype="float32", device="cuda")


def _eager(model, tp: int) -> tuple[list[list[int]], torch.Tensor]:
    # Eager at both sizes: with CUDA graphs TP 1 would take one slot out of service for the
    # graphs' padding rows, and the pools would not line up slot for slot.
    llm = LLM(model=str(model), device="cuda:0", dtype="float32", tp=tp, max_total_tokens=4096,
              max_num_batched_tokens=64, cuda_graphs=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        engine = llm.engine
        with torch.cuda.device(engine.device):
            kv = engine.node_kv.gather(torch.arange(engine.pool.capacity, device=engine.device))
        return [list(o.token_ids) for o in outs], kv.float().cpu()
    finally:
        llm.close()


def test_tp2_on_two_gpus_equals_tp1(kv4_model):
    tokens1, kv1 = _eager(kv4_model, 1)
    tokens2, kv2 = _eager(kv4_model, 2)
    assert tokens2 == tokens1
    torch.testing.assert_close(kv2, kv1, rtol=1e-3, atol=1e-4)


def _graphs(model, tp: int, prompts, **options) -> list[list[int]]:
    llm = LLM(model=str(model), device="cuda:0", dtype="float32", tp=tp, max_total_tokens=8192, **GRAPHS, **options)
    try:
        engine = llm.engine
        assert engine.runner.graphs is not None and engine.pipelined
        if "kv_cache_dtype" in options:  # rank 0's pool stores the quantized rows (as bytes)
            assert engine.kv_spec.kv_dtype == options["kv_cache_dtype"] and engine.pool.k_cache.dtype == torch.uint8
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        return [list(o.token_ids) for o in outs]
    finally:
        llm.close()


@pytest.mark.parametrize("which", ["model_8b", "small_model"])
def test_tp2_replaying_cuda_graphs_equals_tp1(request, which):
    # The 8B shape (8 KV heads, four a rank) and the default model's (3 KV heads: two and one).
    model = request.getfixturevalue(which)
    assert _graphs(model, 2, PROMPTS) == _graphs(model, 1, PROMPTS)


#: Least share of TP 1's greedy tokens TP 2 keeps at the same places with quantized KV. A rank's
#: slice of the qkv projection can round its last bit unlike the whole one, and a code at a
#: rounding boundary then moves by a step, and a random model's near-ties can flip on that (on an
#: H200 pair: 63 or 64 of 64 in each run), where unquantized rows give TP 1's tokens exactly.
QUANT_KV_AGREEMENT = 0.9


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_tp2_with_quantized_kv_replaying_cuda_graphs_keeps_tp1s_tokens(small_model, kv_cache_dtype):
    # Each rank's pool stores its own heads' rows quantized by the Triton kernels, read in the
    # graphs' attention: the default model's 3 KV heads as two and one.
    want = _graphs(small_model, 1, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    got = _graphs(small_model, 2, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    total = sum(len(w) for w in want)
    print(f"--kv-cache-dtype {kv_cache_dtype}: TP 2 gives {same}/{total} of TP 1's greedy tokens")
    assert [g[0] for g in got] == [w[0] for w in want] and same / total >= QUANT_KV_AGREEMENT
