"""schemathesis against the master's own OpenAPI document: whatever a client sends to the OpenAI
routes (valid by the schema or not), the answer is never a 5xx. Nodes are fakes that answer every
job at once, so a valid request is served rather than refused for want of nodes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pd_cluster import protocol
from tests.master_fakes import MODEL, FakeNode, LiveMaster, make_settings, wait_warm, write_model_dir

#: Random cases per operation (twice schemathesis' default). With its boundary cases on top, the run
#: makes over 1000 calls (1430 at 200, checked by the last test); 550 made ~2500 in four times as long.
CASES = 200
#: Calls made, by answer status (checked by the last test).
CALLS: dict[int, int] = {}


class ServedMaster:
    """A master with one fake P/D pair, served from an event loop on its own thread."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-master", daemon=True)
        self.master: LiveMaster | None = None
        self.nodes: list[FakeNode] = []
        self.answered = 0
        self.answering: asyncio.Task | None = None

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        # Small bodies keep each case quick; the queue never waits long. The fake nodes' heartbeats
        # share this process with schemathesis' generation: on a loaded machine they can lag past
        # the usual 2 s, and a node evicted for it would turn valid cases into 503s.
        self.master = LiveMaster(make_settings(self.model_dir, queue_timeout_s=1.0, max_body_bytes=256 * 1024,
                                               heartbeat_timeout_s=120.0))
        await self.master.__aenter__()
        prefill, decode = FakeNode(self.master, "p0", "prefill"), FakeNode(self.master, "d0", "decode")
        assert isinstance(await prefill.join(), protocol.Registered)
        assert isinstance(await decode.join(), protocol.Registered)
        self.nodes = [prefill, decode]
        await wait_warm(self.master)
        self.answering = self.loop.create_task(self._answer(prefill))

    async def _answer(self, prefill: FakeNode) -> None:
        """P answers every job with one token that ends the request."""
        while True:
            job = await prefill.jobs.get()
            await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=5, text="a",
                                                   finish_reason="length" if job.sampling.max_tokens == 1 else "stop"))
            self.answered += 1

    async def _stop(self) -> None:
        if self.answering is not None:
            self.answering.cancel()
        for node in self.nodes:
            await node.close()
        assert self.master is not None
        await self.master.__aexit__(None, None, None)

    def __enter__(self) -> "ServedMaster":
        self.thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *exc) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[ServedMaster]:
    with ServedMaster(write_model_dir(tmp_path_factory.mktemp("model"))) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(served):
    assert served.master is not None
    response = served.run(served.master.http.get("/openapi.json"))
    assert response.status_code == 200
    doc = response.json()
    doc["paths"] = {path: item for path, item in doc["paths"].items() if path.startswith("/v1/")}  # the OpenAI API
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        # Mostly the served model, so that valid cases go all the way to the nodes.
        doc["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    return schemathesis.openapi.from_dict(doc)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_client_input_yields_a_5xx(case, served):
    assert served.master is not None
    response = case.call(base_url=served.master.base_url, timeout=30)
    CALLS[response.status_code] = CALLS.get(response.status_code, 0) + 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text[:500])
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except ValueError:
            raise AssertionError((case.method, case.path, case.headers, case.body, response.status_code,
                                  response.headers, response.text[:300])) from None
        assert set(error) == {"message", "type", "param", "code"}


def test_the_schema_run_made_over_1000_calls_and_served_requests_too(served):
    """Valid cases were served by the nodes, not only refused: the run exercised the whole path."""
    assert sum(CALLS.values()) >= 1000, CALLS
    assert served.answered > 0 and CALLS.get(200, 0) > 0, CALLS
