"""The comparison report's arithmetic: per-turn TTFT, the tight-SLO goodput, sweep specs, tables."""

from __future__ import annotations

import pytest

from pd_cluster.bench.compare import markdown, parse_sweeps, server_lines, slo_goodput, ttft_parts, turn_summary
from pd_cluster.bench.serve.records import RequestRecord


def _record(turn: int, ttft: float, tokens: int = 11, e2e: float = 1.1, error: str | None = None) -> RequestRecord:
    return RequestRecord(index=0, turn=turn, start=0.0, end=e2e, chunk_times=[ttft], output_tokens=tokens, error=error)


def test_turn_summary_splits_first_turns_from_later_ones():
    records = [_record(0, 0.5), _record(0, 0.7), _record(1, 0.1), _record(2, 0.2), _record(1, 0.3),
               _record(1, 9.0, error="http_500")]
    summary = turn_summary(records)
    assert summary["ttft_turn1_p50_s"] == pytest.approx(0.6)
    assert summary["ttft_later_p50_s"] == pytest.approx(0.2)
    assert summary["failed"] == 1 and summary["requests"] == 6
    assert summary["tpot_p50_s"] == pytest.approx((1.1 - 0.3) / 10)  # the median of the five completed


def test_later_turns_ttft_splits_into_the_parts_the_master_logged():
    log = "\n".join([
        "2026-11-25 10:00:00,000 INFO master.requests: request request_id=cmpl-a outcome=ok ttft_s=0.0300 "
        "dispatch_s=0.0020 node_ttft_s=0.0200 routing=\"cache_aware; D held 9/10\"",
        "2026-11-25 10:00:00,001 INFO master.requests: request request_id=cmpl-b outcome=ok ttft_s=0.0500 "
        "dispatch_s=0.0040 node_ttft_s=0.0400",
        "2026-11-25 10:00:00,002 INFO master.requests: request request_id=cmpl-c outcome=ok ttft_s=0.9000 "
        "dispatch_s=0.0010 node_ttft_s=0.8000",
        "2026-11-25 10:00:00,003 INFO decode_node: not a request line",
    ])
    lines = server_lines(log)
    assert set(lines) == {"cmpl-a", "cmpl-b", "cmpl-c"} and lines["cmpl-a"]["routing"] == "cache_aware; D held 9/10"
    a, b, first = _record(1, 0.034), _record(2, 0.056), _record(0, 0.95)
    a.request_id, b.request_id, first.request_id = "cmpl-a", "cmpl-b", "cmpl-c"
    unlogged = _record(1, 5.0)
    unlogged.request_id = "cmpl-z"
    parts = ttft_parts([a, b, first, unlogged], lines)  # the first turn and the unlogged one count nowhere
    assert parts["http"] == pytest.approx((0.004 + 0.006) / 2)
    assert parts["master"] == pytest.approx(0.003) and parts["node"] == pytest.approx(0.03)
    assert parts["hops"] == pytest.approx((0.008 + 0.006) / 2)
    assert ttft_parts([], lines) == {"http": None, "master": None, "node": None, "hops": None}


def test_tight_slo_goodput_counts_only_requests_within_both_bounds():
    records = [_record(0, 0.1, e2e=0.1 + 10 * 0.01), _record(0, 0.1, e2e=0.1 + 10 * 0.03), _record(0, 2.0)]
    assert slo_goodput(records, 2.0, 1.0, 0.02) == {"slo_ttft_s": 1.0, "slo_tpot_s": 0.02, "goodput": 0.5,
                                                   "attainment": pytest.approx(1 / 3)}


def test_sweep_specs_parse_and_the_report_names_the_ratios():
    assert parse_sweeps("random:1024:128:4,8;mixed:1024:128:2") == [
        ("random", 1024, 128, [4.0, 8.0]), ("mixed", 1024, 128, [2.0])]
    run = {"ttft_turn1_p50_s": 0.1, "ttft_later_p50_s": 0.05, "ttft_later_p90_s": 0.07, "tpot_p50_s": 0.01,
           "tpot_p99_s": 0.02, "failed": 0, "requests": 9, "route_decisions": {"local/short_miss": 6.0}}
    doc = {"device": "cpu", "date": "2026-11-23", "model_shape": "tiny", "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
           "conditional": {"conversations": 3, "turns": 3, "rate": 1.0, "first_turn_len": 1024, "turn_len": 128,
                           "output_len": 64, "conditional": run, "always_pd": {**run, "ttft_later_p50_s": 0.2},
                           "ratios": {"ttft_later_p50": 0.25, "ttft_turn1_p50": 1.0, "tpot_p99": 1.0}}}
    text = markdown(doc)
    assert "TTFT turns 2+ p50 0.25x" in text and "local/short_miss 6" in text
    assert "Model: tiny (random weights)." in text


def test_the_report_names_a_real_model_by_its_directory_and_the_launchers_extra_flags():
    """A model that was not written with a shape is not called one, and a run's extra flags
    (what set it apart from the run beside it) are in its report."""
    doc = {"device": "cpu", "date": "2026-11-25", "model_shape": None, "model": "SmolLM2-135M-Instruct",
           "local_args": "--side-prefill-max-tokens 0", "slo": {"ttft_s": 1.0, "tpot_s": 0.05}}
    text = markdown(doc)
    assert ("Model: `SmolLM2-135M-Instruct`, `pd-cluster local --side-prefill-max-tokens 0`." in text
            and "random weights" not in text)
