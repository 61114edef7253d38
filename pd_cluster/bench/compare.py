"""The comparisons users ask for, on one machine and one load, through ``pd-cluster local``:

* ``conditional``: multi-turn conversations (a long first turn, short later ones) with the master's
  default routing (a short miss is prefilled on its decode node) against every request through
  a prefill node (``--local-prefill-max-tokens 0``): TTFT of turn 1 and of the later turns, TPOT.
* ``mixed``: the default P + D placement against mixed nodes only (``--prefill 0 --decode 0
  --mixed K``): rate sweeps to saturation (random, and the long/short ``mixed`` workload) and
  multi-turn, goodput at the SLO and at a tight TPOT SLO, and the ratios.

Each run restarts the cluster; the master's routing decisions are read from /metrics after it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from master.request_log import parse_text_line
from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.metrics import meets_slo
from pd_cluster.bench.serve.records import RequestRecord
from pd_cluster.bench.serve.report import results_document
from pd_cluster.bench.serve.runner import SweepResult

logger = logging.getLogger(__name__)

Runner = Callable[[ServeBenchConfig, str], SweepResult]


def route_decisions(url: str) -> dict[str, float]:
    """``pdc_route_decisions_total`` by ``path/reason`` from the master's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        f"{sample.labels['path']}/{sample.labels['reason']}": sample.value
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
        if family.name == "pdc_route_decisions"
        for sample in family.samples if sample.name == "pdc_route_decisions_total"
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank below), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def turn_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT of first turns and of later turns (p50, p90), TPOT over all (p50, p99), failures."""
    ok = [r for r in records if r.ok]
    first = [r.ttft for r in ok if r.turn == 0 and r.ttft is not None]
    later = [r.ttft for r in ok if r.turn > 0 and r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    missed = [r.prompt_tokens - r.cached_tokens for r in ok
              if r.turn > 0 and r.prompt_tokens is not None and r.cached_tokens is not None]
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "ttft_turn1_p50_s": statistics.median(first) if first else None,
        "ttft_later_p50_s": statistics.median(later) if later else None,
        "ttft_later_p90_s": percentile(later, 0.9),
        "tpot_p50_s": statistics.median(tpot) if tpot else None,
        "tpot_p99_s": percentile(tpot, 0.99),
        # Prompt tokens of a later turn that no cache on its path held (a short miss prefills fast).
        "later_uncached_tokens_p50": statistics.median(missed) if missed else None,
        # The streams behind the tail: which turn, how long, how much of the prompt was cached.
        "slowest_tpot": [
            {"conversation": r.conversation, "turn": r.turn, "tpot_s": r.tpot, "ttft_s": r.ttft, "e2e_s": r.e2e,
             "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "max_itl_s": max(r.itl, default=None)}
            for r in sorted((r for r in ok if r.tpot is not None), key=lambda r: r.tpot, reverse=True)[:3]
        ],
    }


def server_lines(log_text: str) -> dict[str, dict[str, str]]:
    """The master's request log lines in a launcher's log, by request id."""
    lines = (parse_text_line(line) for line in log_text.splitlines())
    return {fields["request_id"]: fields for fields in lines if fields is not None}


def log_seconds(fields: dict[str, str], key: str) -> float | None:
    """A request log line's field in seconds (None where the line has none)."""
    value = fields.get(key)
    return None if value in (None, "None") else float(value)


def ttft_parts(records: Sequence[RequestRecord], lines: dict[str, dict[str, str]]) -> dict[str, float | None]:
    """Where later turns' TTFT goes, p50 of each part over the requests the master logged:
    ``http`` (the client's TTFT less the master's: request and first chunk on the wire),
    ``master`` (arrival to dispatch: template, tokenizing, routing, queueing), ``node`` (the node
    from taking the job to sending the first token) and ``hops`` (the rest: the job to the node
    and the token back over the websockets)."""
    parts: dict[str, list[float]] = {"http": [], "master": [], "node": [], "hops": []}
    for r in records:
        fields = lines.get(r.request_id or "")
        if not r.ok or r.turn == 0 or r.ttft is None or fields is None:
            continue
        ttft, dispatch, node = log_seconds(fields, "ttft_s"), log_seconds(fields, "dispatch_s"), log_seconds(fields, "node_ttft_s")
        if ttft is None or dispatch is None or node is None:
            continue
        parts["http"].append(r.ttft - ttft)
        parts["master"].append(dispatch)
        parts["node"].append(node)
        parts["hops"].append(ttft - dispatch - node)
    return {key: statistics.median(values) if values else None for key, values in parts.items()}


