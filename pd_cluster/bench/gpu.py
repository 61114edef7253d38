"""GPU benchmark in one run: every number is a ratio against a ceiling measured in the same run.

    python -m pd_cluster.bench.gpu --out docs/benchmarks          # needs 2 GPUs for (d) and (e)

(a) decode step at batch 1/16/64/128 with ~1k context vs the floor (weight bytes + KV bytes
    read) / device copy bandwidth; (b) prefill at 1k/4k/8k vs the bf16 matmul rate (MFU);
(c) transformers ``generate()`` on the same weights, batch and lengths; (d) KV of 1k/4k/16k
    tokens GPU0 -> GPU1 through our channel vs raw NCCL send/recv of the same bytes, and a
    75% prefix hit on D; (e) how much of the transfer stays visible with layer-wise sending.
The models are Llama-3-8B-shaped (and the default model's shape) with random bf16 weights
made on the GPU from a config file: nothing is downloaded. Results go to
``<out>/gpu-<kind>-<date>.json`` and a markdown table beside it; a short table prints last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal
from unittest import mock

# Two GPUs of one host: NVLink multicast stays off, also in threads and children.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

import kernels
from pd_cluster.config import EngineConfig
from pd_cluster.engine import llm_engine
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampler import SamplingState
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.handover_layers import CommitKV, StreamKV
from pd_cluster.handover_messages import MatchPrefix, MatchResult, PushAck, PushKV
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.weights import LayerWeights, ModelWeights
from pd_cluster.protocol import PrefillJob
from pd_cluster.transfer import DataMessage

logger = logging.getLogger("pd_cluster.bench.gpu")

CONFIGS = Path(__file__).with_name("configs")
TOKEN = "bench-token"
TARGETS = {  # key: (target, "<=" lower is better / ">=" higher is better)
    "decode_floor_ratio_b1": (1.5, "<="),
    "decode_floor_ratio_b64": (1.3, "<="),
    "prefill_mfu_4k": (0.65, ">="),
    "hf_decode_speedup_b64": (8.0, ">="),
    "transfer_vs_nccl_4k": (0.80, ">="),
    "transfer_visible_fraction_4k": (0.25, "<="),
}


# ---- plans ------------------------------------------------------------------------------------


class Plan:
    """Shapes of one run: the full one, or a quick one that exercises every path on a tiny model."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.big_config = CONFIGS / ("tiny.json" if quick else "llama3-8b.json")
        self.small_config = CONFIGS / ("tiny.json" if quick else "smollm2-135m.json")
        self.decode_batches = [1, 4, 16] if quick else [1, 16, 64, 128]
        self.decode_ctx = 256 if quick else 1024
        self.decode_steps = 8 if quick else 20
        self.key_batch = 16 if quick else 64  # the "b64" keys
        self.prefill_lens = [256, 512, 1024] if quick else [1024, 4096, 8192]
        self.key_len = 512 if quick else 4096  # the "4k" keys
        self.hf_batches = [1, 16] if quick else [1, 64]
        self.hf_new_tokens = 4 if quick else 12
        self.transfer_lens = [256, 512, 2048] if quick else [1024, 4096, 16384]
        self.ttft_lens = [512] if quick else [1024, 4096]
        self.max_model_len = 4096 if quick else 17408
        self.kv_tokens = 32768 if quick else 180_000
        self.d_kv_tokens = 16384 if quick else 72_000
        self.block_size = 16


# ---- timing and ceilings ----------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` between CUDA events on the current stream (host clock on a CPU)."""
    if device.type != "cuda":
        return wall_ms(fn, [device], warmup, reps)
    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], Any], devices: list[torch.device], warmup: int = 1, reps: int = 5) -> float:
    """Median wall milliseconds of ``fn`` (host clock; ``fn`` must leave nothing queued)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        for d in devices:
            sync(d)
        start = time.perf_counter()
        fn()
        for d in devices:
            sync(d)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> dict:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate, on random data."""
    n = 1 << 30 if device.type == "cuda" else 1 << 22  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), device, reps=20)
    del src, dst
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm_ms = cuda_ms(lambda: torch.mm(a, b), device, warmup=5, reps=20)
    del a, b
    empty_cache()
    return {
        "copy_bytes": 2 * 2 * n,
        "copy_ms": copy_ms,
        "copy_tb_per_s": 2 * 2 * n / copy_ms / 1e9,
        "matmul_shape": [m, m, m],
        "matmul_ms": mm_ms,
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
    }


