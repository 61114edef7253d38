"""The served-system suite's own arithmetic: the placement table it reads, the cold-start ratio,
the temperature sweep's workload and its ratio to the greedy sweep."""

from __future__ import annotations

import pytest

from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.records import RequestRecord
from pd_cluster.bench.serve.runner import RateResult, SweepResult
from pd_cluster.bench.serve.workloads import build_workload
from pd_cluster.bench.local_process import placement_table
from pd_cluster.bench.served import cold_start, markdown, overload_counts, sampled_sweep_config, sampled_vs_greedy
from pd_cluster.local_cluster import format_placement_table


def test_placement_table_is_read_back_from_the_launchers_log():
    table = format_placement_table([
        {"node": "master", "role": "master", "gpu": "-", "pid": 10},
        {"node": "prefill-0", "role": "prefill", "gpu": "0", "mem_fraction": "0.3500", "kv_slots": 1000, "pid": 11},
        {"node": "decode-0", "role": "decode", "gpu": "0", "mem_fraction": "0.3500", "kv_slots": 1000, "pid": 12},
    ])
    log = "INFO starting\npd-cluster is serving at http://x/v1\n\n" + table + "\ntry:\n  curl ...\n"
    rows = placement_table(log).splitlines()
    assert rows[0].split()[:3] == ["NODE", "ROLE", "GPU"]
    assert [r.split()[1] for r in rows[1:]] == ["master", "prefill", "decode"]
    assert placement_table("no table here") == ""


def _record(i: int, start: float, ttft: float) -> RequestRecord:
    return RequestRecord(index=i, start=start, end=start + ttft + 0.5, chunk_times=[start + ttft, start + ttft + 0.5],
                         output_tokens=2)


def test_cold_start_compares_the_first_sent_request_with_the_median_of_the_rest():
    records = [_record(1, 1.0, 0.2), _record(0, 0.0, 0.9), _record(2, 2.0, 0.3), _record(3, 3.0, 0.1)]
    sweep = SweepResult(ServeBenchConfig(), "m", "tok")
    sweep.results.append(RateResult(None, records))  # type: ignore[arg-type]
    cold = cold_start(sweep)
    assert cold["first_ttft_s"] == pytest.approx(0.9)
    assert cold["warm_ttft_p50_s"] == pytest.approx(0.2)
    assert cold["ratio"] == pytest.approx(4.5)


def test_the_temperature_sweep_sends_prompts_the_greedy_sweep_did_not(tokenizer):
    # Each rate of a sweep seeds its prompts with seed + its index; the sampled sweep's rates come
    # after every greedy rate's, so none of its prompts is already in the prefix cache.
    base = ServeBenchConfig(num_requests=4, input_len=24, output_len=8, seed=3)
    greedy_rates, sampled_rates = [1.0, 2.0, 4.0], [1.0, 4.0]
    sampled = sampled_sweep_config(base, greedy_rates, sampled_rates)
    assert (sampled.temperature, sampled.rates, sampled.num_requests) == (0.8, sampled_rates, 4)
    greedy_prompts = {c.turns[0].prompt for i in range(len(greedy_rates))
                      for c in build_workload(base, tokenizer, base.seed + i)}
    for j in range(len(sampled_rates)):
        fresh = [c.turns[0].prompt for c in build_workload(sampled, tokenizer, sampled.seed + j)]
        assert len(fresh) == 4 and not greedy_prompts & set(fresh)


def test_results_keep_no_path_of_the_machine_that_ran_them(tmp_path):
    from pd_cluster.bench.served import portable

    model, out = str(tmp_path / "models" / "m8b"), tmp_path / "results"
    doc = {"sweep": {"tokenizer": model, "config": {"tokenizer": model, "rate": 2.0}},
           "plots": [str(out / "run-plots" / "ttft_cdf.png")], "note": f"{model} elsewhere stays"}
    assert portable(doc, model, out) == {
        "sweep": {"tokenizer": "m8b", "config": {"tokenizer": "m8b", "rate": 2.0}},
        "plots": ["run-plots/ttft_cdf.png"], "note": f"{model} elsewhere stays"}


def _rate_row(rate: float, tpot_p50: float | None, itl_p50: float | None) -> dict:
    return {"rate": rate, "completed": 4, "num_requests": 4, "request_throughput": 1.0, "output_throughput": 9.0,
            "goodput": 1.0, "slo_attainment": 1.0, "ttft": {"p50": 0.02, "p99": 0.03},
            "tpot": {"p50": tpot_p50, "p99": tpot_p50}, "itl": {"p50": itl_p50}}


def test_the_temperature_sweep_is_reported_over_the_greedy_one_rate_by_rate():
    greedy = {"results": [_rate_row(1.0, 0.0040, 0.0036), _rate_row(2.0, 0.0050, 0.0045)]}
    # Rate 4 was not swept greedy, and rate 2's requests streamed one token each (no TPOT): no rows.
    sampled = {"results": [_rate_row(1.0, 0.0042, None), _rate_row(2.0, None, None), _rate_row(4.0, 0.009, 0.008)]}
    rows = sampled_vs_greedy(greedy, sampled)
    assert [row["rate"] for row in rows] == [1.0]
    assert rows[0]["tpot_p50_ratio"] == pytest.approx(1.05)
    assert rows[0]["itl_p50_ratio"] is None
    doc = {"device": "d", "date": "2026-01-01", "model": "m", "ready_s": 3.0,
           "slo": {"ttft_s": 1.0, "tpot_s": 0.05}, "placement": "", "sweep": greedy, "sampled_sweep": sampled,
           "sampled_vs_greedy": rows}
    assert "Temperature 0.8 over greedy at the same rate: rate 1: TPOT p50 1.050x, ITL p50 -." in markdown(doc)


def test_overload_counts_accepted_requests_that_did_not_finish_apart_from_429s():
    done = RequestRecord(0, chunk_times=[0.1], output_tokens=1, finish_reason="length")
    cut = RequestRecord(1, chunk_times=[0.1], output_tokens=1)  # the stream ended without a finish reason
    errored = RequestRecord(2, error="stream:server_error")
    unavailable = RequestRecord(3, error="HTTP 503")
    rejected = RequestRecord(4, error="HTTP 429")
    sweep = SweepResult(ServeBenchConfig(), "m", "tok")
    sweep.results.append(RateResult(None, [done, cut, errored]))  # type: ignore[arg-type]
    sweep.results.append(RateResult(None, [unavailable, rejected, done]))  # type: ignore[arg-type]
    assert overload_counts(sweep) == {"overload_failed_requests": 3, "overload_rejected_requests": 1}
