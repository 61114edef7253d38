"""(g) Tensor parallelism on two GPUs, the big shape at TP 2 (dummy weights, each rank its own):

- decode steps against the floor of one rank: its weight shards and its KV heads read at the
  batch's contexts, at one GPU's copy rate (the TP 1 floor's definition, per rank);
- one decode step's hidden row summed over the ranks by the engine's all-reduce (the one-shot
  where it runs) beside NCCL's own on the same group, each as a CUDA graph of back-to-back calls;
- a prompt's KV handed from P at TP 1 to D at TP 2 on one host through the engine's handover,
  against a plain device copy of the bytes each D rank holds, and how much of it stays visible
  after the prefill.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import multiprocessing as mp
import statistics
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pd_cluster.bench.gpu.decode import measure_decode
from pd_cluster.bench.gpu.models import build_engine, random_prompt
from pd_cluster.bench.gpu.pd_pair import PDPair, pd_pair
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.prefill import measure_prefill
from pd_cluster.bench.gpu.timing import empty_cache, wall_ms
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.shard import Shard

logger = logging.getLogger(__name__)

TP = 2
#: Calls captured in one graph of the all-reduce timing.
GRAPH_CALLS = 100
#: Rows of the all-reduce sweep: one decode row (the key), and larger batches for the crossover.
ALLREDUCE_ROWS = (1, 8, 64, 256)
SPAWN_TIMEOUT_S = 180.0


def rank_kv_bytes_per_token(config: ModelConfig, shard: Shard, dtype: torch.dtype) -> int:
    """KV bytes one rank reads a token: its own KV heads, keys and values, every layer."""
    heads = shard.kv_heads(config).count
    return config.num_layers * 2 * heads * config.head_dim * torch.empty(0, dtype=dtype).element_size()


def build_tp_engine(plan: Plan, device: str, **options: Any) -> LLMEngine:
    """The big shape at TP 2 from rank 0's ``device``, dummy weights on each rank."""
    return build_engine(plan.big_config, device, tp=TP, load_format="dummy", enable_prefix_cache=False,
                        block_size=plan.block_size, overlap_schedule=plan.overlap_schedule, **options)


