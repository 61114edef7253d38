"""(i) Beam search: one step of a width-4 search (its four live beams run as rows of one forward,
their continuations ranked and the next beams kept and forked on the device, the few chosen read
back a step later where the engine pipelines) against a greedy step of four independent rows at
the same context, on the same engine, each timed as the engine runs it."""

from __future__ import annotations

import logging
import statistics
import time
import uuid

import torch

from pd_cluster.bench.gpu.decode import start_decoding, time_decode_steps
from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import sync
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WIDTH = 4


def measure_beam(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """Median of ``plan.beam_steps`` steady beam steps (after ``plan.beam_skip_steps``: the prompt
    and the first forks) over the greedy step of :data:`WIDTH` rows at the beam's context."""
    greedy = time_greedy(engine, plan, gen)
    beam = time_beam_steps(engine, plan, gen)
    result = {"width": WIDTH, "context": plan.beam_ctx, "steps": plan.beam_steps, "pipelined": engine.pipelined,
              "beam_step_ms": beam["step_ms"], "beam_step_ms_min": beam["step_ms_min"],
              "greedy_step_ms": greedy["step_ms"], "greedy_mean_ctx": greedy["mean_ctx_sum"] / WIDTH,
              "beam_mean_ctx": beam["mean_ctx"], "ratio": beam["step_ms"] / greedy["step_ms"]}
    logger.info("beam search width %d: %.3f ms/step vs greedy %d rows %.3f ms (%.3fx)", WIDTH, beam["step_ms"],
                WIDTH, greedy["step_ms"], result["ratio"])
    return result


def time_greedy(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """Greedy steps of :data:`WIDTH` fresh rows of ``beam_ctx`` tokens, as the engine serves them."""
    reqs = start_decoding(engine, WIDTH, plan.beam_ctx, gen)
    try:
        for _ in range(plan.beam_skip_steps):
            engine.step()
        return time_decode_steps(engine, reqs, plan.beam_steps)
    finally:
        for r in reqs:
            engine.abort(r.request_id)


def time_beam_steps(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """Engine steps while one beam search (and nothing else) runs. Pipelined (as the greedy steps
    are), a call launches the next step before it reads the last one back, so the steps are timed
    back to back, their mean (a sync between them would stop the pipeline); otherwise each call
    is one whole step, its chosen continuations read back before it returns."""
    params = SamplingParams(use_beam_search=True, beam_width=WIDTH, beam_outputs=WIDTH, temperature=0.0,
                            max_tokens=plan.beam_skip_steps + plan.beam_steps + 2, ignore_eos=True)
    request_id = f"beam-{uuid.uuid4().hex}"
    group = engine.add_beam_request(request_id, random_prompt(engine.model_config.vocab_size, plan.beam_ctx, gen),
                                    params)
    times, contexts = [], []

    def context() -> float:
        if len(group.rows) != WIDTH:
            raise RuntimeError(f"{len(group.rows)} live beams, expected {WIDTH}")
        return statistics.mean(r.num_computed + 1 for r in group.rows)

    try:
        for _ in range(plan.beam_skip_steps):
            engine.step()
        if engine.pipelined:
            sync(engine.device)
            start = time.perf_counter()
            for _ in range(plan.beam_steps):
                contexts.append(context())
                engine.step()
            sync(engine.device)
            times.append((time.perf_counter() - start) * 1e3 / plan.beam_steps)
        else:
            for _ in range(plan.beam_steps):
                contexts.append(context())
                sync(engine.device)
                start = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        engine.abort(request_id)
        while engine.beams.has_work():  # the step left in flight
            engine.step()
        engine.take_beam_results()
    return {"step_ms": statistics.median(times), "step_ms_min": min(times), "mean_ctx": statistics.mean(contexts)}
