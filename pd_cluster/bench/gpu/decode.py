"""(a) Decode: whole engine steps at each batch size against the floor, (weight bytes + KV bytes
read) / device copy bandwidth; also the CUDA graph replayed alone, and eager steps."""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import cuda_ms, sync
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


#: Steps run before timing the first batch, right after its prefill: the first steps after a
#: prefill of 64 x 1k tokens run slower than the ones after them (one H200, 8B shape, pipelined
#: steps: fp8 weights 5.5-6.1 ms for the first eight against 5.25 from the tenth on, bf16 7.3
#: against 7.05), a transient of the prefill's burst, not a decode step's cost. Later batches
#: follow decode steps and take :data:`WARM_STEPS`.
WARM_STEPS_AFTER_PREFILL = 12
WARM_STEPS = 3

#: The sampled configuration of ``sampling_overhead``: what chat clients commonly send.
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "frequency_penalty": 0.5}


def measure_decode(engine: LLMEngine, plan: Plan, copy_tb_per_s: float, gen: torch.Generator,
                   eager_batches: tuple[int, ...] = (), kv_bytes_per_token: int | None = None,
                   sampling: bool = True, graph_replay: bool = True) -> dict:
    """Decode steps of the whole engine (schedule, graph replay, sampling), largest batch first;
    requests are aborted down to the next batch size, so contexts stay near ``decode_ctx``.
    ``kv_bytes_per_token``: the KV a step reads a token (default: the engine's spec; a
    tensor-parallel rank reads only its heads'). ``sampling``: also the sampled-step overhead.
    ``graph_replay``: also the graph replayed alone (not on a tensor-parallel engine, whose
    other ranks replay only the steps rank 0 plans)."""
    batches = sorted(plan.decode_batches, reverse=True)
    reqs = start_decoding(engine, batches[0], plan.decode_ctx, gen)
    w_bytes = weight_bytes(engine)
    out: dict[str, Any] = {"weight_bytes": w_bytes, "context": plan.decode_ctx, "steps": plan.decode_steps}
    for i, batch in enumerate(batches):
        for r in reqs[batch:]:
            engine.abort(r.request_id)
        reqs = reqs[:batch]
        for _ in range(WARM_STEPS_AFTER_PREFILL if i == 0 else WARM_STEPS):
            engine.step()
        row = time_decode_steps(engine, reqs, plan.decode_steps)
        kv_bytes = row.pop("mean_ctx_sum") * (kv_bytes_per_token or engine.kv_spec.bytes_per_token)
        floor_ms = (w_bytes + kv_bytes) / copy_tb_per_s / 1e9
        row.update(kv_bytes=kv_bytes, floor_ms=floor_ms, floor_ratio=row["step_ms"] / floor_ms,
                   tokens_per_s=batch / row["step_ms"] * 1e3)
        if graph_replay and engine.runner.graphs is not None:
            row.update(time_graph_replay(engine, batch, floor_ms))
            if batch in eager_batches:
                row["eager_step_ms"] = time_eager_steps(engine, reqs, plan.decode_steps)
        out[f"b{batch}"] = row
        logger.info("decode b%d: %.3f ms/step, floor %.3f ms (%.2fx)", batch, row["step_ms"], floor_ms,
                    row["floor_ratio"])
    for r in reqs:
        engine.abort(r.request_id)
    if sampling and f"b{plan.key_batch}" in out:
        out["sampling"] = measure_sampling_overhead(engine, plan, gen)
    return out


