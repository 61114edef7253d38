"""The master's live status page (/status).

In a real headless Chromium (Debian's chromium and chromium-driver, driven by selenium) against a
real cluster on CPU: the page asks for the token, then shows every node, the requests served and
the routing decisions, and a node drained with `pd-cluster nodes drain` changes its row. A
screenshot is written to $PD_TEST_ARTIFACTS (default: test-artifacts/ in the repository).
Access rules and the JSON it polls are checked over HTTP against a master with test-double nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from master.request_log import RequestRecord
from master.status_page import TrafficHistory, percentile
from tests.cluster_harness import ADMIN_TOKEN, wait_until
from tests.master_fakes import (
    ADMIN_HEADERS, FakeNode, LiveMaster, make_settings, serve_one, wait_warm, write_model_dir,
)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PD_TEST_ARTIFACTS", REPO / "test-artifacts"))
STATUS_TOKEN = "read-only-status-token"
MODEL = "SmolLM2-135M-Instruct"


# ---- in a real browser, against a real cluster -----------------------------------------------------


def chromium_driver():
    """Headless Chromium through chromedriver, both from Debian's packages (chromium, chromium-driver)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    assert browser and driver_path, (
        "the status page is tested in Chromium: apt-get install chromium chromium-driver (Debian packages)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1100"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver_path), options=options)


@pytest.fixture(scope="module")
def cluster(served_cluster):
    """The shared cluster (p0, d0) and a second prefill node p1, which the test drains."""
    served_cluster.start_node("prefill", "p1")
    wait_until(lambda: served_cluster.health()[1].get("warm_pairs") == 2, 60, "two warm pairs")
    yield served_cluster
    if served_cluster.node("p1") is not None:
        served_cluster.admin("POST", "/admin/nodes/p1/drain")
    wait_until(lambda: served_cluster.procs["p1"].poll() is not None, 60, "p1 to leave")


@pytest.fixture(scope="module")
def browser():
    driver = chromium_driver()
    try:
        yield driver
    finally:
        driver.quit()


# Read in one script call: the page redraws its tables every poll, so element handles go stale.
def node_states(driver) -> dict[str, str]:
    return dict(driver.execute_script(
        "return Array.from(document.querySelectorAll('#nodes tbody tr[data-node-id]'))"
        ".map(r => [r.dataset.nodeId, r.dataset.state])"))


def routed_requests(driver) -> dict[str, str]:
    """Request id -> the row's text, of the routing decisions table."""
    return dict(driver.execute_script(
        "return Array.from(document.querySelectorAll('#routing tbody tr[data-request-id]'))"
        ".map(r => [r.dataset.requestId, r.innerText])"))


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def test_status_page_in_chromium_shows_nodes_traffic_and_a_drain(cluster, browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(cluster.url + "/status")
    assert "sign in" in browser.title  # no token yet: the form
    browser.find_element("id", "token").send_keys(ADMIN_TOKEN)
    browser.find_element("css selector", "form button").click()
    wait = WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: d.title == "pd-cluster status")
    wait.until(lambda d: node_states(d) == {"p0": "active", "p1": "active", "d0": "active"})
    assert text_of(browser, "health") == "serving"
    assert text_of(browser, "model") == f"{MODEL} · cache_aware · master {socket.gethostname()}:{cluster.port}"

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = [client.completions.create(model=MODEL, prompt=f"Count to {n}:", max_tokens=4).id for n in (3, 4, 5)]
    wait.until(lambda d: set(routed_requests(d)) >= set(ids))
    routing = routed_requests(browser)[ids[0]]
    assert "→ d0" in routing and "warm pair" in routing
    wait.until(lambda d: text_of(d, "requests-rate") not in ("-", "0.00"))
    assert text_of(browser, "ttft").endswith("ms")
    assert browser.execute_script("return document.querySelectorAll('#chart-requests polyline').length") > 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    drained = subprocess.run(
        [sys.executable, "-m", "pd_cluster.cli", "nodes", "drain", "p1", "--master", cluster.url],
        env={**os.environ, "PD_ADMIN_TOKEN": ADMIN_TOKEN}, capture_output=True, text=True, timeout=60)
    assert drained.returncode == 0, drained.stderr
    # The row turns "draining", then goes when the node has left: either is the page following it.
    wait.until(lambda d: node_states(d).get("p1", "gone") in ("draining", "gone"))
    wait.until(lambda d: "p1" not in node_states(d))
    assert node_states(browser) == {"p0": "active", "d0": "active"}
    browser.save_screenshot(str(ARTIFACTS / "status-page-after-drain.png"))

    # No script error; the only failed load is the sign-in page's own 401 (the form, before the token).
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and not (e["source"] == "network" and e["message"].startswith(cluster.url + "/status - ")
                       and "401" in e["message"])]
    assert not errors, errors


