"""Beam search on a GPU (CUDA graphs, overlap scheduling on) against the engine's CPU path, float32,
on the default model's shape with random weights: the same beams in the same order, the same
scores; and every KV slot back in the pool afterwards.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_beam_search_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import BlankTokenizer, model_dir  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENS = [5, 17, 64, 129]


def beam_results(model_dir, device: str) -> dict:
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", max_total_tokens=8192,
                          max_running_requests=32)
    engine = LLMEngine(config, tokenizer=BlankTokenizer())
    free = engine.pool.num_free
    params = SamplingParams(use_beam_search=True, temperature=0.0, beam_width=4, beam_outputs=4, max_tokens=10,
                            early_stopping=True)
    for i, n in enumerate(PROMPT_LENS):
        engine.add_beam_request(f"b{i}", [(13 * j + 7 * i + 1) % 4096 for j in range(n)], params)
    # A greedy request beside them: the batch's own steps go on between the searches' steps.
    engine.add_request("greedy", list(range(1, 40)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    results = {r.request_id: [(b.token_ids, b.score) for b in r.beams] for r in engine.take_beam_results()}
    # Every slot is free again or held by the prefix cache (the greedy request's tokens), none pinned.
    assert engine.pool.num_free + engine.cache.cached_tokens == free
    assert engine.cache.pinned_tokens == 0
    return results


def test_beam_search_on_the_gpu_matches_the_cpu_path(model_dir):  # noqa: F811
    cpu = beam_results(model_dir, "cpu")
    gpu = beam_results(model_dir, "cuda")
    assert set(gpu) == set(cpu) == {f"b{i}" for i in range(len(PROMPT_LENS))}
    for request_id, beams in cpu.items():
        assert [t for t, _ in gpu[request_id]] == [t for t, _ in beams], request_id
        assert [s for _, s in gpu[request_id]] == pytest.approx([s for _, s in beams], abs=1e-3)
