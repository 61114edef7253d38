"""A decode step's tokens in one frame (``TokenDeltas``): the message, the node that sends it,
the links that route it, and the master that relays it to every stream it names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from decode_node.node import DecodeNode
from decode_node.service import FirstTokenOut
from pd_cluster import protocol
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.node import agent as agent_module
from pd_cluster.node.agent import NodeAgent, coalesced
from pd_cluster.node.master_links import MasterLinks
from tests.master_fakes import MODEL, FakeNode, LiveMaster, make_settings, wait_until, wait_warm, write_model_dir


def _delta(request_id: str, *token_ids: int, text: str = "", **fields) -> protocol.TokenDelta:
    return protocol.TokenDelta(request_id=request_id, token_ids=list(token_ids), text=text, **fields)


# ---- the message ----------------------------------------------------------------------------


def test_token_deltas_round_trip_keeps_every_field():
    logprob = protocol.TokenLogprob(token_id=5, logprob=-0.25, top={5: -0.25, 6: -2.0})
    message = protocol.TokenDeltas(deltas=[
        _delta("a", 5, 6, text="xy", logprobs=[logprob, logprob], cached_tokens=16, node_ttft_s=0.01),
        _delta("b", 7, text="z", finish_reason="stop"),
    ])
    parsed = protocol.parse_node_message(protocol.encode(message))
    assert parsed == message
    assert [d.request_id for d in parsed.deltas] == ["a", "b"]


@pytest.mark.parametrize("frame", [
    {"type": "token_deltas", "deltas": []},
    {"type": "token_deltas", "deltas": [{"type": "token_delta", "request_id": "a", "token_ids": "many"}]},
    {"type": "token_deltas", "deltas": [{"type": "status"}]},
    {"type": "token_deltas", "deltas": [{"type": "token_delta", "request_id": "a", "token_ids": [1]}], "extra": 1},
])
def test_an_empty_or_malformed_batch_is_rejected(frame):
    with pytest.raises(ValueError):
        protocol.parse_node_message(json.dumps(frame))


def test_a_batch_over_the_frame_bound_goes_as_several_frames_in_order(monkeypatch):
    message = protocol.TokenDeltas(deltas=[_delta(f"r{i}", i, text="t" * 100) for i in range(10)])
    assert protocol.encode_frames(message) == [protocol.encode(message)]
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 450)
    frames = protocol.encode_frames(message)
    assert len(frames) > 1 and all(len(f) <= 450 for f in frames)
    ids = [d.request_id for f in frames for d in protocol.parse_node_message(f).deltas]
    assert ids == [f"r{i}" for i in range(10)]


# ---- the node -------------------------------------------------------------------------------


def test_a_decode_step_is_one_frame_with_a_delta_a_request():
    node = DecodeNode.__new__(DecodeNode)
    sent: list = []
    node.send = sent.append
    node.service = SimpleNamespace(first_token_out=lambda rid: FirstTokenOut(32, 0.02) if rid == "b" else None)
    logprob = protocol.TokenLogprob(token_id=2, logprob=-1.0)
    node._on_tokens([
        TokenUpdate("a", 1, "x", None, None),
        TokenUpdate("b", 2, "y", logprob, None, first_token=True),
        TokenUpdate("a", 3, "z", None, "length"),
    ])
    assert len(sent) == 1 and isinstance(sent[0], protocol.TokenDeltas)
    a, b = sent[0].deltas
    assert (a.request_id, a.token_ids, a.text, a.finish_reason, a.cached_tokens) == ("a", [1, 3], "xz", "length", None)
    assert (b.request_id, b.token_ids, b.logprobs, b.cached_tokens, b.node_ttft_s) == ("b", [2], [logprob], 32, 0.02)
    # Built without validation, it still is what the master parses back, field for field.
    assert protocol.parse_node_message(protocol.encode(sent[0])).model_dump() == protocol.TokenDeltas(deltas=[
        _delta("a", 1, 3, text="xz", finish_reason="length"),
        _delta("b", 2, text="y", logprobs=[logprob], cached_tokens=32, node_ttft_s=0.02),
    ]).model_dump()
    node._on_tokens([])
    assert len(sent) == 1


def test_adjacent_batches_queued_together_go_as_one_in_order():
    status = protocol.Drained()
    queued = [protocol.TokenDeltas(deltas=[_delta("a", 1)]), protocol.TokenDeltas(deltas=[_delta("b", 2), _delta("a", 3)]),
              status, protocol.TokenDeltas(deltas=[_delta("a", 4, finish_reason="stop")])]
    out = coalesced(queued)
    assert [type(m) for m in out] == [protocol.TokenDeltas, protocol.Drained, protocol.TokenDeltas]
    assert [(d.request_id, d.token_ids) for d in out[0].deltas] == [("a", [1]), ("b", [2]), ("a", [3])]
    assert out[1] is status and out[2] is queued[3]
    assert coalesced([]) == [] and coalesced([status]) == [status]


class _Socket:
    """A link's websocket: records frames; ``stall`` makes a send wait for good."""

    def __init__(self, stall: bool = False) -> None:
        self.frames: list[str] = []
        self.stall = stall

    async def send(self, frame: str) -> None:
        if self.stall:
            await asyncio.Event().wait()
        self.frames.append(frame)


def _agent() -> NodeAgent:
    """A link never dialled (no registration): its sender and reporter run on the sockets given."""
    return NodeAgent("http://m", "token", None, lambda: protocol.Drained(), None)  # type: ignore[arg-type]