def slo_goodput(records: Sequence[RequestRecord], duration_s: float, slo_ttft: float, slo_tpot: float) -> dict:
    good = sum(1 for r in records if meets_slo(r, slo_ttft, slo_tpot))
    return {"slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot, "goodput": good / max(duration_s, 1e-9),
            "attainment": good / max(len(records), 1)}


def sweep_summary(sweep: SweepResult, slo_ttft: float, tight_tpot: float) -> list[dict[str, Any]]:
    """Per rate: the runner's metrics and the goodput at the tight TPOT SLO."""
    rows = []
    for result, doc in zip(sweep.results, results_document(sweep)["results"]):
        doc.pop("requests", None)
        doc["tight"] = slo_goodput(result.records, doc["duration_s"], slo_ttft, tight_tpot)
        rows.append(doc)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare_conditional(start: Callable[[list[str], str], Any], base: ServeBenchConfig, run: Runner,
                        conversations: int, turns: int, first_turn_len: int, turn_len: int, output_len: int,
                        rate: float) -> dict[str, Any]:
    """Multi-turn through ``pd-cluster local`` twice: default routing, then always P -> D."""
    config = replace(base, workload="multi-turn", num_conversations=conversations, turns=turns,
                     first_turn_len=first_turn_len, input_len=turn_len, output_len=output_len, rates=[rate],
                     save_requests=True, seed=77)
    out: dict[str, Any] = {"conversations": conversations, "turns": turns, "first_turn_len": first_turn_len,
                           "turn_len": turn_len, "output_len": output_len, "rate": rate,
                           "prompt_vocab": base.prompt_vocab}
    for name, flags in (("conditional", []), ("always_pd", ["--local-prefill-max-tokens", "0"])):
        cluster = start(flags, name)
        try:
            sweep = run(config, f"multi-turn, {name}")
            out[name] = turn_summary(sweep.results[0].records)
            out[name]["route_decisions"] = route_decisions(cluster.url)
        finally:
            cluster.stop()
        out[name]["ttft_later_parts_p50_s"] = ttft_parts(sweep.results[0].records, server_lines(cluster.master_log()))
    c, a = out["conditional"], out["always_pd"]
    out["ratios"] = {
        "ttft_later_p50": _ratio(c["ttft_later_p50_s"], a["ttft_later_p50_s"]),
        "ttft_turn1_p50": _ratio(c["ttft_turn1_p50_s"], a["ttft_turn1_p50_s"]),
        "tpot_p99": _ratio(c["tpot_p99_s"], a["tpot_p99_s"]),
    }
    return out


