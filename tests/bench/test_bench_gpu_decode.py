"""The GPU benchmark's decode part set up on CPU (a tiny random model): a ratio compares steps that
read the same KV lengths on both sides. Setup only: no speed is asserted."""

from __future__ import annotations

import torch

from pd_cluster.bench.gpu import decode
from pd_cluster.bench.gpu.models import build_engine
from pd_cluster.bench.gpu.plan import Plan


def _small_plan() -> Plan:
    plan = Plan(quick=True)
    plan.decode_batches = [4, 2]
    plan.key_batch = 2
    plan.decode_ctx = 24
    plan.decode_steps = 3
    return plan


def test_sampling_overhead_compares_greedy_and_sampled_steps_at_equal_contexts(monkeypatch):
    """The sampling key divides a sampled step by a greedy one: both must be timed at the same
    contexts, not the greedy row of the batch sweep (whose contexts grew over the larger batches)."""
    plan = _small_plan()
    engine = build_engine(plan.big_config, "cpu", max_total_tokens=1024, max_model_len=256, max_running_requests=4,
                          max_num_batched_tokens=256, enable_prefix_cache=False, block_size=plan.block_size)
    timed: list[tuple[float, int, float]] = []  # (step ms, batch, mean sum of contexts) of each timed run
    time_decode_steps = decode.time_decode_steps

    def recording(engine_, reqs, steps):
        row = time_decode_steps(engine_, reqs, steps)
        timed.append((row["step_ms"], len(reqs), row["mean_ctx_sum"]))
        return row

    monkeypatch.setattr(decode, "time_decode_steps", recording)
    out = decode.measure_decode(engine, plan, copy_tb_per_s=1.0, gen=torch.Generator().manual_seed(0))
    sampling = out["sampling"]
    contexts = {}
    for side in ("greedy", "sampled"):
        [(batch, ctx_sum)] = {(b, c) for ms, b, c in timed if ms == sampling[f"{side}_step_ms"]}
        contexts[side] = ctx_sum
        assert batch == plan.key_batch, side
    assert contexts["greedy"] == contexts["sampled"]