def measure_tp_decode(engine: LLMEngine, plan: Plan, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """Decode at batch 1 and the key batch against one rank's floor (rank 0's weights are its shards)."""
    decode_plan = Plan(plan.quick)
    decode_plan.decode_batches = [1, plan.key_batch]
    decode_plan.decode_ctx, decode_plan.decode_steps = plan.decode_ctx, plan.decode_steps
    kv_token = rank_kv_bytes_per_token(engine.model_config, engine.shard, engine.pool.k_cache.dtype)
    out = measure_decode(engine, decode_plan, copy_tb_per_s, gen, kv_bytes_per_token=kv_token, sampling=False,
                         graph_replay=False)
    out.update(tp=TP, rank_kv_bytes_per_token=kv_token)
    return out


# ---- the all-reduce of one decode row --------------------------------------------------------------


def measure_allreduce(hidden: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Two processes on cuda:0 and cuda:1, a node's group each: ours and NCCL's, per row count."""
    store = dist.TCPStore("127.0.0.1", 0, TP + 1, True, wait_for_workers=False, timeout=dt.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=allreduce_rank, args=(rank, store.port, hidden, dtype, child if rank == 0 else None),
                         daemon=True) for rank in range(TP)]
    for proc in procs:
        proc.start()
    try:
        if not parent.poll(SPAWN_TIMEOUT_S):
            raise RuntimeError("the all-reduce ranks did not report")
        status, result = parent.recv()
        if status != "ok":
            raise RuntimeError(f"all-reduce rank 0 failed: {result}")
        return result
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def allreduce_rank(rank: int, port: int, hidden: int, dtype: torch.dtype, conn) -> None:
    """Child process: rank ``rank`` of a TP node's group; rank 0 sends the timings back."""
    from pd_cluster.engine.tp_group import TPGroup

    try:
        device = torch.device(f"cuda:{rank}")
        store = dist.TCPStore("127.0.0.1", port, TP + 1, False, timeout=dt.timedelta(seconds=120))
        group = TPGroup(store, rank, TP, device)
        result: dict[str, Any] = {"one_shot": group.one_shot is not None,
                                  "one_shot_limit_bytes": group.one_shot.limit if group.one_shot else None}
        for rows in ALLREDUCE_ROWS:
            x = torch.full((rows, hidden), float(rank + 1), dtype=dtype, device=device)
            ours_us = graph_us(group.all_reduce, x, group)
            nccl_us = graph_us(group.group_all_reduce, x, group)
            result[f"rows{rows}"] = {"bytes": x.numel() * x.element_size(), "ours_us": ours_us, "nccl_us": nccl_us,
                                     "nccl_vs_ours": nccl_us / ours_us}
        x = torch.ones((1, hidden), dtype=dtype, device=device)
        group.all_reduce(x)
        torch.cuda.synchronize(device)
        result["sum_ok"] = bool((x == TP).all())
        if conn is not None:
            conn.send(("ok", result))
    except BaseException as e:
        if conn is not None:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def graph_us(all_reduce, x: torch.Tensor, group) -> float:
    """Microseconds a call of ``all_reduce(x)``: a CUDA graph of :data:`GRAPH_CALLS` back-to-back
    calls replayed, the ranks started together, the median replay over the calls."""
    stream = torch.cuda.Stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph (NCCL's communicator, the kernels)
            all_reduce(x)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            all_reduce(x)
    times = []
    for _ in range(12):
        group.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times[2:])


# ---- P at TP 1 -> D at TP 2 -------------------------------------------------------------------------


async def measure_hetero(plan: Plan, config_file: Path, gen: torch.Generator) -> dict:
    """P at TP 1 on cuda:0 (this process), D at TP 2 on cuda:0 and cuda:1 (a child): whole jobs
    of ``plan.key_len`` tokens, the KV written whole after the prefill and layer by layer during
    it, each D rank's heads into that rank's pool in place (CUDA IPC; ``transport`` says "ipc")."""
    n = plan.key_len
    p_engine = build_engine(config_file, "cuda:0", load_format="dummy", max_total_tokens=4 * n,
                            max_model_len=plan.max_model_len, max_num_batched_tokens=n, max_running_requests=4,
                            mixed_graph_tokens=[], enable_prefix_cache=False, block_size=plan.block_size)
    try:
        prefill_ms = measure_prefill(p_engine, plan, [n], 1.0, gen)[str(n)]["ms"]
        async with pd_pair(p_engine, plan, config_file, torch.device("cuda:0"),
                           d_engine_options={"tp": TP, "load_format": "dummy"}) as pair:
            row = {"tokens": n, "prefill_ms": prefill_ms, "transport": pair.channel.transport,
                   **await _handover_jobs(pair, n, gen)}
    finally:
        p_engine.close()
    config = p_engine.model_config
    row["copy_ms"] = rank_copy_ms(config, n, p_engine.pool.k_cache.dtype)
    row["transfer_ms"] = row["whole_handover_ms"] - prefill_ms
    row["transfer_vs_copy"] = row["copy_ms"] / row["transfer_ms"]
    row["visible_fraction"] = (row["layers_handover_ms"] - prefill_ms) / row["transfer_ms"]
    logger.info("P TP1 -> D TP2, %d tokens: %s", n, row)
    return row


async def _handover_jobs(pair: PDPair, n: int, gen: torch.Generator) -> dict:
    """Median handover of whole jobs (prefill, KV to D, commit), whole and layer-wise, by either path."""
    service = pair.p
    saved = (service.layerwise, service.direct_layerwise_min_tokens)
    row: dict[str, Any] = {}
    try:
        for mode, layerwise, direct_min in (("layers", True, 0), ("whole", False, 1 << 30)):
            service.layerwise, service.direct_layerwise_min_tokens = layerwise, direct_min
            runs = [await pair.job(random_prompt(pair.vocab, n, gen)) for _ in range(5)][1:]
            row[f"{mode}_handover_ms"] = statistics.median(r["handover_ms"] for r in runs)
            row[f"{mode}_first_token_ms"] = statistics.median(r["first_token_ms"] for r in runs)
            visible = [r["visible_s"] for r in runs if r["visible_s"] is not None]  # None: the path does not tell
            row[f"{mode}_after_first_token_ms"] = statistics.median(visible) * 1e3 if visible else None
            row[f"{mode}_bytes"] = runs[0]["bytes"]
    finally:
        service.layerwise, service.direct_layerwise_min_tokens = saved
    return row


def rank_copy_ms(config: ModelConfig, n: int, dtype: torch.dtype) -> float:
    """A plain copy of ``n`` tokens' KV from cuda:0 to where D's ranks hold it: each rank's heads
    into its GPU, both copies at once."""
    parts = [rank_kv_bytes_per_token(config, Shard(rank, TP), dtype) * n for rank in range(TP)]
    src = [torch.empty(b // 2, dtype=torch.bfloat16, device="cuda:0") for b in parts]
    dst = [torch.empty(b // 2, dtype=torch.bfloat16, device=f"cuda:{rank}") for rank, b in enumerate(parts)]
    streams = [torch.cuda.Stream("cuda:0") for _ in parts]

    def copy() -> None:
        for s, d, stream in zip(src, dst, streams):
            with torch.cuda.stream(stream):
                d.copy_(s, non_blocking=True)

    devices = [torch.device(f"cuda:{r}") for r in range(TP)]
    ms = wall_ms(copy, devices, warmup=2, reps=10)
    del src, dst
    empty_cache()
    return ms


# ---- the part -------------------------------------------------------------------------------------------


def measure_tp(plan: Plan, copy_tb_per_s: float, gen: torch.Generator) -> dict:
    """(g): decode at TP 2, the all-reduce, then P TP 1 -> D TP 2; each engine stopped before the next."""
    out: dict[str, Any] = {"tp": TP}
    engine = build_tp_engine(plan, "cuda:0", max_total_tokens=plan.key_batch * (plan.decode_ctx + 256),
                             max_model_len=plan.max_model_len, max_running_requests=plan.key_batch,
                             max_num_batched_tokens=8192)
    try:
        out["decode"] = measure_tp_decode(engine, plan, copy_tb_per_s, gen)
    finally:
        engine.close()
    hidden = engine.model_config.hidden_size
    del engine
    empty_cache()
    out["allreduce"] = measure_allreduce(hidden)
    out["hetero"] = asyncio.run(measure_hetero(plan, plan.big_config, gen))
    return out
