"""(f) P writing in place into D's pool (CUDA IPC): P and D sharing one GPU, or on two GPUs of
one host (peer access). The write against a plain copy of the same bytes (device to device, or
peer to peer), how much of it stays visible after the first token, and what the first token
gains by leaving P before the KV reaches D (the output path)."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

import kernels
from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.pd_pair import PDPair, pd_pair
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import cuda_ms, wall_ms
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.handover.messages import ReleaseLease
from pd_cluster.transfer import decode_slots

logger = logging.getLogger(__name__)


async def measure_same_gpu(p_engine: LLMEngine, plan: Plan, config_file, device: torch.device,
                           gen: torch.Generator, d_device: torch.device | None = None) -> dict:
    """P's service on the benchmark engine, D in a child process on the same GPU (or on
    ``d_device``, sharing its pool across the GPUs of the host)."""
    d_device = d_device or device
    out: dict[str, Any] = {"device": str(device), "d_device": str(d_device)}
    async with pd_pair(p_engine, plan, config_file, d_device, share_across_gpus=d_device != device) as pair:
        out["transport"] = pair.channel.transport
        if len(pair.channel.shared_pools) != 1:
            raise RuntimeError(f"D did not share its pool (transport {pair.channel.transport})")
        out["write"] = {str(n): await write_row(pair, n, gen) for n in plan.transfer_lens}
        out["handover"] = {str(n): await handover_row(pair, n, out["write"], gen) for n in plan.output_path_lens}
    return out


async def write_row(pair: PDPair, n: int, gen: torch.Generator) -> dict:
    """The write of ``n`` tokens' KV into slots D reserved, against a plain copy of those bytes."""
    spec = pair.p_engine.kv_spec
    pool = pair.p_engine.pool
    device = pool.device
    shared = pair.channel.shared_pools[0]  # D at TP 1: one pool of every head
    match, _ = await pair.match(n, gen, direct=True)
    try:
        dst = decode_slots(match.slots).to(device)
        src = torch.randperm(pool.capacity - 1, device=device)[:n]
        def write() -> None:
            kernels.copy_kv_slots(pool.k_cache, pool.v_cache, src, shared.k_cache, shared.v_cache, dst)

        if shared.device == device:
            write_ms = cuda_ms(write, device)
        else:
            write_ms = wall_ms(write, [device, shared.device], warmup=2, reps=10)
        # The same bytes, contiguous to contiguous: what the memory system allows.
        nbytes = n * spec.bytes_per_token
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        b = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=shared.device)
        if shared.device == device:
            copy_ms = cuda_ms(lambda: b.copy_(a), device)
        else:  # peer to peer: the host clock around both GPUs
            copy_ms = wall_ms(lambda: b.copy_(a), [device, shared.device], warmup=2, reps=10)
        del a, b
    finally:
        await pair.channel.request(ReleaseLease(lease_id=match.lease_id), 30.0)
    row = {"tokens": n, "bytes": nbytes, "write_ms": write_ms, "copy_ms": copy_ms,
           "write_vs_copy": copy_ms / write_ms, "write_gb_per_s": nbytes / write_ms / 1e6}
    logger.info("in-place write %d tokens: %s", n, row)
    return row


async def handover_row(pair: PDPair, n: int, writes: dict, gen: torch.Generator) -> dict:
    """Whole jobs, layer by layer and whole: P's first token, the KV in D's pool, the commit."""
    row: dict[str, Any] = {"tokens": n}
    service = pair.p
    saved = service.direct_layerwise_min_tokens
    try:
        for mode, threshold in (("layers", 0), ("whole", 1 << 30)):
            service.direct_layerwise_min_tokens = threshold
            runs = [await pair.job(random_prompt(pair.vocab, n, gen)) for _ in range(5)][1:]
            row[f"{mode}_first_token_ms"] = statistics.median(r["first_token_ms"] for r in runs)
            row[f"{mode}_handover_ms"] = statistics.median(r["handover_ms"] for r in runs)
            row[f"{mode}_visible_ms"] = statistics.median(r["visible_s"] * 1e3 for r in runs)
            row[f"{mode}_bytes"] = runs[0]["bytes"]
    finally:
        service.direct_layerwise_min_tokens = saved
    standalone = writes.get(str(n), {}).get("write_ms")
    if standalone:
        row["standalone_write_ms"] = standalone
        for mode in ("layers", "whole"):
            row[f"{mode}_visible_fraction"] = row[f"{mode}_visible_ms"] / standalone
    # The output path: D could speak first only once the KV is committed there.
    row["first_token_lead_ms"] = row["layers_handover_ms"] - row["layers_first_token_ms"]
    logger.info("same-GPU handover %d tokens: %s", n, row)
    return row
