"""What a run reports: the six headline keys against their targets, the markdown file, the short
table printed last."""

from __future__ import annotations

from typing import Any

from pd_cluster.bench.gpu.plan import Plan

TARGETS = {  # key: (target, "<=" lower is better / ">=" higher is better)
    "decode_floor_ratio_b1": (1.2, "<="),
    "decode_floor_ratio_b64": (1.2, "<="),
    "prefill_mfu_4k": (0.65, ">="),
    "hf_decode_speedup_b64": (8.0, ">="),
    "transfer_vs_nccl_4k": (0.80, ">="),
    "transfer_visible_fraction_4k": (0.25, "<="),
    "sampling_overhead_b64": (1.05, "<="),
    "json_schema_overhead_b64": (1.10, "<="),
    "small_model_floor_ratio_b1": (4.0, "<="),
    "same_gpu_transfer_vs_copy_4k": (0.70, ">="),
    "same_gpu_transfer_visible_fraction_4k": (0.25, "<="),
    "peer_ipc_transfer_vs_p2p_copy_4k": (0.90, ">="),
    "peer_ipc_transfer_visible_fraction_4k": (0.25, "<="),
    "tp2_decode_floor_ratio_b1": (1.35, "<="),
    "tp2_decode_floor_ratio_b64": (1.30, "<="),
    # Reported beside NCCL's own on the same group (no target).
    "tp2_allreduce_us_b1": (None, ""),
    "tp2_allreduce_nccl_us_b1": (None, ""),
    "hetero_tp_transfer_vs_copy_4k": (0.70, ">="),
    "hetero_tp_transfer_visible_fraction_4k": (0.25, "<="),
    "fp8_weights_decode_b1_vs_bf16": (0.62, "<="),
    "fp8_weights_decode_b64_vs_bf16": (0.75, "<="),
    "fp8_kv_decode_b64_ctx4k_vs_bf16": (0.85, "<="),
    "fp8_kv_transfer_bytes_ratio": (0.52, "<="),
    "fp8_prefill_mfu_4k": (0.6, ">="),
    "beam4_step_vs_b4_greedy": (1.15, "<="),
    "moe_decode_floor_ratio_b64": (1.5, "<="),
    "moe_prefill_mfu_4k": (0.5, ">="),
}