# ---- random models ------------------------------------------------------------------------------


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    """Llama weights of ``cfg``'s shape, N(0, 0.02) like a fresh Hugging Face model, made on the device."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [
        LayerWeights(
            input_norm=ones(h),
            qkv=normal(q + 2 * kv, h),
            qkv_bias=torch.zeros(q + 2 * kv, dtype=dtype, device=device) if cfg.attention_bias else None,
            o=normal(h, q),
            post_norm=ones(h),
            gate_up=normal(2 * inter, h),
            down=normal(h, inter),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = normal(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)


@contextlib.contextmanager
def random_model(config_file: Path, seed: int = 0) -> Iterator[str]:
    """A model directory holding only ``config.json``; engines built inside get random weights."""
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        shutil.copy(config_file, Path(tmp) / "config.json")

        def load(path, config: ModelConfig, dtype: torch.dtype, device) -> ModelWeights:
            return random_weights(config, dtype, torch.device(device), seed)

        with mock.patch.object(llm_engine, "load_weights", load):
            yield tmp


class BlankTokenizer:
    """Random weights have no vocabulary: every token decodes to "" (the detokenizer still runs)."""

    eos_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""


def build_engine(config_file: Path, device: str, seed: int = 0, **options: Any) -> LLMEngine:
    with random_model(config_file, seed) as path:
        return LLMEngine(EngineConfig(model=path, device=device, dtype="bfloat16", **options),
                         tokenizer=BlankTokenizer())


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads from the weights: every matrix but the embedding table (a step
    gathers only its rows), the lm_head counted once even when tied."""
    w = engine.model.weights
    tensors = [w.final_norm, w.lm_head]
    for layer in w.layers:
        tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        if layer.qkv_bias is not None:
            tensors.append(layer.qkv_bias)
    return sum(t.numel() * t.element_size() for t in tensors)


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Matmul FLOPs of a fresh n-token prefill: projections, causal attention, one lm_head row."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    attention = cfg.num_layers * 2 * 2 * q * (n * (n + 1) / 2)
    return per_token * n + attention + 2 * h * cfg.vocab_size


