"""``python -m pd_cluster.bench.gpu.quant_repeats``: the decode-step quant keys over interleaved
repeats, a bf16 engine resident beside each quantized one, so that both sides of each ratio run
minutes apart at most and the spread of the ratios shows: the weight-bound keys
(``fp8_weights_decode_b1_vs_bf16`` and ``_b64``: bf16 weights against fp8 ones), then the KV-bound
one (``fp8_kv_decode_b64_ctx4k_vs_bf16``: bf16 KV against fp8 e4m3 KV, bf16 weights in both).

One repeat times the steps on the bf16 engine, then on the quantized one (the steps and contexts
of part ``quant``); each key is the median of its repeats' ratios. The weights' engine is closed
before the KV one opens (three 8B engines sized for the KV-heavy batch do not fit one GPU).
Writes ``gpu-quant-repeats-<device>-<date>.json`` (``--out``).

    python -m pd_cluster.bench.gpu.quant_repeats [--repeats 3] [--no-kv | --no-weights] [--cpu --quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
from pathlib import Path

import torch

from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.quant import KV_DTYPE, kv_heavy_decode, quant_engine, weight_quantization, weights_decode

logger = logging.getLogger(__name__)


def step_times(engine, plan: Plan, gen: torch.Generator) -> dict[str, float]:
    """Milliseconds a decode step by batch (``b1``, ``b64``)."""
    return _steps(weights_decode(engine, plan, 4.0, gen))


def kv_step_times(engine, plan: Plan, gen: torch.Generator) -> dict[str, float]:
    """Milliseconds a decode step of the key batch at the KV-heavy context."""
    return _steps(kv_heavy_decode(engine, plan, 4.0, gen))


def _steps(rows: dict) -> dict[str, float]:
    return {batch: row["step_ms"] for batch, row in rows.items() if isinstance(row, dict) and "step_ms" in row}


def _interleaved(engines: dict, times, plan: Plan, gen: torch.Generator, repeats: int) -> dict[str, list[dict]]:
    """Each engine's step times a repeat, the engines in turn within each repeat."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for repeat in range(repeats):
        for name, engine in engines.items():
            runs[name].append(times(engine, plan, gen))
        logger.info("repeat %d: %s", repeat, {n: r[-1] for n, r in runs.items()})
    return runs


def _ratio_keys(runs: dict[str, list[dict]], name: str, key, context: int) -> dict[str, dict]:
    """A key a batch (``key(batch)`` its name): the median of the repeats' ``name`` over bf16 ratios."""
    keys = {}
    for batch in runs["bf16"][0]:
        ratios = [q[batch] / b[batch] for q, b in zip(runs[name], runs["bf16"])]
        keys[key(batch)] = {"median": statistics.median(ratios), "ratios": ratios, "context": context,
                            "fp8_step_ms": [q[batch] for q in runs[name]],
                            "bf16_step_ms": [b[batch] for b in runs["bf16"]]}
    return keys


def _context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def measure(plan: Plan, device: torch.device, repeats: int, kv: bool = True, weights: bool = True) -> dict:
    gen = torch.Generator().manual_seed(0)
    method = weight_quantization(device)
    keys = {}
    with quant_engine(plan, device) as bf16:
        if weights:
            with quant_engine(plan, device, quantization=method) as fp8_weights:
                runs = _interleaved({"bf16": bf16, method: fp8_weights}, step_times, plan, gen, repeats)
            keys.update(_ratio_keys(runs, method, lambda batch: f"fp8_weights_decode_{batch}_vs_bf16",
                                    plan.decode_ctx))
        if kv:
            with quant_engine(plan, device, kv_cache_dtype=KV_DTYPE) as kv_engine:
                runs = _interleaved({"bf16": bf16, KV_DTYPE: kv_engine}, kv_step_times, plan, gen, repeats)
            label = _context_label(plan.kv_heavy_ctx)
            keys.update(_ratio_keys(runs, KV_DTYPE, lambda batch: f"fp8_kv_decode_{batch}_ctx{label}_vs_bf16",
                                    plan.kv_heavy_ctx))
    return {"quantization": method if weights else None, "kv_cache_dtype": KV_DTYPE if kv else None,
            "repeats": repeats, "keys": keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kv", action="store_true", help="the weight-bound keys only")
    parser.add_argument("--no-weights", action="store_true", help="the KV-bound key only")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --quick: a dry run)")
    parser.add_argument("--quick", action="store_true", help="a tiny model instead of the 8B shape")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    result = measure(Plan(quick=args.quick), device, args.repeats, kv=not args.no_kv, weights=not args.no_weights)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).lower().replace(" ", "-")
    path = args.out / f"gpu-quant-repeats-{name}-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    for key, row in result["keys"].items():
        logger.info("%s: median %.3f (%.3f-%.3f over %d repeats)", key, row["median"], min(row["ratios"]),
                    max(row["ratios"]), len(row["ratios"]))
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
