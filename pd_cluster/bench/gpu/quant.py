"""(h) Quantized weights and KV on the big shape: decode steps with fp8 weights and with fp8 KV
over the bf16 engine's at the same batches and contexts, an fp8 prefill against the measured
FP8 matmul rate, and the KV bytes a handover moves to a D storing fp8 over one storing bf16.

One engine a variant (bf16; fp8 weights; fp8 KV with bf16 weights), each built, measured and
freed before the next, so that memory holds one big engine at a time (and, for the bytes, P's
and a D of the same shape). Where the device has no FP8 products (a CPU), int8 weights stand in
for fp8 and the prefill is divided by the bf16 matmul rate: the part says so in its results.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch

from pd_cluster.bench.gpu.decode import measure_decode
from pd_cluster.bench.gpu.models import build_engine, random_prompt
from pd_cluster.bench.gpu.pd_pair import pd_pair
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.prefill import measure_prefill
from pd_cluster.bench.gpu.timing import empty_cache
from pd_cluster.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

#: The quantized KV the keys measure.
KV_DTYPE = "fp8_e4m3"
#: Prompt tokens each decode row reserves beyond its context (start_decoding's max_tokens and some).
_ROW_MARGIN = 256


def weight_quantization(device: torch.device) -> str:
    """fp8 where the device multiplies FP8 (compute capability 8.9 and later), else int8, the
    8-bit weights the reference path runs anywhere."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "fp8"
    return "int8"


def quant_info(device: torch.device) -> dict:
    """What the part measures on ``device``: written before its variants run."""
    method = weight_quantization(device)
    info: dict[str, Any] = {"weight_quantization": method, "kv_cache_dtype": KV_DTYPE}
    if method != "fp8":
        info["note"] = f"no FP8 products on {device.type}: int8 weights stand in for fp8 weights"
    return info


@contextlib.contextmanager
def quant_engine(plan: Plan, device: torch.device, **options: Any) -> Iterator[LLMEngine]:
    """The big shape with room for the key batch at the KV-heavy context, CUDA graphs as a node
    captures them; freed on exit."""
    ctx = max(plan.decode_ctx, plan.kv_heavy_ctx)
    engine = build_engine(plan.big_config, str(device), max_total_tokens=plan.key_batch * (ctx + _ROW_MARGIN),
                          max_model_len=plan.max_model_len, max_running_requests=plan.key_batch,
                          max_num_batched_tokens=2 * plan.key_len, enable_prefix_cache=False,
                          block_size=plan.block_size, overlap_schedule=plan.overlap_schedule, **options)
    try:
        yield engine
    finally:
        engine.close()
        del engine
        empty_cache()


def decode_plan(plan: Plan, batches: list[int], context: int) -> Plan:
    """``plan`` with decode steps at ``batches`` and ``context`` instead of its sweep."""
    sub = copy.copy(plan)
    sub.decode_batches, sub.decode_ctx = batches, context
    return sub


def weights_decode(engine: LLMEngine, plan: Plan, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """Decode steps at batch 1 and the key batch at the sweep's context (the weight-bound steps)."""
    sub = decode_plan(plan, [1, plan.key_batch], plan.decode_ctx)
    return measure_decode(engine, sub, copy_tb_per_s, gen, sampling=False)


def kv_heavy_decode(engine: LLMEngine, plan: Plan, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """Decode steps of the key batch at the long context (the KV-bound step)."""
    sub = decode_plan(plan, [plan.key_batch], plan.kv_heavy_ctx)
    return measure_decode(engine, sub, copy_tb_per_s, gen, sampling=False)


def measure_bf16(plan: Plan, device: torch.device, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """The baseline: bf16 weights and KV, both decode shapes."""
    with quant_engine(plan, device) as engine:
        return {"kv_dtype": engine.kv_spec.kv_dtype,
                "decode": weights_decode(engine, plan, copy_tb_per_s, gen),
                "decode_kv": kv_heavy_decode(engine, plan, copy_tb_per_s, gen)}


def measure_fp8_weights(plan: Plan, device: torch.device, ceilings: dict, gen: torch.Generator) -> dict:
    """8-bit weights: the weight-bound decode steps, and a prefill of the key length against the
    FP8 matmul rate (the bf16 one where there is none)."""
    method = weight_quantization(device)
    fp8_rate = ceilings.get("fp8_matmul_tflops") if method == "fp8" else None
    rate = fp8_rate or ceilings.get("matmul_tflops", 800.0)
    with quant_engine(plan, device, quantization=method) as engine:
        return {"quantization": method,
                "mfu_rate": "fp8 matmul" if fp8_rate else "bf16 matmul (no FP8 matmul rate here)",
                "mfu_rate_tflops": rate,
                "decode": weights_decode(engine, plan, ceilings.get("copy_tb_per_s", 4.0), gen),
                "prefill": measure_prefill(engine, plan, [plan.key_len], rate, gen)}


def measure_fp8_kv(plan: Plan, device: torch.device, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """fp8 KV with bf16 weights: the KV-bound decode step."""
    with quant_engine(plan, device, kv_cache_dtype=KV_DTYPE) as engine:
        return {"kv_dtype": engine.kv_spec.kv_dtype, "decode_kv": kv_heavy_decode(engine, plan, copy_tb_per_s, gen)}


async def measure_kv_bytes(plan: Plan, device: torch.device, gen: torch.Generator) -> dict:
    """One handover of the same ``kv_bytes_len``-token prompt from a bf16 P to a D storing bf16,
    then to one storing fp8: the bytes P's sender counted as moved, and D's received counter."""
    n = plan.kv_bytes_len
    p_engine = build_engine(plan.big_config, str(device), max_total_tokens=2 * n + _ROW_MARGIN,
                            max_model_len=plan.max_model_len, max_running_requests=2, max_num_batched_tokens=n,
                            enable_prefix_cache=False, block_size=plan.block_size, cuda_graph_batch_sizes=[1],
                            overlap_schedule=plan.overlap_schedule)
    prompt = random_prompt(p_engine.model_config.vocab_size, n, gen)
    out: dict[str, Any] = {"tokens": n, "p_kv_dtype": p_engine.kv_spec.kv_dtype}
    try:
        for name, kv_dtype in (("bf16", "auto"), ("fp8", KV_DTYPE)):
            d_options = {"kv_cache_dtype": kv_dtype, "max_total_tokens": 2 * n + _ROW_MARGIN,
                         "cuda_graph_batch_sizes": [1]}
            async with pd_pair(p_engine, plan, plan.big_config, device, d_engine_options=d_options) as pair:
                job = await pair.job(prompt)
                row = {"transport": pair.channel.transport, "d_kv_dtype": pair.channel.peer_kv_dtype,
                       "bytes": job["bytes"]}
            row["d_bytes_received"] = (pair.d_counters or {}).get("kv_bytes_received")
            out[name] = row
            logger.info("handover of %d tokens to a %s D: %s", n, name, row)
    finally:
        p_engine.close()
        del p_engine
        empty_cache()
    out["bytes_ratio"] = out["fp8"]["bytes"] / out["bf16"]["bytes"]
    return out