def measure_sampling_overhead(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """The key batch's whole step with :data:`SAMPLED` sampling, over the greedy step: both sides
    start fresh requests of the same prompt length and time the same steps, so they read the same
    KV lengths (the decode rows' contexts have grown by the larger batches' steps)."""
    greedy = time_fresh_decode(engine, plan, gen, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    sampled = time_fresh_decode(engine, plan, gen, SamplingParams(max_tokens=200, ignore_eos=True, seed=7, **SAMPLED))
    result = {"batch": plan.key_batch, "params": SAMPLED, "sampled_step_ms": sampled["step_ms"],
              "greedy_step_ms": greedy["step_ms"], "overhead": sampled["step_ms"] / greedy["step_ms"],
              "greedy_mean_ctx_sum": greedy["mean_ctx_sum"], "sampled_mean_ctx_sum": sampled["mean_ctx_sum"]}
    logger.info("sampling b%d: %.3f ms/step vs greedy %.3f ms (%.3fx)", plan.key_batch, sampled["step_ms"],
                greedy["step_ms"], result["overhead"])
    return result


def time_fresh_decode(engine: LLMEngine, plan: Plan, gen: torch.Generator, params: SamplingParams,
                      check: Callable[[list], None] | None = None) -> dict:
    """:func:`time_decode_steps` of ``plan.key_batch`` new requests of ``plan.decode_ctx`` tokens
    under ``params``, after 3 untimed steps; ``check`` sees the requests after the timed steps.
    Two calls on one engine time steps at the same contexts."""
    reqs = start_decoding(engine, plan.key_batch, plan.decode_ctx, gen, params)
    try:
        for _ in range(3):
            engine.step()
        row = time_decode_steps(engine, reqs, plan.decode_steps)
        if check is not None:
            check(reqs)
        return row
    finally:
        for r in reqs:
            engine.abort(r.request_id)


def start_decoding(engine: LLMEngine, batch: int, context: int, gen: torch.Generator,
                   params: SamplingParams | None = None) -> list:
    """``batch`` requests of ``context`` random tokens, stepped until every one has its first token."""
    vocab = engine.model_config.vocab_size
    # Enough tokens for every timed step; more would make admission wait for KV that is never used.
    params = params or SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    reqs = [engine.add_request(f"dec-{uuid.uuid4().hex}", random_prompt(vocab, context, gen), params)
            for _ in range(batch)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    return reqs


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads from the weights (see ``ModelWeights.decode_bytes``)."""
    return engine.model.weights.decode_bytes()


def time_decode_steps(engine: LLMEngine, reqs: list, steps: int) -> dict:
    """Median step time (pipelined steps: their mean, timed back to back), and where a step's
    host time goes: scheduling, the runner (inputs, launch or graph replay; the GPU runs on)
    and the rest (sampling waits for the GPU, then the tokens are accepted)."""
    times, ctx_sums = [], []
    spent = {"schedule": [], "run": []}

    def timed(fn: Callable, key: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key].append((time.perf_counter() - start) * 1e3)

        return wrapper

    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule")  # type: ignore[method-assign]
    engine.runner.run = timed(engine.runner.run, "run")  # type: ignore[method-assign]
    try:
        if engine.pipelined:
            # Pipelined steps: a call returns before its step is done, so the steps are timed
            # back to back (a sync between them would stop the pipeline).
            sync(engine.device)
            start = time.perf_counter()
            for _ in range(steps):
                ctx_sums.append(sum(r.num_computed + 1 for r in reqs))
                updates = engine.step()
                assert len(updates) == len(reqs), f"{len(updates)} tokens for {len(reqs)} requests"
            sync(engine.device)
            times.append((time.perf_counter() - start) * 1e3 / steps)
        else:
            for _ in range(steps):
                ctx_sums.append(sum(r.num_computed + 1 for r in reqs))
                sync(engine.device)
                start = time.perf_counter()
                updates = engine.step()  # sampling reads the tokens back: the step is complete
                times.append((time.perf_counter() - start) * 1e3)
                assert len(updates) == len(reqs), f"{len(updates)} tokens for {len(reqs)} requests"
    finally:
        del engine.scheduler.schedule, engine.runner.run
    return {"step_ms": statistics.median(times), "step_ms_min": min(times),
            "host_schedule_ms": statistics.median(spent["schedule"]), "host_runner_ms": statistics.median(spent["run"]),
            "mean_ctx_sum": statistics.mean(ctx_sums)}


def time_graph_replay(engine: LLMEngine, batch: int, floor_ms: float) -> dict:
    """The captured CUDA graph for ``batch`` replayed alone: the GPU's share of a step."""
    graphs = engine.runner.graphs
    size = graphs.graph_size(batch)
    replay_ms = cuda_ms(lambda: graphs.run_graph(size), engine.device)
    return {"graph_size": size, "graph_replay_ms": replay_ms, "graph_floor_ratio": replay_ms / floor_ms}


def time_eager_steps(engine: LLMEngine, reqs: list, steps: int) -> float:
    """Median step milliseconds with CUDA graphs off (restored after)."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None
    try:
        for _ in range(2):
            engine.step()
        return time_decode_steps(engine, reqs, steps)["step_ms"]
    finally:
        engine.runner.graphs = graphs
