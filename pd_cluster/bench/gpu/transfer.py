"""(d) KV transfer P -> D against raw NCCL, and a 75% prefix hit on D; (e) how much of the
transfer stays visible in a handover, layer-wise and whole."""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kernels
from pd_cluster.bench.gpu.models import random_prompt
from pd_cluster.bench.gpu.pd_pair import BenchAck, BenchSink, PDPair, RawNccl, pd_pair
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import async_ms, cuda_ms, wall_ms
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.handover.messages import CommitKV, PushAck, PushKV, StreamKV

logger = logging.getLogger(__name__)


async def measure_pd(p_engine: LLMEngine, plan: Plan, config_file: Path, p_dev: torch.device,
                     d_dev: torch.device, prefill: dict, gen: torch.Generator) -> dict:
    """(d) and (e): P on ``p_dev`` (the benchmark engine), D on ``d_dev``, one process, NCCL pair."""
    out: dict[str, Any] = {"p_device": str(p_dev), "d_device": str(d_dev)}
    async with pd_pair(p_engine, plan, config_file, d_dev) as pair:
        out["backend"] = pair.channel.backend
        out["transfer"] = await measure_transfer(pair, plan, p_dev, d_dev, gen)
        out["ttft"] = await measure_ttft(pair, plan, prefill, out["transfer"], gen)
        out["prefix_hit_75"] = await measure_prefix_hit(pair, plan, out["transfer"], gen)
        out["bytes_sent_total"] = pair.p.counters.kv_bytes_sent
    if pair.d_counters is not None:
        out["d_counters"] = pair.d_counters
    return out


# ---- (d) the transfer alone -------------------------------------------------------------------


async def measure_transfer(pair: PDPair, plan: Plan, p_dev: torch.device, d_dev: torch.device,
                           gen: torch.Generator) -> dict:
    """Per length: raw NCCL, our channel bare, a whole and a layer-wise handover, P's gather."""
    raw = RawNccl(p_dev, d_dev) if p_dev.type == d_dev.type == "cuda" else None
    transfer: dict[str, Any] = {}
    try:
        for n in plan.transfer_lens:
            row = await transfer_row(pair, raw, n, p_dev, d_dev, gen)
            transfer[str(n)] = row
            logger.info("transfer %d tokens: raw %.3f ms, channel %.3f ms, whole %.3f ms, layers %.3f ms", n,
                        row["raw_nccl_ms"], row["channel_ms"], row["handover_whole_ms"], row["handover_layers_ms"])
    finally:
        if raw is not None:
            raw.close()
    return transfer


async def transfer_row(pair: PDPair, raw: RawNccl | None, n: int, p_dev: torch.device, d_dev: torch.device,
                       gen: torch.Generator) -> dict:
    spec = pair.p_engine.kv_spec
    nbytes = n * spec.bytes_per_token
    layers = torch.randn((spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim), device=p_dev).to(torch.bfloat16)
    whole = layers.transpose(0, 1).contiguous()  # [2, L, n, H, D]
    flat = whole.view(-1)
    sink = torch.empty(flat.shape, dtype=flat.dtype, device=d_dev)
    row: dict[str, Any] = {"tokens": n, "bytes": nbytes}
    row["raw_nccl_ms"] = (wall_ms(lambda: raw.send_recv(flat, sink), [p_dev, d_dev], warmup=2, reps=7)
                          if raw is not None else float("nan"))

    async def bare() -> None:
        ack = await pair.channel.request(BenchSink(shapes=[list(whole.shape)], dtype="bfloat16"), 60.0, tensors=whole)
        assert isinstance(ack, BenchAck) and ack.nbytes == nbytes

    row["channel_ms"] = await async_ms(bare, reps=7)
    pushes: list[float] = []
    streams: list[float] = []
    for _ in range(4):
        pushes.append(await push_whole(pair, whole, n, gen))
        streams.append(await push_layers(pair, layers, n, nbytes, gen))
    row["handover_whole_ms"] = statistics.median(pushes[1:])
    row["handover_layers_ms"] = statistics.median(streams[1:])
    pool = pair.p_engine.pool
    slots = torch.randperm(pool.capacity - 1, device=p_dev)[:n]
    row["gather_ms"] = cuda_ms(lambda: kernels.gather_kv(pool.k_cache, pool.v_cache, slots, spec.row_width), p_dev)
    row["channel_vs_nccl"] = row["raw_nccl_ms"] / row["channel_ms"]
    row["handover_whole_vs_nccl"] = row["raw_nccl_ms"] / row["handover_whole_ms"]
    row["handover_layers_vs_nccl"] = row["raw_nccl_ms"] / row["handover_layers_ms"]
    row["pool_to_pool_ms"] = row["gather_ms"] + row["handover_whole_ms"]
    row["raw_nccl_gb_per_s"] = nbytes / row["raw_nccl_ms"] / 1e6
    row["channel_gb_per_s"] = nbytes / row["channel_ms"] / 1e6
    return row


async def push_whole(pair: PDPair, whole: torch.Tensor, n: int, gen: torch.Generator) -> float:
    """Milliseconds of one whole-KV handover (``PushKV`` of ``[2, L, n, H, D]``) into a fresh lease."""
    lease_id, prompt = await pair.lease(n, gen)
    start = time.perf_counter()
    ack = await pair.channel.request(PushKV(lease_id=lease_id, shape=list(whole.shape), dtype="bfloat16",
                                            first_token=5), 60.0, tensors=whole)
    elapsed = (time.perf_counter() - start) * 1e3
    assert isinstance(ack, PushAck) and ack.ok, ack
    return elapsed