def random_prompt(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


# ---- (a) decode, (b) prefill ----------------------------------------------------------------------


def measure_decode(engine: LLMEngine, plan: Plan, copy_tb_per_s: float, gen: torch.Generator,
                   eager_batches: tuple[int, ...] = ()) -> dict:
    """Decode steps of the whole engine (schedule, graph replay, sampling), largest batch first;
    requests are aborted down to the next batch size, so contexts stay near ``decode_ctx``."""
    vocab = engine.model_config.vocab_size
    # Enough tokens for every timed step; more would make admission wait for KV that is never used.
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    batches = sorted(plan.decode_batches, reverse=True)
    reqs = [engine.add_request(f"dec-{uuid.uuid4().hex}", random_prompt(vocab, plan.decode_ctx, gen), params)
            for _ in range(batches[0])]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    w_bytes = weight_bytes(engine)
    per_token = engine.kv_spec.bytes_per_token
    out: dict[str, Any] = {"weight_bytes": w_bytes, "context": plan.decode_ctx, "steps": plan.decode_steps}
    for batch in batches:
        for r in reqs[batch:]:
            engine.abort(r.request_id)
        reqs = reqs[:batch]
        for _ in range(3):
            engine.step()
        row = time_decode_steps(engine, reqs, plan.decode_steps)
        kv_bytes = row.pop("mean_ctx_sum") * per_token
        floor_ms = (w_bytes + kv_bytes) / copy_tb_per_s / 1e9
        row.update(kv_bytes=kv_bytes, floor_ms=floor_ms, floor_ratio=row["step_ms"] / floor_ms,
                   tokens_per_s=batch / row["step_ms"] * 1e3)
        graphs = engine.runner.graphs
        if graphs is not None:
            size = graphs.graph_size(batch)
            row["graph_size"] = size
            row["graph_replay_ms"] = cuda_ms(lambda: graphs.run_graph(size), engine.device)
            row["graph_floor_ratio"] = row["graph_replay_ms"] / floor_ms
        if batch in eager_batches and graphs is not None:
            engine.runner.graphs = None
            try:
                for _ in range(2):
                    engine.step()
                row["eager_step_ms"] = time_decode_steps(engine, reqs, plan.decode_steps)["step_ms"]
            finally:
                engine.runner.graphs = graphs
        out[f"b{batch}"] = row
        logger.info("decode b%d: %.3f ms/step, floor %.3f ms (%.2fx)", batch, row["step_ms"], floor_ms,
                    row["floor_ratio"])
    for r in reqs:
        engine.abort(r.request_id)
    return out


def time_decode_steps(engine: LLMEngine, reqs: list, steps: int) -> dict:
    """Median step time, and where a step's host time goes: scheduling, the runner (inputs,
    launch or graph replay; the GPU runs on) and the rest (sampling waits for the GPU, then
    the tokens are accepted)."""
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


def measure_prefill(engine: LLMEngine, plan: Plan, lens: list[int], matmul_tflops: float, gen: torch.Generator) -> dict:
    """One fresh prompt per step (no prefix cache), first token sampled: tokens/s and MFU."""
    vocab = engine.model_config.vocab_size
    out: dict[str, Any] = {}
    for n in lens:
        times = []
        for rep in range(4 if n <= 4096 else 3):
            engine.add_request(f"pre-{uuid.uuid4().hex}", random_prompt(vocab, n, gen),
                               SamplingParams(temperature=0.0, max_tokens=1))
            sync(engine.device)
            start = time.perf_counter()
            updates = engine.step()
            elapsed = (time.perf_counter() - start) * 1e3
            assert len(updates) == 1 and updates[0].first_token, "the prompt must finish in one step"
            if rep:  # the first one compiles kernels for the new shapes
                times.append(elapsed)
        ms = statistics.median(times)
        flops = prefill_flops(engine.model_config, n)
        out[str(n)] = {"ms": ms, "tokens_per_s": n / ms * 1e3, "tflops": flops / ms / 1e9,
                       "mfu": flops / ms / 1e9 / matmul_tflops}
        logger.info("prefill %d: %.2f ms, MFU %.2f", n, ms, out[str(n)]["mfu"])
    return out


# ---- (c) transformers ------------------------------------------------------------------------------


def hf_model(engine: LLMEngine, config_file: Path):
    """transformers' Llama on the engine's own weight tensors (views, no copies)."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(str(config_file))
    cfg.eos_token_id = None
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    w, mc = engine.model.weights, engine.model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim

    def put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))

    put(model.model.embed_tokens, "weight", w.embed)
    for layer, lw in zip(model.model.layers, w.layers):
        wq, wk, wv = lw.qkv.split((q, kv, kv))
        put(layer.self_attn.q_proj, "weight", wq)
        put(layer.self_attn.k_proj, "weight", wk)
        put(layer.self_attn.v_proj, "weight", wv)
        put(layer.self_attn.o_proj, "weight", lw.o)
        gate, up = lw.gate_up.chunk(2)
        put(layer.mlp.gate_proj, "weight", gate)
        put(layer.mlp.up_proj, "weight", up)
        put(layer.mlp.down_proj, "weight", lw.down)
        put(layer.input_layernorm, "weight", lw.input_norm)
        put(layer.post_attention_layernorm, "weight", lw.post_norm)
    put(model.model.norm, "weight", w.final_norm)
    put(model.lm_head, "weight", w.lm_head)
    # Its inverse frequencies are buffers made at construction: rebuild it off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(engine.device)
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not leftovers, f"unassigned tensors: {leftovers[:3]}"
    return model.eval()


def measure_hf(engine: LLMEngine, plan: Plan, config_file: Path, ours: dict) -> dict:
    """Decode step of ``generate()`` = (time of 1 + k new tokens - time of 1) / k, same batch and context."""
    model = hf_model(engine, config_file)
    vocab, device = engine.model_config.vocab_size, engine.device
    out: dict[str, Any] = {"new_tokens": plan.hf_new_tokens, "context": plan.decode_ctx}

    def generate(ids: torch.Tensor, k: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            result = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                                    do_sample=False, pad_token_id=0)
        sync(device)
        assert result.shape[1] == ids.shape[1] + k
        return (time.perf_counter() - start) * 1e3

    generate(torch.randint(3, vocab, (2, 16), device=device), 2)  # warm-up: handles, allocator
    for batch in plan.hf_batches:
        ids = torch.randint(3, vocab, (batch, plan.decode_ctx), device=device)
        one = generate(ids, 1)
        more = generate(ids, 1 + plan.hf_new_tokens)
        step_ms = (more - one) / plan.hf_new_tokens
        row = {"step_ms": step_ms, "prefill_ms": one, "tokens_per_s": batch / step_ms * 1e3}
        mine = ours.get(f"b{batch}")
        if mine:
            row["our_step_ms"] = mine["step_ms"]
            row["speedup"] = step_ms / mine["step_ms"]
        out[f"b{batch}"] = row
        logger.info("transformers b%d: %.2f ms/step", batch, step_ms)
    del model
    empty_cache()
    return out


# ---- (d) transfer, (e) TTFT ------------------------------------------------------------------------


class BenchSink(DataMessage):
    """Bench only: D receives the announced tensors and answers; measures the bare channel."""

    type: Literal["bench.sink"] = "bench.sink"
    shapes: list[list[int]]
    dtype: str


class BenchAck(DataMessage):
    type: Literal["bench.ack"] = "bench.ack"
    nbytes: int


class RawNccl:
    """A plain 2-rank NCCL pair (GPU a sends, GPU b receives), made the way our channel makes its
    own but used without any of our code in between."""

    def __init__(self, sender: torch.device, receiver: torch.device) -> None:
        self.devices = [sender, receiver]
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
        self.groups: list[Any] = [None, None]
        errors: list[BaseException] = []

        def make(rank: int) -> None:
            try:
                torch.cuda.set_device(self.devices[rank])
                st = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False,
                                                           timeout=dt.timedelta(seconds=60))
                group = dist.ProcessGroupNCCL(dist.PrefixStore("raw", st), rank, 2, dist.ProcessGroupNCCL.Options())
                probe = torch.ones(1, device=self.devices[rank])
                work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
                work.wait()
                torch.cuda.synchronize(self.devices[rank])
                self.groups[rank] = group
            except BaseException as e:  # reported by the caller
                errors.append(e)

        threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors or None in self.groups:
            raise RuntimeError(f"raw NCCL pair failed: {errors}")
        self._store = store

    def send_recv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        w0 = self.groups[0].send([src], 1, 0)
        w1 = self.groups[1].recv([dst], 0, 0)
        w0.wait()
        w1.wait()

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(Exception):
                group.abort()


async def measure_pd(p_engine: LLMEngine, plan: Plan, config_file: Path, p_dev: torch.device,
                     d_dev: torch.device, prefill: dict, gen: torch.Generator) -> dict:
    """(d) and (e): P on ``p_dev`` (the benchmark engine), D on ``d_dev``, one process, NCCL pair."""
    from prefill_node.layer_stream import LayerStream
    from prefill_node.service import PrefillService

    # D runs in its own process, as a decode node does: its engine thread must not share P's GIL.
    d_options = {"max_total_tokens": plan.d_kv_tokens, "max_model_len": plan.max_model_len,
                 "max_num_batched_tokens": 4096, "block_size": plan.block_size, "cuda_graph_batch_sizes": [1, 2, 4],
                 "max_running_requests": 8}
    parent, child = mp.get_context("spawn").Pipe()
    d_proc = mp.get_context("spawn").Process(target=decode_node_main, args=(child, str(config_file), str(d_dev), d_options),
                                             daemon=True)
    d_proc.start()
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, parent.poll, 600):
        d_proc.kill()
        raise RuntimeError("the decode node did not start")
    ready = parent.recv()
    if ready[0] != "ready":
        d_proc.join(10)
        raise RuntimeError(f"the decode node failed: {ready}")
    d_address = ready[1]
    p = PrefillService(p_engine.config, node_id="p0", cluster_token=TOKEN, engine=p_engine, layerwise_min_tokens=0)
    await p.start()
    out: dict[str, Any] = {"p_device": str(p_dev), "d_device": str(d_dev)}
    raw = None
    try:
        channel = await p.pool.get(d_address)
        out["backend"] = channel.backend
        spec = p_engine.kv_spec
        vocab = p_engine.model_config.vocab_size
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        async def lease(n: int) -> tuple[str, list[int]]:
            prompt = random_prompt(vocab, n, gen)
            match = await channel.request(MatchPrefix(request_id=uuid.uuid4().hex, token_ids=prompt, sampling=greedy,
                                                      lease_s=120.0), 30.0)
            assert isinstance(match, MatchResult) and match.lease_id and match.hit_blocks == 0, match
            return match.lease_id, prompt

        raw = RawNccl(p_dev, d_dev) if p_dev.type == d_dev.type == "cuda" else None
        transfer: dict[str, Any] = {}
        for n in plan.transfer_lens:
            nbytes = n * spec.bytes_per_token
            layers = torch.randn((spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim), device=p_dev).to(torch.bfloat16)
            whole = layers.transpose(0, 1).contiguous()  # [2, L, n, H, D]
            flat = whole.view(-1)
            sink = torch.empty(flat.shape, dtype=flat.dtype, device=d_dev)
            row: dict[str, Any] = {"tokens": n, "bytes": nbytes}
            row["raw_nccl_ms"] = (wall_ms(lambda: raw.send_recv(flat, sink), [p_dev, d_dev], warmup=2, reps=7)
                                  if raw is not None else float("nan"))

            async def bare() -> None:
                ack = await channel.request(BenchSink(shapes=[list(whole.shape)], dtype="bfloat16"), 60.0, tensors=whole)
                assert isinstance(ack, BenchAck) and ack.nbytes == nbytes

            row["channel_ms"] = await async_ms(bare, reps=7)

            async def push_whole() -> None:
                lease_id, prompt = await lease(n)
                rng = SamplingState.create(greedy, prompt).export_rng()
                start = time.perf_counter()
                ack = await channel.request(PushKV(lease_id=lease_id, shape=list(whole.shape), dtype="bfloat16",
                                                   first_token=5, rng_state=rng), 60.0, tensors=whole)
                pushes.append((time.perf_counter() - start) * 1e3)
                assert isinstance(ack, PushAck) and ack.ok, ack

            async def push_layers() -> None:
                lease_id, prompt = await lease(n)
                rng = SamplingState.create(greedy, prompt).export_rng()
                stream = LayerStream("bench", 0, n, n, p_engine.pool, asyncio.get_running_loop(), None)
                stream.fill_from(layers)
                deadline = time.monotonic() + 60.0
                start = time.perf_counter()
                async with channel.exclusive():
                    await channel.send(StreamKV(lease_id=lease_id, num_layers=spec.num_layers,
                                                layer_shape=stream.layer_shape, dtype="bfloat16"), 30.0)
                    sent = await stream.send(channel, lambda: deadline - time.monotonic())
                    await channel.send(CommitKV(lease_id=lease_id, first_token=5, rng_state=rng), 30.0)
                    acks = [await channel.receive(30.0), await channel.receive(30.0)]
                streams.append((time.perf_counter() - start) * 1e3)
                assert sent == nbytes and all(isinstance(a, PushAck) and a.ok for a in acks), acks

            pushes: list[float] = []
            streams: list[float] = []
            for _ in range(4):
                await push_whole()
                await push_layers()
            row["handover_whole_ms"] = statistics.median(pushes[1:])
            row["handover_layers_ms"] = statistics.median(streams[1:])
            slots = torch.randperm(p_engine.pool.capacity - 1, device=p_dev)[:n]
            row["gather_ms"] = cuda_ms(lambda: kernels.gather_kv(p_engine.pool.k_cache, p_engine.pool.v_cache, slots),
                                       p_dev)
            row["channel_vs_nccl"] = row["raw_nccl_ms"] / row["channel_ms"]
            row["handover_whole_vs_nccl"] = row["raw_nccl_ms"] / row["handover_whole_ms"]
            row["handover_layers_vs_nccl"] = row["raw_nccl_ms"] / row["handover_layers_ms"]
            row["pool_to_pool_ms"] = row["gather_ms"] + row["handover_whole_ms"]
            row["raw_nccl_gb_per_s"] = nbytes / row["raw_nccl_ms"] / 1e6
            row["channel_gb_per_s"] = nbytes / row["channel_ms"] / 1e6
            transfer[str(n)] = row
            logger.info("transfer %d tokens: raw %.3f ms, channel %.3f ms, whole %.3f ms, layers %.3f ms", n,
                        row["raw_nccl_ms"], row["channel_ms"], row["handover_whole_ms"], row["handover_layers_ms"])
            del layers, whole, flat, sink
        out["transfer"] = transfer
        if raw is not None:
            raw.close()
            raw = None

        async def job(prompt: list[int]) -> dict:
            spec_job = PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt, sampling=greedy,
                                  decode_node_id="d0", decode_address=d_address, deadline_s=120.0)
            marks: dict[str, float] = {}

            async def report(first) -> None:
                marks["first"] = time.perf_counter()

            start = time.perf_counter()
            result = await p.run_job(spec_job, report)
            end = time.perf_counter()
            assert result.committed
            return {"handover_ms": (end - start) * 1e3, "first_token_ms": (marks["first"] - start) * 1e3,
                    "bytes": result.transfer_bytes, "hit_blocks": result.hit_blocks,
                    "transfer_s": result.transfer_seconds}

        ttft: dict[str, Any] = {}
        for n in plan.ttft_lens:
            row = {"tokens": n, "prefill_ms": prefill.get(str(n), {}).get("ms")}
            for mode, layerwise in (("layers", True), ("whole", False)):
                p.layerwise = layerwise
                runs = [await job(random_prompt(vocab, n, gen)) for _ in range(3)]
                row[f"{mode}_handover_ms"] = statistics.median(r["handover_ms"] for r in runs)
                row[f"{mode}_first_token_ms"] = statistics.median(r["first_token_ms"] for r in runs)
                row[f"{mode}_bytes"] = runs[0]["bytes"]
            p.layerwise = True
            standalone = out["transfer"].get(str(n))
            if standalone and row["prefill_ms"]:
                xfer = standalone["pool_to_pool_ms"]
                row["standalone_transfer_ms"] = xfer
                for mode in ("layers", "whole"):
                    row[f"{mode}_visible_fraction"] = (row[f"{mode}_handover_ms"] - row["prefill_ms"]) / xfer
            ttft[str(n)] = row
            logger.info("handover %d tokens: %s", n, row)
        out["ttft"] = ttft

        # 75% of the prompt already on D: only the last quarter of its blocks moves.
        n = plan.key_len
        prompt = random_prompt(vocab, n, gen)
        await job(prompt[: n * 3 // 4])  # D caches this prefix
        hit = await job(prompt)
        fresh = [await job(random_prompt(vocab, n, gen)) for _ in range(2)]
        out["prefix_hit_75"] = {
            "tokens": n,
            "hit_blocks": hit["hit_blocks"],
            "bytes": hit["bytes"],
            "bytes_no_hit": fresh[-1]["bytes"],
            "bytes_fraction": hit["bytes"] / fresh[-1]["bytes"],
            "handover_ms": hit["handover_ms"],
            "handover_ms_no_hit": statistics.median(f["handover_ms"] for f in fresh),
            # Moving n/4 tokens vs n tokens pool to pool, from the standalone transfers above.
            "transfer_ms": out["transfer"].get(str(n // 4), {}).get("pool_to_pool_ms"),
            "transfer_ms_no_hit": out["transfer"].get(str(n), {}).get("pool_to_pool_ms"),
        }
        out["bytes_sent_total"] = p.counters.kv_bytes_sent
    finally:
        if raw is not None:
            raw.close()
        await p.stop()
        with contextlib.suppress(OSError):
            parent.send(("stop",))
        if await loop.run_in_executor(None, parent.poll, 30):
            out["d_counters"] = parent.recv()[1]
        d_proc.join(30)
        if d_proc.is_alive():
            d_proc.kill()
    return out


def decode_node_main(conn, config_file: str, device: str, options: dict) -> None:
    """Child process: a decode node service (random weights) that also sinks bench tensors."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s D %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_decode_node(conn, Path(config_file), device, options))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise


async def _decode_node(conn, config_file: Path, device: str, options: dict) -> None:
    from decode_node.service import DecodeService

    engine = build_engine(config_file, device, seed=1, **options)
    d = DecodeService(engine.config, node_id="d0", cluster_token=TOKEN, on_tokens=lambda updates: None, engine=engine)
    original = d.server._handler

    async def handler(peer, msg):
        if isinstance(msg, BenchSink):
            received = await peer.recv_tensors([(s, msg.dtype) for s in msg.shapes], 60.0)
            return BenchAck(nbytes=sum(t.numel() * t.element_size() for t in received))
        return await original(peer, msg)

    d.server._handler = handler
    await d.start()
    conn.send(("ready", d.data_address))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    counters = {"kv_bytes_received": d.counters.kv_bytes_received, "kv_transfers": d.counters.kv_transfers,
                "hit_tokens": d.counters.hit_tokens}
    await d.stop()
    conn.send(("counters", counters))


async def async_ms(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# ---- the run ------------------------------------------------------------------------------------------


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_kind() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    return f"{name}-x{torch.cuda.device_count()}"


def summarize(results: dict, plan: Plan) -> dict:
    """The six headline ratios (None where the part did not run)."""

    def get(*path: str) -> Any:
        node: Any = results
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    big = f"b{plan.key_batch}"
    keys = {
        "decode_floor_ratio_b1": get("decode", "b1", "floor_ratio"),
        "decode_floor_ratio_b64": get("decode", big, "floor_ratio"),
        "prefill_mfu_4k": get("prefill", str(plan.key_len), "mfu"),
        "hf_decode_speedup_b64": get("hf", big, "speedup"),
        "transfer_vs_nccl_4k": get("pd", "transfer", str(plan.key_len), "channel_vs_nccl"),
        "transfer_visible_fraction_4k": get("pd", "ttft", str(plan.key_len), "layers_visible_fraction"),
    }
    return keys


def verdicts(keys: dict) -> dict:
    out = {}
    for key, value in keys.items():
        target, sense = TARGETS[key]
        if value is None:
            out[key] = "not run"
        else:
            ok = value <= target if sense == "<=" else value >= target
            out[key] = "met" if ok else "missed"
    return out


def markdown(results: dict) -> str:
    keys, verdict = results["keys"], results["verdicts"]
    ceil = results.get("ceilings", {})
    lines = [
        f"# GPU benchmark: {results['device_kind']} ({results['date']})",
        "",
        f"{results['device_name']}, torch {results['versions']['torch']}, triton {results['versions'].get('triton')}, "
        f"transformers {results['versions'].get('transformers')}. Model: {results['model']} shape, random bf16 "
        f"weights. Ceilings measured in this run: copy {ceil.get('copy_tb_per_s', float('nan')):.2f} TB/s "
        f"(read + write), bf16 matmul {ceil.get('matmul_tflops', float('nan')):.0f} TFLOP/s.",
        "",
        "| key | value | target | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for key, value in keys.items():
        target, sense = TARGETS[key]
        shown = "—" if value is None else f"{value:.3f}"
        lines.append(f"| {key} | {shown} | {sense} {target} | {verdict[key]} |")
    dec = results.get("decode", {})
    if dec:
        lines += ["", f"## Decode step (context ~{dec.get('context')} tokens, whole engine step)", "",
                  "| batch | step ms | graph replay ms | floor ms | step / floor | replay / floor | host: schedule ms | host: runner ms | eager step ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key, row in dec.items():
            if key.startswith("b") and isinstance(row, dict):
                lines.append(f"| {key[1:]} | {row['step_ms']:.3f} | {_fmt(row.get('graph_replay_ms'))} | "
                             f"{row['floor_ms']:.3f} | {row['floor_ratio']:.2f} | {_fmt(row.get('graph_floor_ratio'), '.2f')} | "
                             f"{row['host_schedule_ms']:.3f} | {row['host_runner_ms']:.3f} | {_fmt(row.get('eager_step_ms'))} |")
    pre = results.get("prefill", {})
    if pre:
        lines += ["", "## Prefill (one fresh prompt per step)", "", "| tokens | ms | tokens/s | TFLOP/s | MFU |",
                  "| --- | --- | --- | --- | --- |"]
        for n, row in pre.items():
            lines.append(f"| {n} | {row['ms']:.2f} | {row['tokens_per_s']:.0f} | {row['tflops']:.0f} | {row['mfu']:.3f} |")
    hf = results.get("hf", {})
    if hf:
        lines += ["", "## transformers generate() on the same weights", "",
                  "| batch | HF step ms | our step ms | speedup |", "| --- | --- | --- | --- |"]
        for key, row in hf.items():
            if key.startswith("b") and isinstance(row, dict):
                lines.append(f"| {key[1:]} | {row['step_ms']:.2f} | {_fmt(row.get('our_step_ms'))} | "
                             f"{_fmt(row.get('speedup'), '.1f')} |")
    pd = results.get("pd", {})
    if pd.get("transfer"):
        lines += ["", f"## KV transfer {pd.get('p_device')} -> {pd.get('d_device')} ({pd.get('backend')})", "",
                  "| tokens | MB | raw NCCL ms | channel ms | channel / raw | whole handover ms | layer-wise handover ms | P gather ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n, row in pd["transfer"].items():
            lines.append(f"| {n} | {row['bytes'] / 1e6:.0f} | {row['raw_nccl_ms']:.3f} | {row['channel_ms']:.3f} | "
                         f"{row['channel_vs_nccl']:.2f} | {row['handover_whole_ms']:.3f} | "
                         f"{row['handover_layers_ms']:.3f} | {row['gather_ms']:.3f} |")
    if pd.get("ttft"):
        lines += ["", "## Transfer visible in the handover (job start -> KV committed on D)", "",
                  "| tokens | prefill ms | layer-wise ms | whole ms | transfer alone ms | visible, layer-wise | visible, whole | first token ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n, row in pd["ttft"].items():
            lines.append(f"| {n} | {_fmt(row.get('prefill_ms'))} | {row['layers_handover_ms']:.2f} | "
                         f"{row['whole_handover_ms']:.2f} | {_fmt(row.get('standalone_transfer_ms'))} | "
                         f"{_fmt(row.get('layers_visible_fraction'))} | {_fmt(row.get('whole_visible_fraction'))} | "
                         f"{row['layers_first_token_ms']:.2f} |")
    hit = pd.get("prefix_hit_75")
    if hit:
        lines += ["", f"75% prefix hit on D ({hit['tokens']} tokens): {hit['bytes'] / 1e6:.0f} MB moved instead of "
                  f"{hit['bytes_no_hit'] / 1e6:.0f} MB ({hit['bytes_fraction']:.2f}); transfer pool to pool "
                  f"{_fmt(hit['transfer_ms'])} ms vs {_fmt(hit['transfer_ms_no_hit'])} ms; handover "
                  f"{hit['handover_ms']:.1f} ms vs {hit['handover_ms_no_hit']:.1f} ms."]
    small = results.get("small_model")
    if small and "decode" in small:
        lines += ["", f"## {small['model']} shape (the default model), random weights", "",
                  "| batch | step ms | floor ms | step / floor | eager step ms |", "| --- | --- | --- | --- | --- |"]
        for key, row in small["decode"].items():
            if key.startswith("b") and isinstance(row, dict):
                lines.append(f"| {key[1:]} | {row['step_ms']:.3f} | {row['floor_ms']:.3f} | {row['floor_ratio']:.2f} | "
                             f"{_fmt(row.get('eager_step_ms'))} |")
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {part}: {msg}" for part, msg in results["errors"].items()]
    lines += ["", "Definitions: see the module docstring of `pd_cluster/bench/gpu.py` and `docs/benchmarks/README.md`.", ""]
    return "\n".join(lines)


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec)


def short_table(results: dict) -> str:
    rows = [f"{'key':34s} {'value':>9s}  target    verdict"]
    for key, value in results["keys"].items():
        target, sense = TARGETS[key]
        shown = "-" if value is None else f"{value:.3f}"
        rows.append(f"{key:34s} {shown:>9s}  {sense}{target:<6}  {results['verdicts'][key]}")
    return "\n".join(rows)


def run(plan: Plan, out_dir: Path) -> dict:
    import transformers
    import triton

    on_gpu = torch.cuda.is_available()
    dev0 = torch.device("cuda:0" if on_gpu else "cpu")
    dev1 = torch.device("cuda:1") if on_gpu and torch.cuda.device_count() >= 2 else (None if on_gpu else dev0)
    gen = torch.Generator().manual_seed(0)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    kind = device_kind()
    results: dict[str, Any] = {
        "device_kind": kind,
        "device_name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "device_count": torch.cuda.device_count(),
        "date": date,
        "quick": plan.quick,
        "model": json.loads(plan.big_config.read_text())["_name_or_path"],
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "errors": {},
    }
    stem = f"gpu-{kind}-{date}" + ("-quick" if plan.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["keys"] = summarize(results, plan)
        results["verdicts"] = verdicts(results["keys"])
        results["targets"] = {k: {"target": t, "sense": s} for k, (t, s) in TARGETS.items()}
        (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str))
        (out_dir / f"{stem}.md").write_text(markdown(results))

    def part(name: str, fn: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            value = fn()
            results[name] = value
            return value
        except Exception as e:  # one part failing must not lose the others
            logger.error("part %s failed:\n%s", name, traceback.format_exc())
            results["errors"][name] = f"{type(e).__name__}: {e}"
            return None
        finally:
            results.setdefault("part_seconds", {})[name] = round(time.monotonic() - started, 1)
            save()

    ceilings = part("ceilings", lambda: measure_ceilings(dev0)) or {}
    copy_bw = ceilings.get("copy_tb_per_s", 4.0)
    matmul = ceilings.get("matmul_tflops", 800.0)
    engine = part("engine_build", lambda: build_engine(
        plan.big_config, str(dev0), max_total_tokens=plan.kv_tokens, max_model_len=plan.max_model_len,
        max_running_requests=max(plan.decode_batches), max_num_batched_tokens=max(plan.transfer_lens + plan.prefill_lens),
        enable_prefix_cache=False, block_size=plan.block_size))
    if engine is not None:
        results["engine_build"] = {"kv_slots": engine.pool.capacity,
                                   "graph_sizes": engine.runner.graphs.batch_sizes if engine.runner.graphs else None}
        part("decode", lambda: measure_decode(engine, plan, copy_bw, gen, eager_batches=(1, plan.key_batch)))
        prefill = part("prefill", lambda: measure_prefill(engine, plan, plan.prefill_lens, matmul, gen)) or {}
        part("hf", lambda: measure_hf(engine, plan, plan.big_config, results.get("decode", {})))
        if dev1 is not None:
            part("pd", lambda: asyncio.run(measure_pd(engine, plan, plan.big_config, dev0, dev1, prefill, gen)))
        else:
            results["errors"]["pd"] = "needs two GPUs"
        del engine
    empty_cache()

    def small() -> dict:
        small_plan = Plan(plan.quick)
        small_plan.decode_batches = [1, plan.key_batch]
        small_engine = build_engine(plan.small_config, str(dev0), max_total_tokens=131072, max_model_len=8192,
                                    max_running_requests=plan.key_batch, max_num_batched_tokens=8192,
                                    enable_prefix_cache=False)
        out = {"model": json.loads(plan.small_config.read_text())["_name_or_path"],
               "decode": measure_decode(small_engine, small_plan, copy_bw, gen, eager_batches=(1, plan.key_batch)),
               "prefill": measure_prefill(small_engine, small_plan, [plan.key_len], matmul, gen)}
        small_plan.hf_batches = [plan.key_batch]
        out["hf"] = measure_hf(small_engine, small_plan, plan.small_config, out["decode"])
        return out

    part("small_model", small)
    save()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks every path in about a minute")
    parser.add_argument("--cpu", action="store_true", help="dry run of the code paths without a GPU (with --quick)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available() and not args.cpu:
        print("needs a CUDA device (or --cpu --quick for a dry run)", file=sys.stderr)
        return 2
    started = time.monotonic()
    results = run(Plan(args.quick), args.out)
    print(f"\n{results['device_kind']} {results['date']}  ({time.monotonic() - started:.0f} s; "
          f"parts: {results.get('part_seconds')})")
    if results["errors"]:
        print("errors:", json.dumps(results["errors"], indent=1))
    print(short_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
