"""The GPU benchmark's mixture-of-experts part runs on CPU (a tiny Qwen3-MoE shape, random expert
weights, the torch reference): the floor counts the experts the batch routes to, the prefill the
active parameters, and the report carries both keys. No speed is asserted."""

from __future__ import annotations

import json

from pd_cluster.bench.gpu.__main__ import run
from pd_cluster.bench.gpu.moe import moe_config_file, moe_prefill_flops
from pd_cluster.bench.gpu.plan import CONFIGS, Plan
from pd_cluster.bench.gpu.report import short_table
from pd_cluster.model.config import ModelConfig

KEYS = ("moe_decode_floor_ratio_b64", "moe_prefill_mfu_4k")


def test_moe_part_counts_routed_experts_and_reports_its_keys(tmp_path):
    plan = Plan(quick=True)
    plan.parts = ["moe"]
    plan.key_batch, plan.decode_ctx, plan.decode_steps, plan.key_len = 2, 24, 2, 64
    results = run(plan, tmp_path)
    assert results["errors"] == {}
    for key in KEYS:
        assert results["keys"][key] is not None and results["verdicts"][key] != "not run", key
        assert key in short_table(results)
    row = results["moe"]["decode"]["b2"]
    cfg = json.loads(moe_config_file(plan).read_text())
    # Each of the two rows picks top_k distinct experts a layer, so a layer reads top_k to 2 * top_k
    # of them (fewer than all: a count of every expert, or of one row's, fails here).
    top_k = cfg["num_experts_per_tok"]
    assert 2 * top_k < cfg["num_experts"]
    assert top_k <= row["distinct_experts_per_layer"] <= 2 * top_k
    share = row["distinct_experts_per_layer"] / cfg["num_experts"]
    assert abs(row["routed_expert_bytes"] - share * row["all_expert_bytes"]) < 1
    assert row["reference_eager_step_ms"] > 0 and results["moe"]["prefill"]["64"]["mfu"] > 0


def test_qwen3_30b_a3b_prefill_counts_about_three_billion_active_parameters():
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()), "qwen3-30b-a3b")
    per_token = (moe_prefill_flops(cfg, 1) - cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim) / 2
    assert 2.9e9 < per_token < 3.2e9  # 3.3B published, of which the embedding table's 0.3B is never multiplied
