"""``python -m pd_cluster.bench.gpu.quant_repeats``: the weight-bound quant keys
(``fp8_weights_decode_b1_vs_bf16`` and ``_b64``) over interleaved repeats, a bf16 and an fp8
engine resident side by side, so that both sides of each ratio run minutes apart at most and the
spread of the ratios shows.

One repeat times the decode steps of both batches on the bf16 engine, then on the fp8 one (the
steps and contexts of part ``quant``); each key is the median of its repeats' ratios. Writes
``gpu-quant-repeats-<device>-<date>.json`` (``--out``).

    python -m pd_cluster.bench.gpu.quant_repeats [--repeats 3] [--cpu --quick]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import statistics
from pathlib import Path

import torch

from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.quant import quant_engine, weight_quantization, weights_decode

logger = logging.getLogger(__name__)


def step_times(engine, plan: Plan, gen: torch.Generator) -> dict[str, float]:
    """Milliseconds a decode step by batch (``b1``, ``b64``)."""
    rows = weights_decode(engine, plan, 4.0, gen)
    return {batch: row["step_ms"] for batch, row in rows.items() if isinstance(row, dict) and "step_ms" in row}


def measure(plan: Plan, device: torch.device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    method = weight_quantization(device)
    runs: dict[str, list[dict[str, float]]] = {"bf16": [], method: []}
    with contextlib.ExitStack() as stack:
        engines = {"bf16": stack.enter_context(quant_engine(plan, device)),
                   method: stack.enter_context(quant_engine(plan, device, quantization=method))}
        for repeat in range(repeats):
            for name, engine in engines.items():
                runs[name].append(step_times(engine, plan, gen))
            logger.info("repeat %d: %s", repeat, {n: r[-1] for n, r in runs.items()})
    keys = {}
    for batch in runs["bf16"][0]:
        ratios = [q[batch] / b[batch] for q, b in zip(runs[method], runs["bf16"])]
        keys[f"fp8_weights_decode_{batch}_vs_bf16"] = {
            "median": statistics.median(ratios), "ratios": ratios,
            "fp8_step_ms": [q[batch] for q in runs[method]], "bf16_step_ms": [b[batch] for b in runs["bf16"]]}
    return {"quantization": method, "repeats": repeats, "keys": keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --quick: a dry run)")
    parser.add_argument("--quick", action="store_true", help="a tiny model instead of the 8B shape")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    result = measure(Plan(quick=args.quick), device, args.repeats)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).lower().replace(" ", "-")
    path = args.out / f"gpu-quant-repeats-{name}-{datetime.date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    for key, row in result["keys"].items():
        logger.info("%s: median %.3f (%.3f-%.3f over %d repeats)", key, row["median"], min(row["ratios"]),
                    max(row["ratios"]), len(row["ratios"]))
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