# ---- access and data over HTTP -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def master_with_traffic(tmp_path_factory):
    """A master (test-double nodes) that served one request, and its status page's answers."""
    results: dict[str, object] = {}

    async def run() -> None:
        settings = make_settings(write_model_dir(tmp_path_factory.mktemp("model")), status_token=STATUS_TOKEN)
        async with LiveMaster(settings) as master:
            prefill, decode = FakeNode(master, "p0", "prefill"), FakeNode(master, "d0", "decode")
            await prefill.join()
            await decode.join()
            await wait_warm(master)
            body = {"model": "tiny-llama", "prompt": "ab"}
            call = asyncio.create_task(master.http.post("/v1/completions", json=body))
            await serve_one(prefill, decode, [(20, "x"), (21, "y")], transfer_bytes=512)
            assert (await call).status_code == 200
            http = master.http
            results["anonymous"] = await http.get("/status")
            results["wrong"] = await http.get("/status", params={"token": "nope"})
            results["login"] = await http.post("/status/login", content="token=" + STATUS_TOKEN,
                                               headers={"Content-Type": "application/x-www-form-urlencoded"})
            cookie = results["login"].cookies.get("pd_status")
            http.cookies.clear()  # the shared client stays anonymous; the "browser" below holds the cookie
            jar = {"pd_status": cookie} if cookie else {}
            async with httpx.AsyncClient(base_url=master.base_url, cookies=jar, timeout=10) as browser:
                results["page"] = await browser.get("/status")
                results["data"] = await browser.get("/status/data")
                results["js"] = await browser.get("/status/static/status.js")
                results["traversal"] = await browser.get("/status/static/..%2Fstatus_page.py")
                results["admin_with_cookie"] = await browser.get("/admin/nodes")
            results["bearer"] = await http.get("/status/data", headers=ADMIN_HEADERS)
            results["status_token_on_admin"] = await http.get(
                "/admin/nodes", headers={"Authorization": f"Bearer {STATUS_TOKEN}"})
            results["data_anonymous"] = await http.get("/status/data")
            await prefill.close()
            await decode.close()

    asyncio.run(run())
    return results


def test_the_page_asks_for_a_token_and_keeps_a_cookie_not_the_token(master_with_traffic):
    r = master_with_traffic
    assert r["anonymous"].status_code == 401 and '<form method="post" action="/status/login">' in r["anonymous"].text
    assert r["wrong"].status_code == 401 and "Wrong token." in r["wrong"].text
    login = r["login"]
    assert login.status_code == 303 and login.headers["location"] == "/status"
    set_cookie = login.headers["set-cookie"]
    assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower()
    assert STATUS_TOKEN not in set_cookie
    assert r["page"].status_code == 200 and 'id="nodes"' in r["page"].text
    assert r["js"].status_code == 200 and "/status/data" in r["js"].text
    assert r["traversal"].status_code == 404
    assert r["data_anonymous"].status_code == 401


def test_the_read_only_token_opens_the_page_and_nothing_else(master_with_traffic):
    r = master_with_traffic
    assert r["data"].status_code == 200
    assert r["status_token_on_admin"].status_code == 401
    assert r["admin_with_cookie"].status_code == 401
    assert r["bearer"].status_code == 200  # the admin token opens it too


def test_status_data_has_nodes_traffic_and_routing(master_with_traffic):
    data = master_with_traffic["data"].json()
    assert {n["id"] for n in data["nodes"]} == {"p0", "d0"}
    assert data["master"].endswith(":8000")  # which master answered (its traffic is its own)
    assert data["health"] == {"prefill_nodes": 1, "decode_nodes": 1, "mixed_nodes": 0, "warm_pairs": 1, "queued_requests": 0,
                              "running_requests": 0}
    assert data["headline"]["requests_per_s"] == pytest.approx(1 / 60)
    assert data["headline"]["ttft_s"]["p50"] > 0
    assert len(data["series"]["points"]) == 120
    assert sum(p["kv_bytes_per_s"] for p in data["series"]["points"]) * data["series"]["bucket_s"] == 512
    [decision] = data["routing"]
    assert (decision["prefill"], decision["decode"], decision["outcome"]) == ("p0", "d0", "ok")
    assert decision["routing"].startswith("cache_aware; P -> D (local disabled); priced ") and "; warm pair" in decision["routing"]
    assert data["errors"] == []
    json.dumps(data)


# ---- the numbers, without a master -------------------------------------------------------------------


def _record(outcome: str = "ok", ttft: float | None = 0.1, tpot: float | None = 0.01,
            moved: int = 100) -> RequestRecord:
    return RequestRecord(
        request_id="r", client_request_id=None, outcome=outcome, finish_reason="stop", error=None, prefill="p",
        decode="d", attempts=1, path="pd", route_reason="long_miss", routing="x", prompt_tokens=10, cached_tokens=0, decode_hit_tokens=0,
        transferred_tokens=10, transfer_bytes=moved, completion_tokens=5, ttft_s=ttft, dispatch_s=None, node_ttft_s=None,
        prefix_query_s=None, prefill_s=None, tpot_s=tpot, e2e_s=1.0,
        stream=False, ended_at=0.0)


def test_traffic_history_buckets_rates_and_percentiles():
    history = TrafficHistory(bucket_s=5.0, buckets=4)
    for i in range(10):
        history.add(_record(ttft=0.01 * (i + 1)), now=1000.0)
    history.add(_record(outcome="error", ttft=None, tpot=None, moved=0), now=1006.0)
    head = history.headline(now=1007.0, window_s=10.0)
    assert head["requests_per_s"] == pytest.approx(1.1)
    assert head["error_ratio"] == pytest.approx(1 / 11)
    assert head["kv_bytes_per_s"] == pytest.approx(100.0)
    assert head["ttft_s"]["p50"] == pytest.approx(0.05) and head["ttft_s"]["p99"] == pytest.approx(0.10)
    points = history.series(now=1007.0)["points"]
    assert [p["t"] for p in points] == [990.0, 995.0, 1000.0, 1005.0]
    assert [p["requests_per_s"] for p in points] == [0.0, 0.0, 2.0, 0.2]
    assert points[0]["ttft_p50"] is None
    history.add(_record(), now=1030.0)  # old buckets roll off
    assert len(history.buckets) <= 4 and history.series(now=1030.0)["points"][-1]["requests_per_s"] == 0.2
    assert percentile([], 0.5) is None and percentile([3.0, 1.0, 2.0], 0.5) == 2.0
