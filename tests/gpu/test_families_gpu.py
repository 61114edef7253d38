"""Qwen3, Qwen3-MoE, Mixtral and Llama 3.1 checkpoints on the GPU: float32 greedy tokens equal the
CPU path's (every family with CUDA graphs, MoE through the fused experts), batches of many decode rows included.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_families_gpu.py -s
"""

from __future__ import annotations

import uuid

import pytest
import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams
from tests.family_models import FAMILIES, write_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: 24 prompts: decode batches well past the fused few-row path, prefills of several lengths.
PROMPT_LENS = [3, 17, 64, 150] * 6


def _generate(model_dir, device: str) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", max_total_tokens=8192,
                          max_running_requests=32, max_model_len=512)
    eng = LLMEngine(config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reqs = [eng.add_request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs], eng


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_greedy_on_gpu_equals_the_cpu_path(family, tmp_path, tokenizer_dir):
    write_family_model(family, tmp_path, tokenizer_dir, embed_scale=4.0)
    cpu, _ = _generate(tmp_path, "cpu")
    gpu, eng = _generate(tmp_path, "cuda")
    assert eng.runner.graphs is not None  # MoE steps replay graphs too (the fused experts read nothing on the host)
    assert gpu == cpu