def summarize(results: dict, plan: Plan) -> dict:
    """The headline ratios (None where the part did not run)."""

    def get(*path: str) -> Any:
        node: Any = results
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def ratio(num: Any, den: Any) -> float | None:
        return None if num is None or not den else num / den

    def quant_step(variant: str, shape: str, batch: str) -> float | None:
        return get("quant", variant, shape, batch, "step_ms")

    big = f"b{plan.key_batch}"
    return {
        "decode_floor_ratio_b1": get("decode", "b1", "floor_ratio"),
        "decode_floor_ratio_b64": get("decode", big, "floor_ratio"),
        "prefill_mfu_4k": get("prefill", str(plan.key_len), "mfu"),
        "hf_decode_speedup_b64": get("hf", big, "speedup"),
        "transfer_vs_nccl_4k": get("pd", "transfer", str(plan.key_len), "channel_vs_nccl"),
        "transfer_visible_fraction_4k": get("pd", "ttft", str(plan.key_len), "layers_visible_fraction"),
        "sampling_overhead_b64": get("decode", "sampling", "overhead"),
        "json_schema_overhead_b64": get("json_schema", "overhead"),
        "small_model_floor_ratio_b1": get("small_model", "decode", "b1", "floor_ratio"),
        "same_gpu_transfer_vs_copy_4k": get("same_gpu", "write", str(plan.key_len), "write_vs_copy"),
        "same_gpu_transfer_visible_fraction_4k": get("same_gpu", "handover", str(plan.key_len),
                                                     "layers_visible_fraction"),
        "peer_ipc_transfer_vs_p2p_copy_4k": get("peer_ipc", "write", str(plan.key_len), "write_vs_copy"),
        "peer_ipc_transfer_visible_fraction_4k": get("peer_ipc", "handover", str(plan.key_len),
                                                     "layers_visible_fraction"),
        "tp2_decode_floor_ratio_b1": get("tp", "decode", "b1", "floor_ratio"),
        "tp2_decode_floor_ratio_b64": get("tp", "decode", big, "floor_ratio"),
        "tp2_allreduce_us_b1": get("tp", "allreduce", "rows1", "ours_us"),
        "tp2_allreduce_nccl_us_b1": get("tp", "allreduce", "rows1", "nccl_us"),
        "hetero_tp_transfer_vs_copy_4k": get("tp", "hetero", "transfer_vs_copy"),
        "hetero_tp_transfer_visible_fraction_4k": get("tp", "hetero", "visible_fraction"),
        "fp8_weights_decode_b1_vs_bf16": ratio(quant_step("fp8_weights", "decode", "b1"),
                                               quant_step("bf16", "decode", "b1")),
        "fp8_weights_decode_b64_vs_bf16": ratio(quant_step("fp8_weights", "decode", big),
                                                quant_step("bf16", "decode", big)),
        "fp8_kv_decode_b64_ctx4k_vs_bf16": ratio(quant_step("fp8_kv", "decode_kv", big),
                                                 quant_step("bf16", "decode_kv", big)),
        "fp8_kv_transfer_bytes_ratio": get("quant", "kv_bytes", "bytes_ratio"),
        "fp8_prefill_mfu_4k": get("quant", "fp8_weights", "prefill", str(plan.key_len), "mfu"),
        "beam4_step_vs_b4_greedy": get("beam", "ratio"),
        "moe_decode_floor_ratio_b64": get("moe", "decode", big, "floor_ratio"),
        "moe_prefill_mfu_4k": get("moe", "prefill", str(plan.key_len), "mfu"),
    }


def verdicts(keys: dict) -> dict:
    out = {}
    for key, value in keys.items():
        target, sense = TARGETS[key]
        if value is None:
            out[key] = "not run"
        elif target is None:
            out[key] = "reported"
        else:
            ok = value <= target if sense == "<=" else value >= target
            out[key] = "met" if ok else "missed"
    return out


def markdown(results: dict) -> str:
    pd = results.get("pd", {})
    lines = [
        *_headline(results),
        *_decode_section(results.get("decode", {})),
        *_prefill_section(results.get("prefill", {})),
        *_hf_section(results.get("hf", {})),
        *_transfer_section(pd),
        *_ttft_section(pd),
        *_prefix_hit_section(pd),
        *_same_gpu_section(results.get("same_gpu", {})),
        *_same_gpu_section(results.get("peer_ipc", {})),
        *_small_model_section(results.get("small_model")),
        *_tp_section(results.get("tp")),
        *_quant_section(results.get("quant")),
        *_beam_section(results.get("beam")),
    ]
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {part}: {msg}" for part, msg in results["errors"].items()]
    lines += ["", "Definitions: see the docstring of `pd_cluster/bench/gpu/__init__.py` and `docs/benchmarks/README.md`.",
              ""]
    return "\n".join(lines)


def _same_gpu_section(same: dict) -> list[str]:
    if not same:
        return []
    where = "one GPU" if same.get("device") == same.get("d_device", same.get("device")) else "two GPUs, peer access"
    lines = _table(f"## P and D on {where} ({same.get('transport')}): the in-place write",
                   ["tokens", "MB", "write ms", "copy ms", "write / copy speed", "GB/s"])
    for row in same.get("write", {}).values():
        lines.append(f"| {row['tokens']} | {row['bytes'] / 1e6:.0f} | {_fmt(row['write_ms'])} | {_fmt(row['copy_ms'])} | "
                     f"{_fmt(row['write_vs_copy'])} | {_fmt(row['write_gb_per_s'])} |")
    lines += _table(f"## P and D on {where}: first token, KV in D, commit (ms from the job's start)",
                    ["tokens", "first token", "KV committed (layer-wise)", "visible after first token (layer-wise)",
                     "visible (whole)", "visible fraction (layer-wise)", "first token ahead of commit"])
    for row in same.get("handover", {}).values():
        lines.append(f"| {row['tokens']} | {_fmt(row['layers_first_token_ms'])} | {_fmt(row['layers_handover_ms'])} | "
                     f"{_fmt(row['layers_visible_ms'])} | {_fmt(row['whole_visible_ms'])} | "
                     f"{_fmt(row.get('layers_visible_fraction'))} | {_fmt(row['first_token_lead_ms'])} |")
    return lines


