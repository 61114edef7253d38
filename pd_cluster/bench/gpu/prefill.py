"""(b) Prefill: fresh prompts of each length, one a step, against the bf16 matmul rate (MFU)."""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from typing import Any

import torch

from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import sync
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model.config import ModelConfig
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Matmul FLOPs of a fresh n-token prefill: projections, causal attention, one lm_head row."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    attention = cfg.num_layers * 2 * 2 * q * (n * (n + 1) / 2)
    return per_token * n + attention + 2 * h * cfg.vocab_size


def measure_prefill(engine: LLMEngine, plan: Plan, lens: list[int], matmul_tflops: float, gen: torch.Generator) -> dict:
    """One fresh prompt per step (no prefix cache), first token sampled: tokens/s and MFU."""
    out: dict[str, Any] = {}
    for n in lens:
        ms = time_prefill(engine, n, reps=4 if n <= 4096 else 3, gen=gen)
        flops = prefill_flops(engine.model_config, n)
        out[str(n)] = {"ms": ms, "tokens_per_s": n / ms * 1e3, "tflops": flops / ms / 1e9,
                       "mfu": flops / ms / 1e9 / matmul_tflops}
        logger.info("prefill %d: %.2f ms, MFU %.2f", n, ms, out[str(n)]["mfu"])
    return out


def time_prefill(engine: LLMEngine, n: int, reps: int, gen: torch.Generator) -> float:
    """Median milliseconds of an engine step that prefills one fresh ``n``-token prompt; the first
    of ``reps`` only compiles kernels for the new shapes and is not counted."""
    vocab = engine.model_config.vocab_size
    times = []
    for rep in range(reps):
        engine.add_request(f"pre-{uuid.uuid4().hex}", random_prompt(vocab, n, gen),
                           SamplingParams(temperature=0.0, max_tokens=1))
        sync(engine.device)
        start = time.perf_counter()
        updates = engine.step()
        if not updates and engine.pipelined:
            updates = engine.step()  # a pipelined step's token comes out with the next call
        elapsed = (time.perf_counter() - start) * 1e3
        assert len(updates) == 1 and updates[0].first_token, "the prompt must finish in one step"
        if rep:
            times.append(elapsed)
    return statistics.median(times)