async def push_layers(pair: PDPair, layers: torch.Tensor, n: int, nbytes: int, gen: torch.Generator) -> float:
    """Milliseconds of one layer-wise handover (``StreamKV``, a tensor per layer, ``CommitKV``)."""
    lease_id, prompt = await pair.lease(n, gen)
    stream = _layer_stream(pair, n)
    stream.fill_from(layers)
    channel = pair.channel
    deadline = time.monotonic() + 60.0
    start = time.perf_counter()
    async with channel.exclusive():
        await channel.send(StreamKV(lease_id=lease_id, num_layers=pair.p_engine.kv_spec.num_layers,
                                    layer_shape=stream.layer_shape, dtype="bfloat16"), 30.0)
        sent = await stream.send(channel, lambda: deadline - time.monotonic())
        await channel.send(CommitKV(lease_id=lease_id, first_token=5), 30.0)
        acks = [await channel.receive(30.0), await channel.receive(30.0)]
    elapsed = (time.perf_counter() - start) * 1e3
    assert sent == nbytes and all(isinstance(a, PushAck) and a.ok for a in acks), acks
    return elapsed


def _layer_stream(pair: PDPair, n: int):
    from pd_cluster.handover.stream import LayerStream

    return LayerStream("bench", 0, n, n, pair.p_engine.pool, asyncio.get_running_loop(), None)


# ---- (e) the transfer inside a handover ----------------------------------------------------------


async def measure_ttft(pair: PDPair, plan: Plan, prefill: dict, transfer: dict, gen: torch.Generator) -> dict:
    """Whole jobs, layer-wise and whole: the handover time beyond the prefill alone, as a fraction
    of the standalone pool-to-pool transfer of the same length."""
    ttft: dict[str, Any] = {}
    for n in plan.ttft_lens:
        row = {"tokens": n, "prefill_ms": prefill.get(str(n), {}).get("ms")}
        service = pair.p
        saved = (service.layers_per_send, sys.getswitchinterval())
        # Layer-wise as served, then two variants: a layer per send, and the interpreter handing
        # the GIL between threads every 0.5 ms instead of 5 (the engine thread launching the
        # forward holds it while the sends wait for it).
        variants = (("layers", True, saved[0], saved[1]), ("layers_per_layer", True, 1, saved[1]),
                    ("layers_fast_switch", True, saved[0], 0.0005), ("whole", False, saved[0], saved[1]))
        try:
            for mode, layerwise, group, switch in variants:
                service.layerwise, service.layers_per_send = layerwise, group
                sys.setswitchinterval(switch)
                runs = [await pair.job(random_prompt(pair.vocab, n, gen)) for _ in range(4)][1:]
                row[f"{mode}_handover_ms"] = statistics.median(r["handover_ms"] for r in runs)
                row[f"{mode}_first_token_ms"] = statistics.median(r["first_token_ms"] for r in runs)
                row[f"{mode}_bytes"] = runs[0]["bytes"]
                if layerwise:  # the sends still running after the first token
                    row[f"{mode}_after_first_token_ms"] = statistics.median(r["visible_s"] * 1e3 for r in runs)
        finally:
            service.layerwise, (service.layers_per_send, switch) = True, saved
            sys.setswitchinterval(switch)
        standalone = transfer.get(str(n))
        if standalone and row["prefill_ms"]:
            xfer = standalone["pool_to_pool_ms"]
            row["standalone_transfer_ms"] = xfer
            for mode, *_ in variants:
                row[f"{mode}_visible_fraction"] = (row[f"{mode}_handover_ms"] - row["prefill_ms"]) / xfer
        ttft[str(n)] = row
        logger.info("handover %d tokens: %s", n, row)
    return ttft


# ---- (d) a prefix hit on D -----------------------------------------------------------------------


async def measure_prefix_hit(pair: PDPair, plan: Plan, transfer: dict, gen: torch.Generator) -> dict:
    """75% of the prompt already on D: only the last quarter of its blocks moves."""
    n = plan.key_len
    prompt = random_prompt(pair.vocab, n, gen)
    await pair.job(prompt[: n * 3 // 4])  # D caches this prefix
    hit = await pair.job(prompt)
    fresh = [await pair.job(random_prompt(pair.vocab, n, gen)) for _ in range(2)]
    return {
        "tokens": n,
        "hit_blocks": hit["hit_blocks"],
        "bytes": hit["bytes"],
        "bytes_no_hit": fresh[-1]["bytes"],
        "bytes_fraction": hit["bytes"] / fresh[-1]["bytes"],
        "handover_ms": hit["handover_ms"],
        "handover_ms_no_hit": statistics.median(f["handover_ms"] for f in fresh),
        # Moving n/4 tokens vs n tokens pool to pool, from the standalone transfers above.
        "transfer_ms": transfer.get(str(n // 4), {}).get("pool_to_pool_ms"),
        "transfer_ms_no_hit": transfer.get(str(n), {}).get("pool_to_pool_ms"),
    }
