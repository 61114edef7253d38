"""`pd-cluster local` with its default flags against each static placement on the same machine:
the saturation the default reaches over the best static one's, every configuration run the same
number of times in turn (A B C A B C ...), so that a slow minute of the machine falls on all alike.

    python -m pd_cluster.bench.served_adaptive --model DIR --model-shape llama3-8b --out OUT \\
        --static "pd=--prefill 1 --decode 1" --static "mixed1=--prefill 0 --decode 0 --mixed 1" --runs 3

Each run is one ``pd_cluster.bench.served`` process (a fresh cluster, a rate sweep to past
saturation); its JSON is kept beside this module's ``serve-adaptive-<kind>-<date>.json``, which
holds every run's saturation, each configuration's median and spread, and the key
``adaptive_vs_best_static_saturation_<N>gpu`` = the default's median / the best static median.
The summary is rewritten after every run, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The configuration `pd-cluster local` starts with no placement flags.
DEFAULT = "default"


def parse_static(items: list[str]) -> dict[str, str]:
    """``NAME=FLAGS`` items as ``{NAME: FLAGS}``; the name ``default`` is the default flags' own."""
    configs: dict[str, str] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name or name == DEFAULT or name in configs:
            raise ValueError(f"--static {item!r}: expected a new NAME=FLAGS (NAME not {DEFAULT!r})")
        configs[name] = flags
    if not configs:
        raise ValueError("at least one --static configuration is needed")
    return configs


def key_name(gpus: int) -> str:
    """The key's name for a machine of ``gpus`` GPUs (``_cpu`` without one)."""
    return f"adaptive_vs_best_static_saturation_{gpus}gpu" if gpus else "adaptive_vs_best_static_saturation_cpu"


def summarize(runs: dict[str, list[float]], gpus: int) -> dict[str, Any]:
    """Each configuration's median and spread of saturation (req/s) and the default's ratio to
    the best static median; the key is absent until the default and a static one both ran."""
    medians = {name: statistics.median(values) for name, values in runs.items() if values}
    doc: dict[str, Any] = {
        "saturation_runs": runs,
        "saturation_median": medians,
        "saturation_spread": {name: [min(v), max(v)] for name, v in runs.items() if v},
    }
    statics = {name: m for name, m in medians.items() if name != DEFAULT}
    if DEFAULT in medians and statics:
        best = max(statics, key=statics.__getitem__)
        doc["best_static"] = best
        doc[key_name(gpus)] = medians[DEFAULT] / statics[best]
    return doc


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_one(args: argparse.Namespace, name: str, flags: str, run: int) -> float:
    """One served run of one configuration; its saturation in requests per second."""
    tag = f"adaptive-{name}-r{run}"
    local_args = f"{args.common_args} {flags}".strip()
    cmd = [sys.executable, "-m", "pd_cluster.bench.served", "--model", str(args.model), "--out", str(args.out),
           "--local-args", local_args, "--sweep", args.sweep, "--requests-per-rate", str(args.requests_per_rate),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--cold-requests", "0",
           "--conversations", "0", "--output-path-lens", "", "--tag", tag]
    if args.model_shape:
        cmd += ["--model-shape", args.model_shape]
    logger.info("run %d of %s: %s", run, name, flags or "(default flags)")
    subprocess.run(cmd, check=True)
    found = sorted(args.out.glob(f"serve-*-{tag}.json"))
    if not found:
        raise RuntimeError(f"{name} run {run}: no results file")
    return float(json.loads(found[-1].read_text())["saturation_request_throughput"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--model-shape", default="")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--static", action="append", default=[], metavar="NAME=FLAGS",
                        help="a static placement's pd-cluster local flags (repeat)")
    parser.add_argument("--common-args", default="",
                        help="pd-cluster local flags of every configuration, default included (e.g. --load-format dummy)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sweep", default="24,32,40", help="offered rates, up to past saturation")
    parser.add_argument("--requests-per-rate", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configs = {DEFAULT: "", **parse_static(args.static)}
    args.out.mkdir(parents=True, exist_ok=True)
    from pd_cluster.bench.served import device_kind

    kind, gpus = device_kind(), gpu_count()
    path = args.out / f"serve-adaptive-{kind}-{dt.date.today().isoformat()}.json"
    head = {"device": kind, "date": dt.date.today().isoformat(), "model_shape": args.model_shape,
            "configs": configs, "common_args": args.common_args, "sweep": args.sweep, "requests_per_rate": args.requests_per_rate,
            "input_len": args.input_len, "output_len": args.output_len, "order": "each run: " + ", ".join(configs)}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for run in range(1, args.runs + 1):
        for name, flags in configs.items():
            runs[name].append(run_one(args, name, flags, run))
            path.write_text(json.dumps({**head, **summarize(runs, gpus)}, indent=2) + "\n")
    doc = json.loads(path.read_text())
    sys.stdout.write("\nconfiguration   saturation req/s (median [min, max])\n")
    for name in configs:
        low, high = doc["saturation_spread"][name]
        sys.stdout.write(f"{name:<15} {doc['saturation_median'][name]:.2f} [{low:.2f}, {high:.2f}]\n")
    key = key_name(gpus)
    sys.stdout.write(f"{key} = {doc.get(key, float('nan')):.3f} (best static: {doc.get('best_static')})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
