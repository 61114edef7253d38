"""The Grafana dashboard reads only series the master exports, and the Helm chart installs it.

Metric names and grouping labels of every query are checked against the /metrics text of a real
master app that served a request through nodes (test doubles on its websocket); the chart is
rendered by Helm's engine as in tests/deploy/test_helm_chart.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.master_fakes import (
    FakeNode, LiveMaster, make_settings, serve_one, wait_until, wait_warm, write_model_dir,
)
from tests.deploy.test_helm_chart import CHART, FakeKubeAPI, Helm

DASHBOARD = CHART / "dashboards" / "pd-cluster.json"
_NAME = re.compile(r"\b(pdc_[a-z0-9_]+)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"([^\"]*)\"")
#: Labels Prometheus adds when it scrapes, and the histogram bucket label.
_SCRAPE_LABELS = {"job", "instance", "le"}


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legend format) of every query of the dashboard."""
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels(dashboard) for t in p.get("targets", [])]


def exported(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, from a /metrics text (names as Prometheus stores them)."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory) -> str:
    """/metrics of a master after one request went P -> D and moved KV."""

    async def serve() -> str:
        async with LiveMaster(make_settings(write_model_dir(tmp_path_factory.mktemp("model")))) as master:
            prefill, decode = FakeNode(master, "p0", "prefill"), FakeNode(master, "d0", "decode")
            for node in (prefill, decode):  # load as a busy node reports it
                node.status = node.status.model_copy(update={
                    "running": 2, "waiting": 1, "free_kv_tokens": 3000, "queued_prefill_tokens": 64,
                    "prompt_tokens": 100, "prefix_hit_tokens": 40, "generation_tokens_per_s": 12.5})
                await node.join()
            await wait_warm(master)
            await wait_until(lambda: all(n.status.prompt_tokens for n in master.ctx.registry.nodes.values()), 5,
                             "the nodes' status reports")
            body = {"model": "tiny-llama", "prompt": "abcdefgh"}
            call = asyncio.create_task(master.http.post("/v1/completions", json=body))
            await serve_one(prefill, decode, [(20, "x"), (21, "y"), (22, "z")], hit_blocks_decode=1,
                            transfer_bytes=2048)
            assert (await call).status_code == 200
            text = (await master.http.get("/metrics")).text
            await prefill.close()
            await decode.close()
            return text

    return asyncio.run(serve())


def test_dashboard_is_valid_grafana_json_with_the_panels_operators_need():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pd-cluster" and dashboard["schemaVersion"] >= 36
    titles = {p["title"] for p in panels(dashboard)}
    for title in ("Request rate by outcome", "Errors", "Time to first token", "Time per output token",
                  "End-to-end latency", "KV transfer bytes / s", "Prefix hit rate", "KV use per node",
                  "Queue per node"):
        assert title in titles
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job"}
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_metric_the_dashboard_reads_is_exported_by_the_master(metrics_text):
    series = exported(metrics_text)
    used = queries(json.loads(DASHBOARD.read_text()))
    assert len(used) >= 15
    for title, expr, legend in used:
        names = set(_NAME.findall(expr))
        assert names, f"{title}: no pdc_ series in {expr}"
        missing = names - series.keys()
        assert not missing, f"{title}: {sorted(missing)} not in /metrics"
        labels = set().union(*(series[n] for n in names)) | _SCRAPE_LABELS
        grouped = {label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip()}
        assert grouped <= labels, f"{title}: groups by {sorted(grouped - labels)}, which no series has"
        assert set(_LEGEND.findall(legend)) <= grouped | _SCRAPE_LABELS, f"{title}: legend {legend!r}"
        for label, value in _MATCHER.findall(expr):
            assert label in labels, f"{title}: matches on label {label!r}, which no series has"


def test_per_node_series_name_every_node(metrics_text):
    series = exported(metrics_text)
    nodes = {s.labels["node"]: s for f in text_string_to_metric_families(metrics_text) for s in f.samples
             if s.name == "pdc_node_kv_transfer_bytes_total"}
    assert set(nodes) == {"p0", "d0"}
    assert nodes["p0"].value == nodes["d0"].value == 2048  # P sent what D received
    assert {"node", "role"} <= series["pdc_node_kv_used_ratio"]
    samples = {(s.name, s.labels["node"]): s.value for f in text_string_to_metric_families(metrics_text)
               for s in f.samples if s.name.startswith("pdc_node_")}
    assert samples[("pdc_node_kv_used_ratio", "d0")] == pytest.approx(1 - 3000 / 4096)
    assert samples[("pdc_node_prefix_hit_ratio", "d0")] == pytest.approx(0.4)
    assert samples[("pdc_node_waiting_requests", "p0")] == 1
    assert samples[("pdc_node_queued_prefill_tokens", "p0")] == 64
    assert samples[("pdc_node_draining", "d0")] == 0


# ---- the chart ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    api = FakeKubeAPI()
    api.start()
    engine = Helm(api, tmp_path_factory.mktemp("helm-home"))
    yield engine
    engine.close()
    api.stop()


@pytest.mark.timeout(60)
def test_dashboard_config_map_is_off_by_default(helm: Helm) -> None:
    release = helm.install()
    assert [m for m in release.kinds("ConfigMap") if m["metadata"]["name"].endswith("-dashboard")] == []


@pytest.mark.timeout(60)
def test_chart_installs_the_dashboard_for_grafanas_sidecar(helm: Helm) -> None:
    release = helm.install({"monitoring": {
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}},
        "serviceMonitor": {"enabled": True},
    }})
    config_map = release.one("ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["labels"]["app.kubernetes.io/name"] == "pd-cluster"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert json.loads(config_map["data"]["pd-cluster.json"]) == json.loads(DASHBOARD.read_text())
    assert len(release.kinds("ServiceMonitor")) == 1  # the dashboard's data


@pytest.mark.timeout(60)
def test_chart_lints_clean_with_the_dashboard_on(helm: Helm, tmp_path: Path) -> None:
    from tests.deploy.test_helm_chart import WARNING, chart_with_values

    chart = chart_with_values(tmp_path, {"monitoring": {"dashboard": {"enabled": True}}})
    assert [m for m in helm.lint(chart) if m["Severity"] >= WARNING] == []
