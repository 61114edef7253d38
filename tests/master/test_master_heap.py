"""A master process freezes what its start-up left on the heap, so that no garbage collection walks
it again (one walk of it stalled every stream ~100 ms), and times each collection it still runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from tests import process_server
from tests.cluster_harness import CLUSTER_TOKEN, free_port, wait_until

#: Fewer than the objects of any master's start-up (the app, its routes, pydantic's schemas).
FROZEN_AT_LEAST = 10_000


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_a_master_process_freezes_its_start_up_heap_and_times_every_collection(default_model_dir: Path,
                                                                             tmp_path: Path):
    port = free_port()
    env = {**os.environ, "PD_CLUSTER_TOKEN": CLUSTER_TOKEN, "PYTHONUNBUFFERED": "1"}
    master = process_server.start(["master", "--host", "127.0.0.1", "--port", str(port),
                                   "--model", str(default_model_dir)], env, tmp_path / "master.log")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        def scraped() -> str | None:
            try:
                return httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                assert master.poll() is None, (tmp_path / "master.log").read_text()
                return None

        text = wait_until(scraped, 60, "the master's metrics")
        frozen = metric(text, "pdc_gc_frozen_objects")
        assert frozen is not None and frozen >= FROZEN_AT_LEAST, frozen
        # Each scrape allocates enough for young collections to run: each one is timed.
        young = 'pdc_gc_pause_seconds_count{generation="0"}'
        wait_until(lambda: (metric(scraped() or "", young) or 0) > 0, 60, "a timed young collection")
        assert "heap settled" in (tmp_path / "master.log").read_text()
    finally:
        master.terminate()
        master.wait(30)