def compare_mixed(start: Callable[[list[str], str], Any], base: ServeBenchConfig, run: Runner, mixed_nodes: int,
                  sweeps: Sequence[tuple[str, int, int, list[float]]], requests_per_rate: int, multi_turn: dict | None,
                  tight_tpot: float) -> dict[str, Any]:
    """The default P + D placement against ``mixed_nodes`` mixed nodes, on the same workloads."""
    out: dict[str, Any] = {"mixed_nodes": mixed_nodes, "tight_tpot_s": tight_tpot}
    placements = (("pd", []), ("mixed", ["--prefill", "0", "--decode", "0", "--mixed", str(mixed_nodes)]))
    for name, flags in placements:
        cluster = start(flags, name)
        runs: dict[str, Any] = {}
        try:
            for workload, input_len, output_len, rates in sweeps:
                config = replace(base, workload=workload, input_len=input_len, output_len=output_len,
                                 num_requests=requests_per_rate, rates=list(rates), save_requests=False)
                sweep = run(config, f"{name}: {workload} {input_len}/{output_len}")
                rows = sweep_summary(sweep, base.slo_ttft, tight_tpot)
                runs[f"{workload}_{input_len}_{output_len}"] = {
                    "results": rows,
                    "saturation_request_throughput": max(r["request_throughput"] for r in rows),
                    "best_goodput": max(r["goodput"] for r in rows),
                    "best_goodput_tight": max(r["tight"]["goodput"] for r in rows),
                }
            if multi_turn:
                config = replace(base, workload="multi-turn", save_requests=True, seed=78, **multi_turn)
                sweep = run(config, f"{name}: multi-turn")
                summary = turn_summary(sweep.results[0].records)
                doc = results_document(sweep)["results"][0]
                summary.update(goodput=doc["goodput"], request_throughput=doc["request_throughput"])
                runs["multi_turn"] = summary
            runs["route_decisions"] = route_decisions(cluster.url)
        finally:
            cluster.stop()
        out[name] = runs
    ratios: dict[str, Any] = {}
    for key, value in out["mixed"].items():
        other = out["pd"].get(key)
        if isinstance(value, dict) and "saturation_request_throughput" in value and other:
            ratios[key] = {
                "saturation_mixed_over_pd": _ratio(value["saturation_request_throughput"],
                                                   other["saturation_request_throughput"]),
                "goodput_mixed_over_pd": _ratio(value["best_goodput"], other["best_goodput"]),
                "goodput_tight_mixed_over_pd": _ratio(value["best_goodput_tight"], other["best_goodput_tight"]),
            }
    if "multi_turn" in out["mixed"]:
        m, p = out["mixed"]["multi_turn"], out["pd"]["multi_turn"]
        ratios["multi_turn"] = {"ttft_later_p50_mixed_over_pd": _ratio(m["ttft_later_p50_s"], p["ttft_later_p50_s"]),
                                "tpot_p99_mixed_over_pd": _ratio(m["tpot_p99_s"], p["tpot_p99_s"])}
    out["ratios"] = ratios
    return out


def model_words(doc: dict[str, Any]) -> str:
    """What served the runs, for a report: the shape a random-weight model was written with
    (``--model-shape``), else the model directory's name, and the extra flags of the launcher."""
    words = (f"{doc['model_shape']} (random weights)" if doc.get("model_shape")
             else f"`{doc.get('model') or 'unnamed'}`")
    if doc.get("local_args"):
        words += f", `pd-cluster local {doc['local_args']}`"
    return words


