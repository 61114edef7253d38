"""The adaptive-against-static comparison's own arithmetic: configurations and the key."""

from __future__ import annotations

import pytest

from pd_cluster.bench.served_adaptive import parse_static, summarize


def test_static_configurations_are_named_and_the_default_name_is_kept_for_the_default():
    assert parse_static(["pd=--prefill 1 --decode 1", "m=--mixed 1"]) == {"pd": "--prefill 1 --decode 1", "m": "--mixed 1"}
    for bad in (["default=--mixed 1"], ["noflags"], ["a=x", "a=y"], []):
        with pytest.raises(ValueError):
            parse_static(bad)


def test_the_key_is_the_defaults_median_over_the_best_static_median():
    doc = summarize({"default": [20.0, 22.0, 30.0], "pd": [17.0, 16.0, 18.0], "mixed1": [21.0, 23.0, 19.0]}, gpus=1)
    assert doc["saturation_median"] == {"default": 22.0, "pd": 17.0, "mixed1": 21.0}
    assert doc["best_static"] == "mixed1"
    assert doc["adaptive_vs_best_static_saturation_1gpu"] == pytest.approx(22.0 / 21.0)
    assert doc["saturation_spread"]["default"] == [20.0, 30.0]


def test_a_machine_without_gpus_names_its_key_so():
    assert "adaptive_vs_best_static_saturation_cpu" in summarize({"default": [1.0], "pd": [2.0]}, gpus=0)


def test_no_key_before_both_sides_ran():
    assert "adaptive_vs_best_static_saturation_2gpu" not in summarize({"default": [1.0], "pd": []}, gpus=2)
    assert "adaptive_vs_best_static_saturation_2gpu" not in summarize({"default": [], "pd": [3.0]}, gpus=2)
