"""The GPU benchmark's quantization and beam parts run on CPU (a tiny random model, int8 weights
standing in for fp8): each variant times the same steps as the bf16 one, the KV bytes come from
the handover's counters, and the report carries the keys. No speed is asserted."""

from __future__ import annotations

import json
import statistics

import torch

from pd_cluster.bench.gpu.__main__ import run
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.quant_repeats import measure
from pd_cluster.bench.gpu.report import short_table
from pd_cluster.kv_spec import KVSpec

NEW_KEYS = ("fp8_weights_decode_b1_vs_bf16", "fp8_weights_decode_b64_vs_bf16", "fp8_kv_decode_b64_ctx4k_vs_bf16",
            "fp8_kv_transfer_bytes_ratio", "fp8_prefill_mfu_4k", "beam4_step_vs_b4_greedy")


def _tiny_plan() -> Plan:
    plan = Plan(quick=True)
    plan.parts = ["quant", "beam"]
    plan.key_batch, plan.decode_ctx, plan.decode_steps = 2, 24, 2
    plan.kv_heavy_ctx, plan.key_len, plan.kv_bytes_len = 40, 64, 64
    plan.beam_ctx, plan.beam_skip_steps, plan.beam_steps = 20, 3, 2
    return plan


def test_quant_and_beam_parts_measure_like_for_like_and_report_their_keys(tmp_path):
    plan = _tiny_plan()
    results = run(plan, tmp_path)
    assert results["errors"] == {}
    for key in NEW_KEYS:
        assert results["keys"][key] is not None and results["verdicts"][key] != "not run", key
        assert key in short_table(results)
    quant = results["quant"]
    assert quant["weight_quantization"] == quant["fp8_weights"]["quantization"] == "int8" and "int8" in quant["note"]
    assert quant["fp8_kv"]["kv_dtype"] == "fp8_e4m3" and quant["bf16"]["kv_dtype"] == "bfloat16"
    # Same contexts: the quantized weights' steps read the bf16 engine's KV bytes exactly...
    for batch in ("b1", "b2"):
        assert quant["fp8_weights"]["decode"][batch]["kv_bytes"] == quant["bf16"]["decode"][batch]["kv_bytes"]
    # ... and the fp8 KV steps the same tokens, each of fewer bytes.
    assert quant["fp8_kv"]["decode_kv"]["context"] == quant["bf16"]["decode_kv"]["context"] == plan.kv_heavy_ctx
    assert 0 < quant["fp8_kv"]["decode_kv"]["b2"]["kv_bytes"] < quant["bf16"]["decode_kv"]["b2"]["kv_bytes"]
    # The bytes are what the handover counted on both ends, for the same prompt.
    moved = quant["kv_bytes"]
    spec = KVSpec(model="m", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")  # tiny.json's KV
    for name, kv_dtype in (("bf16", "bfloat16"), ("fp8", "fp8_e4m3")):
        assert moved[name]["d_kv_dtype"] == kv_dtype
        assert moved[name]["bytes"] == moved[name]["d_bytes_received"]
        assert moved[name]["bytes"] == plan.kv_bytes_len * spec.with_kv_dtype(kv_dtype).bytes_per_token
    assert results["keys"]["fp8_kv_transfer_bytes_ratio"] == moved["fp8"]["bytes"] / moved["bf16"]["bytes"]
    beam = results["beam"]
    assert beam["width"] == 4 and abs(beam["beam_mean_ctx"] - beam["greedy_mean_ctx"]) <= 2
    [md] = tmp_path.glob("*.md")
    assert "## Quantized weights (int8)" in md.read_text() and "## Beam search, width 4" in md.read_text()
    [saved] = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["keys"] == results["keys"]


def test_quant_repeats_time_both_engines_each_repeat_and_take_the_median_ratio():
    """Two repeats on the tiny model (int8 standing in on a CPU): each key holds a ratio a repeat,
    each the repeat's own quantized step over its bf16 step, and their median; the weights' keys
    at the sweep's context, the KV key's at the KV-heavy one; ``kv=False``: the weights' alone."""
    plan = _tiny_plan()
    result = measure(plan, torch.device("cpu"), repeats=2)
    assert result["quantization"] == "int8" and result["repeats"] == 2 and result["kv_cache_dtype"] == "fp8_e4m3"
    big = f"b{plan.key_batch}"
    assert set(result["keys"]) == {"fp8_weights_decode_b1_vs_bf16", f"fp8_weights_decode_{big}_vs_bf16",
                                   f"fp8_kv_decode_{big}_ctx{plan.kv_heavy_ctx}_vs_bf16"}
    for key, row in result["keys"].items():
        assert len(row["ratios"]) == 2
        assert row["context"] == (plan.kv_heavy_ctx if key.startswith("fp8_kv") else plan.decode_ctx)
        for ratio, fp8, bf16 in zip(row["ratios"], row["fp8_step_ms"], row["bf16_step_ms"]):
            assert fp8 > 0 and bf16 > 0 and ratio == fp8 / bf16
        assert row["median"] == statistics.median(row["ratios"])
    assert set(measure(plan, torch.device("cpu"), repeats=1, kv=False)["keys"]) == {
        "fp8_weights_decode_b1_vs_bf16", f"fp8_weights_decode_{big}_vs_bf16"}
