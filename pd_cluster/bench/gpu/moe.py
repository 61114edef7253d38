"""(k) Mixture of experts: the Qwen3-30B-A3B shape on random weights, its decode step at the key
batch with CUDA graphs against the floor of the bytes that step reads (the experts its batch
routes to, not all of them), and a fresh long prompt's prefill against the bf16 matmul rate
counting only the active parameters. The torch reference's eager step (one GEMM an expert, counts
read on the host) is timed beside them."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from pd_cluster.bench.gpu.decode import start_decoding, time_decode_steps, time_graph_replay
from pd_cluster.bench.gpu.models import build_engine
from pd_cluster.bench.gpu.plan import CONFIGS, Plan
from pd_cluster.bench.gpu.prefill import time_prefill
from pd_cluster.bench.gpu.timing import empty_cache
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model import moe as moe_module
from pd_cluster.model.config import ModelConfig

logger = logging.getLogger(__name__)


def moe_config_file(plan: Plan) -> Path:
    return CONFIGS / ("tiny-moe.json" if plan.quick else "qwen3-30b-a3b.json")


def moe_prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Matmul FLOPs of a fresh n-token prefill over the active parameters: attention projections,
    router, each token's ``top_k`` experts (dense MLPs in dense layers), causal attention, one
    lm_head row."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 0
    for layer in range(cfg.num_layers):
        per_token += 2 * (h * (q + 2 * kv) + q * h)
        if cfg.is_sparse(layer):
            per_token += 2 * (h * cfg.moe.num_experts + 3 * h * cfg.moe.intermediate_size * cfg.moe.top_k)
        else:
            per_token += 2 * 3 * h * cfg.intermediate_size
    attention = cfg.num_layers * 2 * 2 * q * (n * (n + 1) / 2)
    return per_token * n + attention + 2 * h * cfg.vocab_size


def expert_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(bytes of all the experts' projections, bytes of one expert's), over the sparse layers."""
    total, one = 0, 0
    for layer in engine.model.weights.layers:
        if layer.experts is None:
            continue
        tensors = [t for w in (layer.experts.gate_up, layer.experts.down)
                   for t in (w.tensors() if hasattr(w, "tensors") else [w])]
        size = sum(t.numel() * t.element_size() for t in tensors)
        total += size
        one = size // layer.experts.router.shape[0]
    return total, one


@contextmanager
def recorded_routes() -> Iterator[list[torch.Tensor]]:
    """Each sparse layer's picks ``[T, top_k]`` of the eager forwards run inside."""
    seen: list[torch.Tensor] = []
    real = moe_module.route

    def route(*args: Any, **kwargs: Any):
        experts, weights = real(*args, **kwargs)
        seen.append(experts.detach().clone())
        return experts, weights

    with mock.patch.object(moe_module, "route", route):
        yield seen


@contextmanager
def graphs_aside(engine: LLMEngine) -> Iterator[None]:
    """Steps inside run eagerly (each layer's Python runs); the graphs come back after."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None
    try:
        yield
    finally:
        engine.runner.graphs = graphs


def measure_moe_decode(engine: LLMEngine, batch: int, context: int, steps: int, copy_tb_per_s: float,
                       gen: torch.Generator) -> dict:
    """The decode step at ``batch`` rows of ``context`` tokens: whole engine steps (graphs), the
    graph replayed alone, the floor of the bytes read (distinct experts each layer's router picked,
    counted over eager steps of the same batch), and the torch reference's eager step."""
    reqs = start_decoding(engine, batch, context, gen)
    for _ in range(3):
        engine.step()
    row = time_decode_steps(engine, reqs, steps)
    all_experts, per_expert = expert_bytes(engine)
    layers = sum(1 for layer in engine.model.weights.layers if layer.experts is not None)
    with recorded_routes() as seen, graphs_aside(engine):
        for _ in range(2):
            engine.step()
    decode_picks = [p for p in seen if p.shape[0] == batch]
    distinct = [int(p.unique().numel()) for p in decode_picks]
    per_layer = statistics.mean(distinct) if distinct else float("nan")
    routed = per_layer * layers * per_expert
    kv_bytes = row.pop("mean_ctx_sum") * engine.kv_spec.bytes_per_token
    dense = engine.model.weights.decode_bytes() - all_experts
    floor_ms = (dense + routed + kv_bytes) / copy_tb_per_s / 1e9
    row.update(dense_bytes=dense, routed_expert_bytes=routed, all_expert_bytes=all_experts, kv_bytes=kv_bytes,
               distinct_experts_per_layer=per_layer, floor_ms=floor_ms, floor_ratio=row["step_ms"] / floor_ms)
    if engine.runner.graphs is not None:
        row.update(time_graph_replay(engine, batch, floor_ms))
    row["eager_step_ms"] = _eager_step_ms(engine, reqs, steps)
    with mock.patch.object(moe_module, "fused_available", lambda x: False):
        row["reference_eager_step_ms"] = _eager_step_ms(engine, reqs, 3)
    row["reference_vs_graphs"] = row["reference_eager_step_ms"] / row["step_ms"]
    for r in reqs:
        engine.abort(r.request_id)
    logger.info("moe decode b%d: %.3f ms/step, floor %.3f ms (%.2fx), %.1f experts a layer; reference eager %.1f ms",
                batch, row["step_ms"], floor_ms, row["floor_ratio"], per_layer, row["reference_eager_step_ms"])
    return row


def _eager_step_ms(engine: LLMEngine, reqs: list, steps: int) -> float:
    with graphs_aside(engine):
        engine.step()
        return time_decode_steps(engine, reqs, steps)["step_ms"]


def measure_moe(plan: Plan, device: torch.device, copy_tb_per_s: float, matmul_tflops: float,
                gen: torch.Generator) -> dict:
    """The MoE keys' figures on one engine of the MoE shape (freed after)."""
    config_file = moe_config_file(plan)
    engine = build_engine(config_file, str(device), max_total_tokens=plan.key_batch * (plan.decode_ctx + 256) + 8192,
                          max_model_len=plan.key_len + 256, max_running_requests=plan.key_batch,
                          max_num_batched_tokens=plan.key_len, enable_prefix_cache=False,
                          cuda_graph_batch_sizes=[1, plan.key_batch], mixed_graph_tokens=[],
                          overlap_schedule=plan.overlap_schedule)
    try:
        cfg = engine.model_config
        out: dict[str, Any] = {"model": config_file.stem, "graphs": engine.runner.graphs is not None,
                               "weight_bytes": engine.model.weights.decode_bytes()}
        out["decode"] = {f"b{plan.key_batch}": measure_moe_decode(engine, plan.key_batch, plan.decode_ctx,
                                                                  plan.decode_steps, copy_tb_per_s, gen)}
        ms = time_prefill(engine, plan.key_len, reps=4, gen=gen)
        flops = moe_prefill_flops(cfg, plan.key_len)
        out["prefill"] = {str(plan.key_len): {"ms": ms, "tokens_per_s": plan.key_len / ms * 1e3,
                                              "tflops": flops / ms / 1e9, "mfu": flops / ms / 1e9 / matmul_tflops}}
        logger.info("moe prefill %d: %.2f ms, MFU %.2f", plan.key_len, ms, out["prefill"][str(plan.key_len)]["mfu"])
        return out
    finally:
        engine.close()
        del engine
        empty_cache()
