"""The GPU benchmark's tensor-parallel part set up on CPU (gloo, a tiny shape, dummy weights):
the floor is one rank's bytes, and the report carries the part's keys. No speed is asserted."""

from __future__ import annotations

import torch

from pd_cluster.bench.gpu.decode import WARM_STEPS, WARM_STEPS_AFTER_PREFILL
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.report import short_table, summarize, verdicts
from pd_cluster.bench.gpu.tp import build_tp_engine, measure_tp_decode
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import load_weights


def test_tp2_decode_floor_counts_one_ranks_shards_and_kv_heads():
    plan = Plan(quick=True)
    plan.key_batch, plan.decode_ctx, plan.decode_steps = 2, 24, 2
    engine = build_tp_engine(plan, "cpu", max_total_tokens=512, max_model_len=256, max_running_requests=2,
                             max_num_batched_tokens=256, dtype="float32")
    try:
        out = measure_tp_decode(engine, plan, copy_tb_per_s=1.0, gen=torch.Generator().manual_seed(0))
        config = engine.model_config
    finally:
        engine.close()
    rank0 = load_weights("unused", config, torch.float32, "cpu", Shard(0, 2), load_format="dummy")
    whole = load_weights("unused", config, torch.float32, "cpu", load_format="dummy")
    assert out["weight_bytes"] == rank0.decode_bytes() < whole.decode_bytes()
    assert out["rank_kv_bytes_per_token"] == engine.kv_spec.bytes_per_token // 2
    for batch in ("b1", "b2"):
        row = out[batch]
        assert row["floor_ms"] > 0 and row["floor_ratio"] == row["step_ms"] / row["floor_ms"]
        # The KV read is the rank's heads at the batch's contexts: the prompt's decode_ctx tokens a
        # row and the steps run since (the warm-up after the prefill, then each batch's).
        per_row = row["kv_bytes"] / out["rank_kv_bytes_per_token"] / int(batch[1:])
        ran = WARM_STEPS_AFTER_PREFILL + 2 * (WARM_STEPS + plan.decode_steps)
        assert plan.decode_ctx < per_row < plan.decode_ctx + ran + 2


def test_the_report_carries_the_tp_keys_and_reports_the_all_reduce_without_a_target():
    plan = Plan(quick=True)
    results = {"tp": {"tp": 2, "decode": {"b1": {"floor_ratio": 1.2}, f"b{plan.key_batch}": {"floor_ratio": 1.4}},
                      "allreduce": {"rows1": {"ours_us": 6.0, "nccl_us": 21.0}},
                      "hetero": {"transfer_vs_copy": 0.8, "visible_fraction": 0.1}}}
    keys = summarize(results, plan)
    assert {k: keys[k] for k in keys if k.startswith(("tp2", "hetero"))} == {
        "tp2_decode_floor_ratio_b1": 1.2, "tp2_decode_floor_ratio_b64": 1.4, "tp2_allreduce_us_b1": 6.0,
        "tp2_allreduce_nccl_us_b1": 21.0, "hetero_tp_transfer_vs_copy_4k": 0.8,
        "hetero_tp_transfer_visible_fraction_4k": 0.1}
    verdict = verdicts(keys)
    assert verdict["tp2_decode_floor_ratio_b1"] == "met" and verdict["tp2_decode_floor_ratio_b64"] == "missed"
    assert verdict["tp2_allreduce_us_b1"] == "reported" and verdict["hetero_tp_transfer_vs_copy_4k"] == "met"
    table = short_table({"keys": keys, "verdicts": verdict})
    assert "tp2_allreduce_nccl_us_b1" in table and "21.000" in table
