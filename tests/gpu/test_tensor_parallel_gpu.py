"""Tensor parallelism on two GPUs (NCCL all-reduces, Triton kernels over head views): TP 2 gives
a TP 1 engine's greedy tokens in float32, and rank 0's pool holds every head as TP 1's does.

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


@pytest.fixture(scope="module")
def kv4_model(tmp_path_factory):
    # PD_GPU_TOKENIZER: a tokenizer directory, for a machine without the default model's package.
    tokenizer = Path(os.environ["PD_GPU_TOKENIZER"]) if os.environ.get("PD_GPU_TOKENIZER") else None
    return write_random_model("tiny-kv4", tmp_path_factory.mktemp("kv4"), tokenizer, dtype="float32", device="cuda")


def _run(model, tp: int) -> tuple[list[list[int]], torch.Tensor]:
    # Eager at both sizes (a TP step runs eager): with CUDA graphs TP 1 would take one slot out
    # of service for the graphs' padding rows, and its pool would not line up with TP 2's.
    llm = LLM(model=str(model), device="cuda:0", dtype="float32", tp=tp, max_total_tokens=4096,
              max_num_batched_tokens=64, cuda_graphs=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        return [list(o.token_ids) for o in outs], llm.engine.pool.k_cache.float().cpu()
    finally:
        llm.close()


def test_tp2_on_two_gpus_equals_tp1(kv4_model):
    tokens1, k1 = _run(kv4_model, 1)
    tokens2, k2 = _run(kv4_model, 2)
    assert tokens2 == tokens1
    torch.testing.assert_close(k2, k1, rtol=1e-3, atol=1e-4)
