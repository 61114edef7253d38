"""JSON-schema masks in the decode step: the key batch's whole step with a grammar on every row
over the same step without (``json_schema_overhead_b64``)."""

from __future__ import annotations

import logging

import torch

from pd_cluster.bench.gpu.decode import time_fresh_decode
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.config import EngineConfig
from pd_cluster.default_model import default_model_path
from pd_cluster.engine.grammar import Grammars
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams, StructuredOutput
from pd_cluster.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

#: A schema a timed run cannot complete (200 rows before the array may close), so every row keeps
#: its grammar for every step: objects, bounded strings, integers, booleans.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "minItems": 200, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["rows"],
    "additionalProperties": False,
}


def grammar_engine(engine: LLMEngine, plan: Plan) -> LLMEngine:
    """The engine to measure: the run's own (random weights, a blank tokenizer), its grammars given
    the default model's tokenizer padded to its vocabulary (real token strings for the masks to
    walk); a vocabulary smaller than that tokenizer's (a quick run's tiny model) cannot hold the
    grammar's tokens, so the default model itself is measured instead."""
    tokenizer = load_tokenizer(default_model_path())
    if engine.model_config.vocab_size < len(tokenizer):
        return LLMEngine(EngineConfig(model=str(default_model_path()), device=str(engine.device),
                                      max_running_requests=plan.key_batch, enable_prefix_cache=False,
                                      max_total_tokens=plan.key_batch * (plan.decode_ctx + 256)))
    engine.grammars = Grammars(tokenizer, engine.model_config.vocab_size, {int(tokenizer.eos_token_id)})
    return engine


def measure_json_schema_overhead(engine: LLMEngine, plan: Plan, gen: torch.Generator) -> dict:
    """Median step of ``plan.key_batch`` greedy requests with :data:`BENCH_SCHEMA` on every row,
    over the same step without a grammar, timed back to back on the same engine."""
    engine = grammar_engine(engine, plan)

    def under_grammar(reqs: list) -> None:
        assert all(r.grammar is not None and not r.grammar.terminated for r in reqs)

    plain = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    masked = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                            structured=StructuredOutput.from_schema(BENCH_SCHEMA))
    plain_ms = time_fresh_decode(engine, plan, gen, plain)["step_ms"]
    masked_ms = time_fresh_decode(engine, plan, gen, masked, check=under_grammar)["step_ms"]
    result = {"batch": plan.key_batch, "model": engine.model_config.name, "schema": BENCH_SCHEMA, "plain_step_ms": plain_ms,
              "json_schema_step_ms": masked_ms, "overhead": masked_ms / plain_ms}
    logger.info("json_schema b%d: %.3f ms/step vs %.3f ms without (%.3fx)", plan.key_batch, masked_ms, plain_ms,
                result["overhead"])
    return result
