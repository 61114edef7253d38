"""``python -m pd_cluster.bench.gpu``: the run, part by part, saved after each part."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import pd_cluster.bench.gpu as package
from pd_cluster.bench.gpu.beam import WIDTH as BEAM_WIDTH, measure_beam
from pd_cluster.bench.gpu.ceilings import measure_ceilings
from pd_cluster.bench.gpu.local_prefill import measure_local_prefill
from pd_cluster.bench.gpu.decode import measure_decode
from pd_cluster.bench.gpu.grammar import measure_json_schema_overhead
from pd_cluster.bench.gpu.hf import measure_hf
from pd_cluster.bench.gpu.models import build_engine
from pd_cluster.bench.gpu.moe import measure_moe
from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.prefill import measure_prefill
from pd_cluster.bench.gpu.quant import measure_bf16, measure_fp8_kv, measure_fp8_weights, measure_kv_bytes, quant_info
from pd_cluster.bench.gpu.report import TARGETS, markdown, short_table, summarize, verdicts
from pd_cluster.bench.gpu.same_gpu import measure_same_gpu
from pd_cluster.bench.gpu.timing import empty_cache
from pd_cluster.bench.gpu.tp import measure_tp
from pd_cluster.bench.gpu.transfer import measure_pd

logger = logging.getLogger("pd_cluster.bench.gpu")


class Results:
    """The results of one run, written to ``<out>/<stem>.json`` and ``.md`` after every part."""

    def __init__(self, plan: Plan, out_dir: Path) -> None:
        import transformers
        import triton

        on_gpu = torch.cuda.is_available()
        date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        kind = device_kind()
        self.plan = plan
        self.data: dict[str, Any] = {
            "device_kind": kind,
            "device_name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
            "device_count": torch.cuda.device_count(),
            "date": date,
            "quick": plan.quick,
            "overlap_schedule": on_gpu if plan.overlap_schedule is None else plan.overlap_schedule,
            "model": json.loads(plan.big_config.read_text())["_name_or_path"],
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "transformers": transformers.__version__, "python": sys.version.split()[0]},
            "errors": {},
        }
        stem = f"gpu-{kind}-{date}" + ("-quick" if plan.quick else "")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"

    def save(self) -> None:
        results = self.data
        results["keys"] = summarize(results, self.plan)
        results["verdicts"] = verdicts(results["keys"])
        results["targets"] = {k: {"target": t, "sense": s} for k, (t, s) in TARGETS.items()}
        self.json_path.write_text(json.dumps(results, indent=2, default=str))
        self.md_path.write_text(markdown(results))

    def part(self, name: str, fn: Callable[[], Any], within: str | None = None) -> Any:
        """``results[name] = fn()`` (``results[within][name]`` for a step of a part), timed and
        saved; a failure is logged and recorded, not raised."""
        label = name if within is None else f"{within}.{name}"
        started = time.monotonic()
        try:
            value = fn()
            (self.data if within is None else self.data.setdefault(within, {}))[name] = value
            return value
        except Exception as e:  # one part failing must not lose the others
            logger.error("part %s failed:\n%s", label, traceback.format_exc())
            self.data["errors"][label] = f"{type(e).__name__}: {e}"
            return None
        finally:
            self.data.setdefault("part_seconds", {})[label] = round(time.monotonic() - started, 1)
            self.save()


def device_kind() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    return f"{name}-x{torch.cuda.device_count()}"


PARTS = ("decode", "prefill", "hf", "pd", "same_gpu", "peer_ipc", "small_model", "local_prefill", "json_schema",
         "beam", "quant", "tp", "moe")
#: The parts that build engines of their own rather than use the TP 1 engine of the big shape.
OWN_ENGINE_PARTS = {"small_model", "quant", "tp", "moe"}


def run(plan: Plan, out_dir: Path) -> dict:
    on_gpu = torch.cuda.is_available()
    dev0 = torch.device("cuda:0" if on_gpu else "cpu")
    dev1 = torch.device("cuda:1") if on_gpu and torch.cuda.device_count() >= 2 else (None if on_gpu else dev0)
    gen = torch.Generator().manual_seed(0)
    results = Results(plan, out_dir)
    ceilings = results.part("ceilings", lambda: measure_ceilings(dev0)) or {}
    copy_bw = ceilings.get("copy_tb_per_s", 4.0)
    matmul = ceilings.get("matmul_tflops", 800.0)
    if set(plan.parts) - OWN_ENGINE_PARTS:  # the parts on the TP 1 engine of the big shape
        run_big_model(results, plan, dev0, dev1, copy_bw, matmul, gen)
    empty_cache()
    if "quant" in plan.parts:  # after the big engine is freed: one engine of the big shape a variant
        run_quant(results, plan, dev0, ceilings, gen)
    if "tp" in plan.parts:
        if dev1 is not None and dev1.type == "cuda":
            results.part("tp", lambda: measure_tp(plan, copy_bw, gen))
        else:
            results.data["errors"]["tp"] = "needs two GPUs"
        empty_cache()
    if "moe" in plan.parts:
        results.part("moe", lambda: measure_moe(plan, dev0, copy_bw, matmul, gen))
        empty_cache()
    if "small_model" in plan.parts:
        results.part("small_model", lambda: measure_small_model(plan, dev0, copy_bw, matmul, gen))
    results.save()
    return results.data


def run_big_model(results: Results, plan: Plan, dev0: torch.device, dev1: torch.device | None, copy_bw: float,
                  matmul: float, gen: torch.Generator) -> None:
    """(a) to (f) and (i) on one engine of the big shape: decode, prefill, transformers, P -> D, beam search."""
    engine = results.part("engine_build", lambda: build_engine(
        plan.big_config, str(dev0), max_total_tokens=plan.kv_tokens, max_model_len=plan.max_model_len,
        max_running_requests=max(*plan.decode_batches, BEAM_WIDTH),
        max_num_batched_tokens=max(plan.transfer_lens + plan.prefill_lens),
        enable_prefix_cache=False, block_size=plan.block_size, overlap_schedule=plan.overlap_schedule))
    if engine is None:
        return
    data = results.data
    data["engine_build"] = {"kv_slots": engine.pool.capacity,
                            "graph_sizes": engine.runner.graphs.batch_sizes if engine.runner.graphs else None}
    if "decode" in plan.parts:
        results.part("decode", lambda: measure_decode(engine, plan, copy_bw, gen, eager_batches=(1, plan.key_batch)))
    if "local_prefill" in plan.parts:
        results.part("local_prefill", lambda: measure_local_prefill(engine, plan, gen))
    if "json_schema" in plan.parts:
        results.part("json_schema", lambda: measure_json_schema_overhead(engine, plan, gen))
    prefill = {}
    if "prefill" in plan.parts or "pd" in plan.parts:
        prefill = results.part("prefill", lambda: measure_prefill(engine, plan, plan.prefill_lens, matmul, gen)) or {}
    if "hf" in plan.parts:
        results.part("hf", lambda: measure_hf(engine, plan, plan.big_config, data.get("decode", {})))
    if "pd" in plan.parts:
        if dev1 is not None:
            results.part("pd", lambda: asyncio.run(measure_pd(engine, plan, plan.big_config, dev0, dev1, prefill, gen)))
        else:
            data["errors"]["pd"] = "needs two GPUs"
    if "same_gpu" in plan.parts and dev0.type == "cuda":
        results.part("same_gpu", lambda: asyncio.run(measure_same_gpu(engine, plan, plan.big_config, dev0, gen)))
    if "peer_ipc" in plan.parts and dev1 is not None and dev1.type == "cuda":
        results.part("peer_ipc", lambda: asyncio.run(
            measure_same_gpu(engine, plan, plan.big_config, dev0, gen, d_device=dev1)))
    if "beam" in plan.parts:
        results.part("beam", lambda: measure_beam(engine, plan, gen))


def run_quant(results: Results, plan: Plan, dev0: torch.device, ceilings: dict, gen: torch.Generator) -> None:
    """(h), a step a variant, each on an engine of its own freed before the next."""
    copy_bw = ceilings.get("copy_tb_per_s", 4.0)
    results.data["quant"] = quant_info(dev0)
    results.part("bf16", lambda: measure_bf16(plan, dev0, copy_bw, gen), within="quant")
    results.part("fp8_weights", lambda: measure_fp8_weights(plan, dev0, ceilings, gen), within="quant")
    results.part("fp8_kv", lambda: measure_fp8_kv(plan, dev0, copy_bw, gen), within="quant")
    results.part("kv_bytes", lambda: asyncio.run(measure_kv_bytes(plan, dev0, gen)), within="quant")
    empty_cache()


def measure_small_model(plan: Plan, dev0: torch.device, copy_bw: float, matmul: float, gen: torch.Generator) -> dict:
    """(a), (b) and (c) at the key sizes on the default model's shape; decode also at 2 and 4 rows,
    the batches a served node of a few streams mostly steps (the fused projections serve one row)."""
    small_plan = Plan(plan.quick)
    small_plan.decode_batches = sorted({1, 2, 4, plan.key_batch})
    small_engine = build_engine(plan.small_config, str(dev0), max_total_tokens=131072, max_model_len=8192,
                                max_running_requests=plan.key_batch, max_num_batched_tokens=8192,
                                enable_prefix_cache=False, overlap_schedule=plan.overlap_schedule)
    out = {"model": json.loads(plan.small_config.read_text())["_name_or_path"],
           "decode": measure_decode(small_engine, small_plan, copy_bw, gen, eager_batches=(1, plan.key_batch)),
           "prefill": measure_prefill(small_engine, small_plan, [plan.key_len], matmul, gen)}
    small_plan.hf_batches = [plan.key_batch]
    out["hf"] = measure_hf(small_engine, small_plan, plan.small_config, out["decode"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_cluster.bench.gpu",
                                     description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks every path in about a minute")
    parser.add_argument("--cpu", action="store_true", help="dry run of the code paths without a GPU (with --quick)")
    parser.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                        help="engines pipeline their steps (launch each before the last one's tokens are read "
                             "back), as nodes on a GPU do by default; --no-overlap-schedule: the plain order")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default: all of {', '.join(PARTS)})")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; expected some of {PARTS}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available() and not args.cpu:
        print("needs a CUDA device (or --cpu --quick for a dry run)", file=sys.stderr)
        return 2
    started = time.monotonic()
    plan = Plan(args.quick)
    plan.parts = parts
    plan.overlap_schedule = args.overlap_schedule
    results = run(plan, args.out)
    print(f"\n{results['device_kind']} {results['date']}  ({time.monotonic() - started:.0f} s; "
          f"parts: {results.get('part_seconds')})")
    if results["errors"]:
        print("errors:", json.dumps(results["errors"], indent=1))
    print(short_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