async def test_the_sender_sends_what_queued_meanwhile_in_fewer_frames():
    agent, ws = _agent(), _Socket()
    for i in range(3):
        agent.send_nowait(protocol.TokenDeltas(deltas=[_delta("a", i)]))
    agent.send_nowait(protocol.Drained())
    sender = asyncio.create_task(agent._sender(ws))
    await wait_until(lambda: len(ws.frames) == 2, timeout=5)
    sender.cancel()
    first, second = (protocol.parse_node_message(f) for f in ws.frames)
    assert [d.token_ids for d in first.deltas] == [[0], [1], [2]] and isinstance(second, protocol.Drained)


async def test_a_send_that_stalls_drops_the_link(monkeypatch):
    monkeypatch.setattr(agent_module, "SEND_TIMEOUT_S", 0.3)
    monkeypatch.setattr(protocol, "STATUS_INTERVAL_S", 0.05)
    agent = _agent()
    agent.send_nowait(protocol.Drained())
    sender = asyncio.create_task(agent._sender(_Socket(stall=True)))
    with pytest.raises(TimeoutError, match="to go out"):
        await asyncio.wait_for(agent._reporter(), 5)
    sender.cancel()


class _Agent:
    def __init__(self, url: str) -> None:
        self.url = url
        self.registered = asyncio.Event()
        self.registered.set()
        self.sent: list = []

    def send_nowait(self, message) -> None:
        self.sent.append(message)


async def test_links_send_each_delta_to_its_requests_master_and_the_rest_to_all():
    links = MasterLinks(["http://m1", "http://m2"], "token", None, lambda: None, None)  # type: ignore[arg-type]
    m1, m2 = _Agent("ws://m1"), _Agent("ws://m2")
    links.agents = {m1.url: m1, m2.url: m2}
    links.send_nowait(protocol.TokenDeltas(deltas=[_delta("x", 1)]))
    assert [len(m.sent) for m in (m1, m2)] == [1, 1]  # no owner known: every master
    links._owner["a"] = m1  # type: ignore[assignment]
    links._owner["b"] = m2  # type: ignore[assignment]
    links.send_nowait(protocol.TokenDeltas(deltas=[_delta("a", 1), _delta("b", 2), _delta("c", 3)]))
    assert [d.request_id for d in m1.sent[-1].deltas] == ["a", "c"]
    assert [d.request_id for d in m2.sent[-1].deltas] == ["b", "c"]
    m2.registered.clear()  # its link is down: it settled its requests already
    links.send_nowait(protocol.TokenDeltas(deltas=[_delta("b", 4)]))
    assert len(m1.sent) == 2 and len(m2.sent) == 2


# ---- the master -----------------------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path))) as master:
        prefill = FakeNode(master, "p0", "prefill")
        decode = FakeNode(master, "d0", "decode")
        await prefill.join()
        await decode.join()
        await wait_warm(master)
        yield master, prefill, decode
        await prefill.close()
        await decode.close()


def _stream_text(text: str) -> tuple[str, list]:
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    pieces = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return pieces, [e["choices"][0]["finish_reason"] for e in events if e["choices"]]


async def test_one_frame_feeds_every_stream_it_names_in_order(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": "q", "stream": True, "max_tokens": 8, "logprobs": 1}
    calls = [asyncio.create_task(master.http.post("/v1/completions", json=body)) for _ in range(2)]
    jobs = [await prefill.next_job(), await prefill.next_job()]
    a, b = (job.request_id for job in jobs)
    for job, (token, text) in zip(jobs, [(6, "A"), (7, "B")]):
        await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=token, text=text,
                                               logprob=protocol.TokenLogprob(token_id=token, logprob=-0.5)))
    lp = [protocol.TokenLogprob(token_id=8, logprob=-1.0), protocol.TokenLogprob(token_id=9, logprob=-2.0)]
    await decode.send(protocol.TokenDeltas(deltas=[_delta(a, 8, 9, text="bc", logprobs=lp), _delta(b, 8, text="b",
                                                                                                  logprobs=lp[:1])]))
    await decode.send(protocol.TokenDeltas(deltas=[_delta(b, 9, text="c", logprobs=lp[1:], finish_reason="length"),
                                                   _delta(a, 10, text="d", finish_reason="stop",
                                                          logprobs=[protocol.TokenLogprob(token_id=10, logprob=-3.0)])]))
    answers = [await call for call in calls]
    text_a, finishes_a = _stream_text(answers[0].text)
    text_b, finishes_b = _stream_text(answers[1].text)
    assert (text_a, finishes_a[-1]) == ("Abcd", "stop")
    assert (text_b, finishes_b[-1]) == ("Bbc", "length")
    events = [json.loads(line[6:]) for line in answers[0].text.split("\n\n") if line.startswith("data: {")]
    logprobs = [lp for e in events for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert logprobs == [-0.5, -1.0, -2.0, -3.0]


async def test_a_malformed_batch_is_dropped_and_the_node_stays(cluster):
    master, prefill, decode = cluster
    await decode.send(json.dumps({"type": "token_deltas", "deltas": [{"type": "token_delta", "request_id": "x"}]}))
    await decode.send(json.dumps({"type": "token_deltas", "deltas": []}))
    too_big = protocol.TokenDeltas(deltas=[_delta("x", 1, text="t" * protocol.MAX_MESSAGE_BYTES)])
    await decode.send(protocol.encode(too_big))
    record = master.ctx.registry.nodes["d0"]
    await wait_until(lambda: record.malformed_frames == 3, what="three frames dropped")
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "q"}))
    job = await prefill.next_job()
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=6, text="A"))
    await decode.send(protocol.TokenDeltas(deltas=[_delta("unknown", 1), _delta(job.request_id, 7, text="B",
                                                                                finish_reason="stop")]))
    assert (await call).json()["choices"][0]["text"] == "AB"
    assert "d0" in await master.nodes()
