"""The served system, measured as users run it: ``pd-cluster local`` started with its default
flags, then ``bench serve`` through the master (cold start, a rate sweep, multi-turn), beside
the same engine colocated on the same GPU (offline ``LLM``, every request at once: the ceiling a
P/D split on that GPU is held to), and the output path (TTFT with the first token sent by P, as
the master does by default, against a master that waits for D's first tokens).

    python -m pd_cluster.bench.served --model DIR --out docs/benchmarks --sweep 2,4,8,16

Writes ``serve-<kind>-<date>.json`` (every run, the placement table, time to ready), a markdown
table beside it and the plots of the sweep. The cold-start figure is the first request's TTFT
against the p50 TTFT of the requests after it, in one low-rate run right after the cluster is
ready: the first request pays whatever the cluster left for later (channels, kernels, graphs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import math

from pd_cluster.bench.compare import model_words, slo_goodput
from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.report import format_table, results_document
from pd_cluster.bench.serve.runner import SweepResult, run_serve_bench
from pd_cluster.bench.local_process import LocalClusterProcess, node_capacities, placement_table

logger = logging.getLogger(__name__)


def device_kind() -> str:
    """``nvidia-h100-x1``-style name of this machine's GPUs, or ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    chip = next((c for c in ("h200", "h100", "a100", "l40s", "b200") if c in name), name.split()[-1])
    return f"nvidia-{chip}-x{torch.cuda.device_count()}"


def colocated_baseline(model: str, input_len: int, output_len: int, requests: int, seed: int = 7) -> dict[str, Any]:
    """The same engine alone on the GPU, no HTTP: every request submitted at once; requests and
    output tokens per second. The GPU is left empty for the cluster afterwards."""
    import gc
    import random

    import torch

    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams

    llm = LLM(model)
    try:
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(requests)]
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[: min(8, requests)], params)  # warm: graphs, kernels
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"requests": requests, "input_len": input_len, "output_len": output_len, "seconds": seconds,
            "request_throughput": requests / seconds, "output_throughput": tokens / seconds}


def ttft_probe(base: ServeBenchConfig, lens: list[int], requests: int, out_dir: Path, name: str) -> dict[str, Any]:
    """TTFT p50/p90 at each prompt length, one request at a time (no queueing in the figure)."""
    out: dict[str, Any] = {}
    for n in lens:
        sweep = _run(replace(base, num_requests=requests, input_len=n, output_len=16, rates=[math.inf],
                             max_concurrency=1, seed=4000 + n), f"{name} {n} tokens", out_dir)
        result = results_document(sweep)["results"][0]
        out[str(n)] = {"ttft_p50_s": result["ttft"].get("p50"), "ttft_p90_s": result["ttft"].get("p90"),
                       "completed": result["completed"], "failed": result["failed"]}
    return out


def cold_start(sweep: SweepResult) -> dict[str, Any]:
    """First request's TTFT (by send time) against the p50 TTFT of the rest, in one run."""
    records = sorted((r for r in sweep.results[0].records if r.ok and r.ttft is not None), key=lambda r: r.start)
    if len(records) < 3:
        raise RuntimeError("cold start: too few completed requests to compare")
    first, rest = records[0].ttft, [r.ttft for r in records[1:]]
    warm = statistics.median(rest)
    return {"first_ttft_s": first, "warm_ttft_p50_s": warm, "ratio": first / warm, "requests": len(records)}


def overload_counts(sweep: SweepResult) -> dict[str, int]:
    """What overload did to the sweep's requests: ``overload_failed_requests``, those the cluster
    accepted and did not finish (an error, or a stream that ended without a finish reason), which a
    busy cluster must never have; ``overload_rejected_requests``, those answered 429 at the door."""
    records = [record for result in sweep.results for record in result.records]
    rejected = [r for r in records if r.error == "HTTP 429"]
    failed = [r for r in records if r.error != "HTTP 429" and (r.error is not None or r.finish_reason is None)]
    return {"overload_failed_requests": len(failed), "overload_rejected_requests": len(rejected)}