def short_table(results: dict) -> str:
    rows = [f"{'key':38s} {'value':>9s}  target    verdict"]
    for key, value in results["keys"].items():
        target, sense = TARGETS[key]
        shown = "-" if value is None else f"{value:.3f}"
        goal = "-" if target is None else f"{sense}{target}"
        rows.append(f"{key:38s} {shown:>9s}  {goal:<8}  {results['verdicts'][key]}")
    return "\n".join(rows)


# ---- markdown sections ----------------------------------------------------------------------------


def _headline(results: dict) -> list[str]:
    keys, verdict = results["keys"], results["verdicts"]
    ceil = results.get("ceilings", {})
    lines = [
        f"# GPU benchmark: {results['device_kind']} ({results['date']})",
        "",
        f"{results['device_name']}, torch {results['versions']['torch']}, triton {results['versions'].get('triton')}, "
        f"transformers {results['versions'].get('transformers')}. Model: {results['model']} shape, random bf16 "
        f"weights. Ceilings measured in this run: copy {ceil.get('copy_tb_per_s', float('nan')):.2f} TB/s "
        f"(read + write), bf16 matmul {ceil.get('matmul_tflops', float('nan')):.0f} TFLOP/s, fp8 matmul "
        f"{_fmt(ceil.get('fp8_matmul_tflops'), '.0f')} TFLOP/s.",
        "",
        "| key | value | target | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for key, value in keys.items():
        target, sense = TARGETS[key]
        shown = "—" if value is None else f"{value:.3f}"
        lines.append(f"| {key} | {shown} | {'—' if target is None else f'{sense} {target}'} | {verdict[key]} |")
    return lines


def _batch_rows(part: dict) -> list[tuple[str, dict]]:
    """A decode-like part's per-batch rows (keys ``b<batch>``), as (batch, row)."""
    return [(key[1:], row) for key, row in part.items() if key.startswith("b") and isinstance(row, dict)]


def _table(title: str, header: list[str]) -> list[str]:
    return ["", title, "", "| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * len(header)) + " |"]


def _decode_section(dec: dict) -> list[str]:
    if not dec:
        return []
    lines = _table(f"## Decode step (context ~{dec.get('context')} tokens, whole engine step)",
                   ["batch", "step ms", "graph replay ms", "floor ms", "step / floor", "replay / floor",
                    "host: schedule ms", "host: runner ms", "eager step ms"])
    for batch, row in _batch_rows(dec):
        lines.append(f"| {batch} | {row['step_ms']:.3f} | {_fmt(row.get('graph_replay_ms'))} | "
                     f"{row['floor_ms']:.3f} | {row['floor_ratio']:.2f} | {_fmt(row.get('graph_floor_ratio'), '.2f')} | "
                     f"{row['host_schedule_ms']:.3f} | {row['host_runner_ms']:.3f} | {_fmt(row.get('eager_step_ms'))} |")
    return lines


def _prefill_section(pre: dict) -> list[str]:
    if not pre:
        return []
    lines = _table("## Prefill (one fresh prompt per step)", ["tokens", "ms", "tokens/s", "TFLOP/s", "MFU"])
    for n, row in pre.items():
        lines.append(f"| {n} | {row['ms']:.2f} | {row['tokens_per_s']:.0f} | {row['tflops']:.0f} | {row['mfu']:.3f} |")
    return lines


def _hf_section(hf: dict) -> list[str]:
    if not hf:
        return []
    lines = _table("## transformers generate() on the same weights", ["batch", "HF step ms", "our step ms", "speedup"])
    for batch, row in _batch_rows(hf):
        lines.append(f"| {batch} | {row['step_ms']:.2f} | {_fmt(row.get('our_step_ms'))} | "
                     f"{_fmt(row.get('speedup'), '.1f')} |")
    return lines


def _transfer_section(pd: dict) -> list[str]:
    if not pd.get("transfer"):
        return []
    lines = _table(f"## KV transfer {pd.get('p_device')} -> {pd.get('d_device')} ({pd.get('backend')})",
                   ["tokens", "MB", "raw NCCL ms", "channel ms", "channel / raw", "whole handover ms",
                    "layer-wise handover ms", "P gather ms"])
    for n, row in pd["transfer"].items():
        lines.append(f"| {n} | {row['bytes'] / 1e6:.0f} | {row['raw_nccl_ms']:.3f} | {row['channel_ms']:.3f} | "
                     f"{row['channel_vs_nccl']:.2f} | {row['handover_whole_ms']:.3f} | "
                     f"{row['handover_layers_ms']:.3f} | {row['gather_ms']:.3f} |")
    return lines


def _ttft_section(pd: dict) -> list[str]:
    if not pd.get("ttft"):
        return []
    lines = _table("## Transfer visible in the handover (job start -> KV committed on D)",
                   ["tokens", "prefill ms", "layer-wise ms", "whole ms", "transfer alone ms", "visible, layer-wise",
                    "visible, whole", "first token ms"])
    for n, row in pd["ttft"].items():
        lines.append(f"| {n} | {_fmt(row.get('prefill_ms'))} | {row['layers_handover_ms']:.2f} | "
                     f"{row['whole_handover_ms']:.2f} | {_fmt(row.get('standalone_transfer_ms'))} | "
                     f"{_fmt(row.get('layers_visible_fraction'))} | {_fmt(row.get('whole_visible_fraction'))} | "
                     f"{row['layers_first_token_ms']:.2f} |")
    return lines


def _prefix_hit_section(pd: dict) -> list[str]:
    hit = pd.get("prefix_hit_75")
    if not hit:
        return []
    return ["", f"75% prefix hit on D ({hit['tokens']} tokens): {hit['bytes'] / 1e6:.0f} MB moved instead of "
            f"{hit['bytes_no_hit'] / 1e6:.0f} MB ({hit['bytes_fraction']:.2f}); transfer pool to pool "
            f"{_fmt(hit['transfer_ms'])} ms vs {_fmt(hit['transfer_ms_no_hit'])} ms; handover "
            f"{hit['handover_ms']:.1f} ms vs {hit['handover_ms_no_hit']:.1f} ms."]


def _small_model_section(small: dict | None) -> list[str]:
    if not small or "decode" not in small:
        return []
    lines = _table(f"## {small['model']} shape (the default model), random weights",
                   ["batch", "step ms", "floor ms", "step / floor", "eager step ms"])
    for batch, row in _batch_rows(small["decode"]):
        lines.append(f"| {batch} | {row['step_ms']:.3f} | {row['floor_ms']:.3f} | {row['floor_ratio']:.2f} | "
                     f"{_fmt(row.get('eager_step_ms'))} |")
    return lines


def _tp_section(tp: dict | None) -> list[str]:
    if not tp:
        return []
    lines = _table(f"## TP {tp.get('tp')}: decode step against one rank's floor (its shards, its KV heads)",
                   ["batch", "step ms", "floor ms", "step / floor"])
    for batch, row in _batch_rows(tp.get("decode", {})):
        lines.append(f"| {batch} | {row['step_ms']:.3f} | {row['floor_ms']:.3f} | {row['floor_ratio']:.2f} |")
    reduce = tp.get("allreduce", {})
    lines += _table(f"## TP {tp.get('tp')}: all-reduce of a decode step's rows, a call in a CUDA graph "
                    f"(one-shot: {reduce.get('one_shot')})", ["rows", "bytes", "ours us", "NCCL us", "NCCL / ours"])
    for key, row in reduce.items():
        if key.startswith("rows"):
            lines.append(f"| {key[4:]} | {row['bytes']} | {row['ours_us']:.2f} | {row['nccl_us']:.2f} | "
                         f"{row['nccl_vs_ours']:.2f} |")
    het = tp.get("hetero")
    if het:
        lines += ["", f"P TP 1 -> D TP {tp.get('tp')} ({het['tokens']} tokens, {het.get('transport')}): transfer "
                  f"{het['transfer_ms']:.2f} ms (whole handover {het['whole_handover_ms']:.2f} ms less the prefill "
                  f"{het['prefill_ms']:.2f} ms) vs a copy into the D ranks' GPUs {het['copy_ms']:.2f} ms "
                  f"({het['transfer_vs_copy']:.2f}); layer-wise handover {het['layers_handover_ms']:.2f} ms, "
                  f"visible fraction {het['visible_fraction']:.2f}."]
    return lines


def _quant_section(quant: dict | None) -> list[str]:
    if not quant:
        return []
    method = quant.get("weight_quantization")
    lines = _table(f"## Quantized weights ({method}) and KV ({quant.get('kv_cache_dtype')}): decode step ms, "
                   "same batches and contexts", ["step", "bf16", f"{method} weights", "weights / bf16",
                                                 "fp8 KV", "KV / bf16"])
    for shape, label in (("decode", "context ~{}"), ("decode_kv", "KV-heavy, context ~{}")):
        base = quant.get("bf16", {}).get(shape, {})
        weights = quant.get("fp8_weights", {}).get(shape, {})
        kv = quant.get("fp8_kv", {}).get(shape, {})
        for batch, row in _batch_rows(base):
            w_ms = weights.get(f"b{batch}", {}).get("step_ms")
            kv_ms = kv.get(f"b{batch}", {}).get("step_ms")
            lines.append(f"| b{batch}, {label.format(base.get('context'))} | {row['step_ms']:.3f} | {_fmt(w_ms)} | "
                         f"{_fmt(w_ms and w_ms / row['step_ms'])} | {_fmt(kv_ms)} | "
                         f"{_fmt(kv_ms and kv_ms / row['step_ms'])} |")
    weights = quant.get("fp8_weights", {})
    for n, row in weights.get("prefill", {}).items():
        lines += ["", f"Prefill of {n} tokens with {method} weights: {row['ms']:.2f} ms, {row['tflops']:.0f} TFLOP/s, "
                  f"MFU {row['mfu']:.3f} against the {weights.get('mfu_rate')} rate."]
    moved = quant.get("kv_bytes")
    if moved:
        lines += ["", f"Handover of {moved['tokens']} tokens from a {moved['p_kv_dtype']} P: "
                  f"{moved['bf16']['bytes'] / 1e6:.1f} MB to a {moved['bf16']['d_kv_dtype']} D "
                  f"({moved['bf16']['transport']}), {moved['fp8']['bytes'] / 1e6:.1f} MB to a "
                  f"{moved['fp8']['d_kv_dtype']} D ({moved['fp8']['transport']}): {moved['bytes_ratio']:.3f}."]
    if quant.get("note"):
        lines += ["", f"Note: {quant['note']}."]
    return lines


def _beam_section(beam: dict | None) -> list[str]:
    if not beam:
        return []
    return ["", f"## Beam search, width {beam['width']}", "",
            f"A beam step {beam['beam_step_ms']:.3f} ms (context ~{beam['beam_mean_ctx']:.0f}) against a greedy step "
            f"of {beam['width']} rows {beam['greedy_step_ms']:.3f} ms (context ~{beam['greedy_mean_ctx']:.0f}, "
            f"{'pipelined' if beam['pipelined'] else 'not pipelined'}): {beam['ratio']:.3f}; median of "
            f"{beam['steps']} steps."]


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec)
