"""(f) What a prefill on the decode node costs its running streams: the step of a decoding batch
with a prefill chunk of m tokens in it, against the same batch's plain decode step. This is the
price of routing a short miss to D (``local_prefill_max_tokens``): every running stream's next
token waits for the chunk once; the P -> D path instead costs the request itself P's queue, the
handover and D's commit."""

from __future__ import annotations

import logging
import statistics
import time
import uuid

import torch

from pd_cluster.bench.gpu.decode import start_decoding
from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import sync
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Batches of running streams and chunk sizes measured.
BATCHES = (8, 32)
CHUNKS = (64, 128, 256, 512, 1024, 2048)
REPEATS = 5


def _step_ms(engine: LLMEngine) -> float:
    sync(engine.device)
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e3


def measure_local_prefill(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """For each batch: the plain decode step, and the step carrying a chunk of m prompt tokens
    (one new request, its prefill whole in the step; aborted after its first token)."""
    vocab = engine.model_config.vocab_size
    out: dict = {"context": plan.decode_ctx, "repeats": REPEATS}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for batch in BATCHES:
        reqs = start_decoding(engine, batch, plan.decode_ctx, gen)
        try:
            for _ in range(3):
                engine.step()
            plain = statistics.median(_step_ms(engine) for _ in range(10))
            row: dict = {"decode_step_ms": plain}
            for m in CHUNKS:
                if m > engine.config.max_num_batched_tokens - batch:
                    continue
                times = []
                for _ in range(REPEATS):
                    rid = f"local-{uuid.uuid4().hex}"
                    engine.add_request(rid, random_prompt(vocab, m, gen), params)
                    times.append(_step_ms(engine))
                    engine.abort(rid)
                with_chunk = statistics.median(times)
                row[str(m)] = {"step_ms": with_chunk, "added_ms": with_chunk - plain,
                               "added_steps": (with_chunk - plain) / plain}
                logger.info("local prefill b%d + %d tokens: %.2f ms (decode step %.2f ms)", batch, m, with_chunk, plain)
            out[f"b{batch}"] = row
        finally:
            for r in reqs:
                engine.abort(r.request_id)
    return out