def sampled_sweep_config(base: ServeBenchConfig, sweep_rates: list[float], rates: list[float]) -> ServeBenchConfig:
    """The random workload again at temperature 0.8, its rates seeded past the greedy sweep's: its
    prompts are new to the cluster, as the greedy sweep's were, rather than served from the prefix
    cache that sweep filled (no prefill, no KV moved), so the two decodes compare alike."""
    return replace(base, temperature=0.8, rates=rates, seed=base.seed + len(sweep_rates))


def sampled_vs_greedy(greedy: dict[str, Any], sampled: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rate both sweeps ran: temperature 0.8's TPOT and ITL p50 over greedy's (the sampling
    cost as a client sees it; 1.0 is free). A rate either sweep lacks, or a p50 it has none of
    (no request streamed two tokens), gives no row."""
    by_rate = {r["rate"]: r for r in greedy["results"]}
    rows = []
    for r in sampled["results"]:
        g = by_rate.get(r["rate"])
        if g is None:
            continue
        row: dict[str, Any] = {"rate": r["rate"]}
        for metric in ("tpot", "itl"):
            num, den = r[metric].get("p50"), g[metric].get("p50")
            row[f"{metric}_p50_ratio"] = num / den if num is not None and den else None
        if row["tpot_p50_ratio"] is not None:
            rows.append(row)
    return rows


def _run(config: ServeBenchConfig, name: str, out_dir: Path) -> SweepResult:
    logger.info("bench serve: %s", name)
    sweep = run_serve_bench(config)
    sys.stdout.write(f"\n[{name}]\n{format_table(sweep)}")
    sys.stdout.flush()
    return sweep


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Served system on {doc['device']} ({doc['date']})", "",
             f"`pd-cluster local` serving {model_words(doc)}; "
             f"ready after {doc['ready_s']:.0f} s. SLO: TTFT <= {doc['slo']['ttft_s']:g} s, "
             f"TPOT <= {doc['slo']['tpot_s'] * 1000:g} ms.", "", "```", doc["placement"] or "(no table)", "```", ""]
    cold = doc.get("cold_start")
    if cold:
        lines += [f"Cold start: first request TTFT {cold['first_ttft_s'] * 1000:.0f} ms, warm p50 "
                  f"{cold['warm_ttft_p50_s'] * 1000:.0f} ms (ratio {cold['ratio']:.2f}).", ""]
    for key, title in (("sweep", "Random workload, rate sweep"), ("sampled_sweep", "The same, temperature 0.8"),
                       ("multi_turn", "Multi-turn")):
        if key not in doc:
            continue
        lines += [f"## {title}", "", "| rate | done | req/s | out tok/s | goodput | SLO ok | TTFT p50/p99 ms | "
                  "TPOT p50/p99 ms | ITL p50 ms | cached | KV B/prompt tok |", "|" + "---|" * 11]
        for r in doc[key]["results"]:
            def ms(d: dict, k: str) -> str:
                return "-" if d.get(k) is None else f"{d[k] * 1000:.1f}"
            kv = r.get("kv_bytes_per_prompt_token")
            cached = r.get("cached_fraction")
            lines.append(
                f"| {r['rate']} | {r['completed']}/{r['num_requests']} | {r['request_throughput']:.2f} | "
                f"{r['output_throughput']:.0f} | {r['goodput']:.2f} | {r['slo_attainment']:.0%} | "
                f"{ms(r['ttft'], 'p50')}/{ms(r['ttft'], 'p99')} | {ms(r['tpot'], 'p50')}/{ms(r['tpot'], 'p99')} | "
                f"{ms(r['itl'], 'p50')} | {'-' if cached is None else f'{cached:.0%}'} | "
                f"{'-' if kv is None else f'{kv:,.0f}'} |")
        lines.append("")
    if doc.get("sampled_vs_greedy"):
        lines += ["Temperature 0.8 over greedy at the same rate: " + "; ".join(
            f"rate {row['rate']:g}: TPOT p50 {_ratio(row['tpot_p50_ratio'])}, ITL p50 {_ratio(row['itl_p50_ratio'])}"
            for row in doc["sampled_vs_greedy"]) + ".", ""]
    if "colocated" in doc:
        co = doc["colocated"]
        lines += [f"Colocated (the same engine alone on the GPU, offline, {co['requests']} requests at once): "
                  f"{co['request_throughput']:.2f} req/s, {co['output_throughput']:.0f} out tok/s. P and D sharing the "
                  f"GPU saturate at {doc['saturation_request_throughput']:.2f} req/s = "
                  f"{doc['saturation_vs_colocated']:.2f}x of it.", ""]
    if "output_path" in doc:
        lines += ["## Output path: TTFT one request at a time", "", "| prompt tokens | first token from P, p50 ms | "
                  "master waits for D, p50 ms | P's lead |", "|---|---|---|---|"]
        for n, row in doc["output_path"].get("prefill", {}).items():
            alt = doc["output_path"].get("decode", {}).get(n, {})
            p50, alt50 = row.get("ttft_p50_s"), alt.get("ttft_p50_s")
            lead = f"{(alt50 - p50) * 1000:.1f} ms" if p50 and alt50 else "-"
            lines.append(f"| {n} | {'-' if p50 is None else f'{p50 * 1000:.1f}'} | "
                         f"{'-' if alt50 is None else f'{alt50 * 1000:.1f}'} | {lead} |")
        lines.append("")
    if "max_rate_at_slo" in doc:
        best = doc["max_rate_at_slo"]
        lines.append("Highest swept rate with >= 90% of requests within the SLO: "
                     + (f"{best} req/s." if best is not None else "none of the swept rates."))
    return "\n".join(lines) + "\n"


def portable(value: Any, model: str, out: Path) -> Any:
    """``value`` with no path of this machine in it, so results can be kept and compared: the
    model directory becomes its name, files under ``out`` paths relative to it."""
    if isinstance(value, dict):
        return {k: portable(v, model, out) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, model, out) for v in value]
    if isinstance(value, str):
        if value == model:
            return Path(model).name
        if value.startswith(f"{out}/"):
            return value[len(str(out)) + 1:]
    return value


def alt_slo_goodput(sweep: SweepResult, rows: list[dict[str, Any]], slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """Each rate's goodput at a second TPOT SLO (into ``rows``), and the highest rate meeting it."""
    for result, row in zip(sweep.results, rows, strict=True):
        row["alt_slo"] = slo_goodput(result.records, row["duration_s"], slo_ttft, slo_tpot)
    ok = [r["rate"] for r in rows if r["alt_slo"]["attainment"] >= 0.9 and not r["failed"]]
    return {"alt_slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot}, "max_rate_at_alt_slo": max(ok) if ok else None}


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """What a results document says of the model and the launcher's flags (no machine paths)."""
    return {"model_shape": args.model_shape, "model": Path(args.model).name, "local_args": args.local_args}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (e.g. from pd_cluster.bench.random_model)")
    parser.add_argument("--model-shape", default=None,
                        help="the shape a random-weight --model was written with, for the report "
                             "(default: the model directory's name)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--local-args", default="", help="extra flags for pd-cluster local (default: none)")
    parser.add_argument("--sweep", default="2,4,8,16")
    parser.add_argument("--requests-per-rate", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cold-requests", type=int, default=16)
    parser.add_argument("--cold-rate", type=float, default=1.0)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-tpot", type=float, default=0.05)
    parser.add_argument("--slo-tpot-alt", type=float, default=None,
                        help="a second TPOT SLO (seconds): each rate's goodput at it, and the highest rate with "
                             ">= 90%% of requests within it and --slo-ttft (default: none)")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. run2)")
    parser.add_argument("--colocated-requests", type=int, default=0,
                        help="first measure the same engine colocated (offline, all at once) with this many "
                             "requests of the sweep's shape (0: skip)")
    parser.add_argument("--output-path-lens", default="",
                        help="comma-separated prompt lengths: TTFT with P sending the first token (default) and, "
                             "after a restart, with the master waiting for D's (empty: skip)")
    parser.add_argument("--output-path-requests", type=int, default=12)
    parser.add_argument("--sampled-sweep", default="",
                        help="comma-separated rates: the random workload again with temperature 0.8 (empty: skip)")
    parser.add_argument("--compare-conditional", action="store_true",
                        help="only this: multi-turn with default routing against --local-prefill-max-tokens 0")
    parser.add_argument("--compare-mixed", type=int, default=0,
                        help="only this: the default P + D against this many mixed nodes (0: skip)")
    parser.add_argument("--compare-sweeps", default="random:1024:128:4,8,16,24",
                        help="--compare-mixed sweeps: WORKLOAD:IN:OUT:RATES;... (workload random or mixed)")
    parser.add_argument("--compare-rate", type=float, default=2.0, help="conversations per second of the multi-turn runs")
    parser.add_argument("--first-turn-len", type=int, default=1024)
    parser.add_argument("--turn-len", type=int, default=128)
    parser.add_argument("--prompt-vocab", choices=["any", "words"], default="any",
                        help="prompts from any ordinary token or from whole words only (with a model written with "
                             "--answers words, a conversation's answers then encode back to the ids generated)")
    parser.add_argument("--tight-tpot", type=float, default=0.015, help="the tight TPOT SLO of --compare-mixed")
    args = parser.parse_args(argv)
    if args.compare_conditional or args.compare_mixed:
        return run_comparisons(args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    kind, date = device_kind(), dt.date.today().isoformat()
    stem = f"serve-{kind}-{date}" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = LocalClusterProcess(["--model", args.model, "--port", str(args.port), *args.local_args.split()],
                           args.out / f"{stem}-local.log", args.port)
    base = ServeBenchConfig(base_url=cluster.url, model=None, tokenizer=args.model, input_len=args.input_len,
                            output_len=args.output_len, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
                            save_requests=False, progress=False, prompt_vocab=args.prompt_vocab, request_timeout=args.request_timeout)
    doc: dict[str, Any] = {"device": kind, "date": date, **model_fields(args),
                           "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}}
    if args.colocated_requests:
        doc["colocated"] = colocated_baseline(args.model, args.input_len, args.output_len, args.colocated_requests)
        logger.info("colocated: %s", doc["colocated"])
    lens = [int(n) for n in args.output_path_lens.split(",") if n]
    try:
        doc["ready_s"] = cluster.start(args.ready_timeout)
        doc["placement"] = placement_table(cluster.wait_for_line("NODE  ", 60))
        doc["nodes"] = node_capacities(cluster.url)
        if args.cold_requests:
            cold = _run(replace(base, num_requests=args.cold_requests, rates=[args.cold_rate], seed=1000,
                                save_requests=True), "cold start", args.out)
            doc["cold_start"] = cold_start(cold)
        sweep = _run(replace(base, num_requests=args.requests_per_rate,
                             rates=[float(r) for r in args.sweep.split(",")]), "sweep", args.out)
        doc["sweep"] = results_document(sweep)
        doc.update(overload_counts(sweep))
        ok = [r["rate"] for r in doc["sweep"]["results"] if r["slo_attainment"] >= 0.9 and not r["failed"]]
        doc["max_rate_at_slo"] = max(ok) if ok else None
        if args.slo_tpot_alt:
            doc.update(alt_slo_goodput(sweep, doc["sweep"]["results"], args.slo_ttft, args.slo_tpot_alt))
        best = max(r["request_throughput"] for r in doc["sweep"]["results"])
        doc["saturation_request_throughput"] = best
        if "colocated" in doc:
            doc["saturation_vs_colocated"] = best / doc["colocated"]["request_throughput"]
        try:
            from pd_cluster.bench.serve.plots import write_plots

            doc["plots"] = [str(p) for p in write_plots(sweep, args.out / f"{stem}-plots")]
        except RuntimeError as e:  # matplotlib missing
            logger.warning("no plots: %s", e)
        if args.sampled_sweep:
            sampled = _run(sampled_sweep_config(replace(base, num_requests=args.requests_per_rate),
                                                [float(r) for r in args.sweep.split(",")],
                                                [float(r) for r in args.sampled_sweep.split(",")]),
                           "sweep, temperature 0.8", args.out)
            doc["sampled_sweep"] = results_document(sampled)
            doc["sampled_vs_greedy"] = sampled_vs_greedy(doc["sweep"], doc["sampled_sweep"])
            for row in doc["sampled_vs_greedy"]:
                logger.info("rate %g: temperature 0.8 over greedy, TPOT p50 %s, ITL p50 %s", row["rate"],
                            _ratio(row["tpot_p50_ratio"]), _ratio(row["itl_p50_ratio"]))
        if args.conversations:
            turns = _run(replace(base, workload="multi-turn", num_conversations=args.conversations, turns=args.turns,
                                 input_len=256, output_len=64, rates=[2.0]), "multi-turn", args.out)
            doc["multi_turn"] = results_document(turns)
        if lens:
            doc["output_path"] = {"prefill": ttft_probe(base, lens, args.output_path_requests, args.out, "first token from P")}
    finally:
        doc["launcher_exit"] = cluster.stop()
    if lens:
        # The alternative output path: the same cluster, its master waiting for D's first tokens.
        env = {**os.environ, "PD_FIRST_TOKEN_VIA": "decode"}
        alt = LocalClusterProcess(cluster.args, args.out / f"{stem}-local-decode-first.log", args.port, env=env)
        try:
            alt.start(args.ready_timeout)
            doc["output_path"]["decode"] = ttft_probe(base, lens, args.output_path_requests, args.out,
                                                      "first token from D")
        finally:
            alt.stop()
    doc = portable(doc, args.model, args.out)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(doc))
    sys.stdout.write(f"\nresults: {args.out / stem}.json\n")
    return 0


def run_comparisons(args: argparse.Namespace) -> int:
    """``--compare-conditional`` / ``--compare-mixed``: restart ``pd-cluster local`` per placement."""
    from pd_cluster.bench import compare

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    kind, date = device_kind(), dt.date.today().isoformat()
    stem = f"compare-{kind}-{date}" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)

    def start(flags: list[str], name: str) -> LocalClusterProcess:
        cluster = LocalClusterProcess(["--model", args.model, "--port", str(args.port), *args.local_args.split(),
                                       *flags], args.out / f"{stem}-{name}-local.log", args.port,
                                      log_dir=args.out / f"{stem}-{name}-logs")
        cluster.start(args.ready_timeout)
        return cluster

    base = ServeBenchConfig(base_url=f"http://127.0.0.1:{args.port}", model=None, tokenizer=args.model,
                            slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, save_requests=False, progress=False, prompt_vocab=args.prompt_vocab,
                            request_timeout=args.request_timeout)
    doc: dict[str, Any] = {"device": kind, "date": date, **model_fields(args),
                           "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}}

    def run(config: ServeBenchConfig, name: str) -> SweepResult:
        return _run(config, name, args.out)

    multi = {"num_conversations": args.conversations, "turns": args.turns, "first_turn_len": args.first_turn_len,
             "input_len": args.turn_len, "output_len": args.output_len, "rates": [args.compare_rate]}
    try:
        if args.compare_conditional:
            doc["conditional"] = compare.compare_conditional(
                start, base, run, args.conversations, args.turns, args.first_turn_len, args.turn_len,
                args.output_len, args.compare_rate)
        if args.compare_mixed:
            doc["mixed"] = compare.compare_mixed(
                start, base, run, args.compare_mixed, compare.parse_sweeps(args.compare_sweeps),
                args.requests_per_rate, multi if args.conversations else None, args.tight_tpot)
    finally:
        path = compare.write(doc, args.out, stem)
    sys.stdout.write(f"\n{path.read_text()}\nresults: {args.out / stem}.json\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
