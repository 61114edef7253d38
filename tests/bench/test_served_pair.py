"""The keys of two served runs (P + D against mixed) from their JSONs."""

from __future__ import annotations

import json

import pytest

from pd_cluster.bench.served_pair import main, served_pair_keys

SLO = {"ttft_s": 2.0, "tpot_s": 0.02}
ALT = {"ttft_s": 2.0, "tpot_s": 0.04}


def _doc(saturation: float, at_slo: float | None, at_alt: float | None, **extra) -> dict:
    return {"slo": SLO, "alt_slo": ALT, "saturation_request_throughput": saturation, "max_rate_at_slo": at_slo,
            "max_rate_at_alt_slo": at_alt, "local_args": "--load-format dummy", "model_shape": "llama3-70b", **extra}


def test_keys_are_pd_over_mixed_and_none_where_a_side_met_no_rate(tmp_path):
    keys = served_pair_keys(_doc(6.0, 4.0, None), _doc(4.0, 2.0, 3.0), "tp_70b")
    assert keys["tp_70b_pd_saturation_vs_mixed"] == 1.5
    assert keys["tp_70b_pd_goodput_vs_mixed"] == 2.0
    assert keys["tp_70b_pd_goodput_alt_vs_mixed"] is None
    pd, mixed = tmp_path / "pd.json", tmp_path / "mixed.json"
    pd.write_text(json.dumps(_doc(6.0, 4.0, 6.0)))
    mixed.write_text(json.dumps(_doc(3.0, 2.0, 3.0)))
    assert main(["--name", "tp_70b", "--pd", str(pd), "--mixed", str(mixed), "--out", str(tmp_path / "k.json")]) == 0
    written = json.loads((tmp_path / "k.json").read_text())
    assert written["tp_70b_pd_goodput_alt_vs_mixed"] == 2.0 and written["runs"]["pd"]["file"] == "pd.json"


def test_runs_judged_at_different_slos_are_refused():
    with pytest.raises(ValueError, match="different SLOs"):
        served_pair_keys(_doc(6.0, 4.0, 4.0), {**_doc(4.0, 2.0, 3.0), "slo": {"ttft_s": 1.0, "tpot_s": 0.05}}, "x")