def markdown(doc: dict[str, Any]) -> str:
    """The comparison tables of one results document."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [f"# Disaggregate or not, on {doc['device']} ({doc['date']})", "",
             f"Model: {model_words(doc)}. Every run restarts `pd-cluster local`; SLO: TTFT <= "
             f"{doc['slo']['ttft_s']:g} s, TPOT <= {doc['slo']['tpot_s'] * 1000:g} ms.", ""]
    cond = doc.get("conditional")
    if cond:
        words = "; prompts of whole words" if cond.get("prompt_vocab") == "words" else ""
        lines += ["## Conditional disaggregation: multi-turn", "",
                  f"{cond['conversations']} conversations of {cond['turns']} turns at {cond['rate']:g} conversations/s; "
                  f"first message {cond['first_turn_len']} tokens, later ones {cond['turn_len']}, answers "
                  f"{cond['output_len']} tokens{words}. `pd-cluster local` (1 P + 1 D), default routing against "
                  "`--local-prefill-max-tokens 0`.", "",
                  "| routing | TTFT turn 1 p50 | TTFT turns 2+ p50 / p90 | TPOT p50 / p99 | failed | decisions |",
                  "|---|---|---|---|---|---|"]
        for name in ("conditional", "always_pd"):
            r = cond[name]
            decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["route_decisions"].items()))
            lines.append(f"| {name} | {ms(r['ttft_turn1_p50_s'])} ms | {ms(r['ttft_later_p50_s'])} / "
                         f"{ms(r['ttft_later_p90_s'])} ms | {ms(r['tpot_p50_s'])} / {ms(r['tpot_p99_s'])} ms | "
                         f"{r['failed']}/{r['requests']} | {decisions} |")
        lines += ["", "Where later turns' TTFT goes (p50 of each part; http: the client's TTFT less the master's; master: "
                  "arrival to dispatch; node: job to first token sent; hops: the websockets both ways):", "",
                  "| routing | http | master | node | hops | uncached tokens p50 |", "|---|---|---|---|---|---|"]
        for name in ("conditional", "always_pd"):
            parts = cond[name].get("ttft_later_parts_p50_s") or {}
            uncached = cond[name].get("later_uncached_tokens_p50")
            lines.append(f"| {name} | " + " | ".join(f"{ms(parts.get(k))} ms" for k in ("http", "master", "node", "hops"))
                         + f" | {'-' if uncached is None else f'{uncached:.0f}'} |")
        ratios = cond["ratios"]
        lines += ["", f"Conditional over always-P->D: TTFT turns 2+ p50 {x(ratios['ttft_later_p50'])} (target <= "
                  f"0.5x), TPOT p99 {x(ratios['tpot_p99'])} (target <= 1.2x), TTFT turn 1 "
                  f"{x(ratios['ttft_turn1_p50'])}.", ""]
    mixed = doc.get("mixed")
    if mixed:
        lines += [f"## P + D against {mixed['mixed_nodes']} mixed node(s)", "",
                  f"Goodput: requests/s within the SLO; tight: TPOT <= {mixed['tight_tpot_s'] * 1000:g} ms.", ""]
        for key, ratios in mixed["ratios"].items():
            if key == "multi_turn":
                continue
            lines += [f"### {key.replace('_', ' ')}", "", "| placement | rate | req/s | TTFT p50/p99 ms | "
                      "TPOT p50/p99 ms | goodput | goodput (tight) |", "|---|---|---|---|---|---|---|"]
            for name in ("pd", "mixed"):
                for r in mixed[name][key]["results"]:
                    lines.append(f"| {name} | {r['rate']} | {r['request_throughput']:.2f} | {ms(r['ttft'].get('p50'))}/"
                                 f"{ms(r['ttft'].get('p99'))} | {ms(r['tpot'].get('p50'))}/{ms(r['tpot'].get('p99'))} | "
                                 f"{r['goodput']:.2f} | {r['tight']['goodput']:.2f} |")
            lines += ["", f"Mixed over P + D: saturation {x(ratios['saturation_mixed_over_pd'])}, best goodput "
                      f"{x(ratios['goodput_mixed_over_pd'])}, best goodput at the tight SLO "
                      f"{x(ratios['goodput_tight_mixed_over_pd'])}.", ""]
        if "multi_turn" in mixed["ratios"]:
            lines += ["### multi-turn", "", "| placement | TTFT turn 1 p50 | TTFT turns 2+ p50 | TPOT p50 / p99 | "
                      "goodput | failed |", "|---|---|---|---|---|---|"]
            for name in ("pd", "mixed"):
                r = mixed[name]["multi_turn"]
                lines.append(f"| {name} | {ms(r['ttft_turn1_p50_s'])} ms | {ms(r['ttft_later_p50_s'])} ms | "
                             f"{ms(r['tpot_p50_s'])} / {ms(r['tpot_p99_s'])} ms | {r['goodput']:.2f} | "
                             f"{r['failed']}/{r['requests']} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path, stem: str) -> Path:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    path = out / f"{stem}.md"
    path.write_text(markdown(doc))
    return path


def parse_sweeps(text: str) -> list[tuple[str, int, int, list[float]]]:
    """``WORKLOAD:IN:OUT:RATE,RATE;...`` (workload ``random`` or ``mixed``: 20% long prompts)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        workload, input_len, output_len, rates = item.split(":")
        out.append((workload, int(input_len), int(output_len), [float(r) for r in rates.split(",")]))
    return out
