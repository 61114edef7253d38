"""A ``token_deltas`` frame read without pydantic: it takes only what the model takes, with the
same values (anything else goes the model's way, so a malformed frame is rejected as before), and
a stream answered through it gets the same bytes as through the model."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from master.app import create_app
from master.config import MasterSettings
from master.delta_frames import delta_model, plain_deltas
from master.node_ws import handle_frame
from pd_cluster import protocol
from pd_cluster.bench.master_relay_path import _register
from pd_cluster.bench.stamped_nodes import frames_of
from tests.master.test_direct_send import STEPS, Client, _open
from tests.master.test_sse_encoding import TRICKY


def _frame(*deltas: dict[str, Any]) -> str:
    return json.dumps({"type": "token_deltas", "deltas": list(deltas)}, ensure_ascii=False)


PLAIN = {"type": "token_delta", "request_id": "a-1", "token_ids": [5, 6], "text": "hé\n", "finish_reason": None}
#: Frames the model takes: all but the last three are read the fast way (plain, or plain but for a
#: first delta's prefill report).
VALID = [
    _frame(PLAIN),
    protocol.encode(protocol.TokenDeltas(deltas=[protocol.TokenDelta(request_id="x", token_ids=[1], text="😀"),
                                                 protocol.TokenDelta(request_id="y", token_ids=[2],
                                                                     finish_reason="stop")])),
    _frame({"request_id": "b", "token_ids": []}),
    _frame({**PLAIN, "finish_reason": "length", "logprobs": None, "beams": None, "cached_tokens": None}),
    json.dumps({"type": "token_deltas", "deltas": [PLAIN]}),  # ASCII escapes of é
    json.dumps({"type": "token_deltas", "deltas": [{**PLAIN, "text": "😀"}]}),  # a surrogate pair escaped
    _frame({**PLAIN, "cached_tokens": 0, "node_ttft_s": 0.01}),
    _frame({**PLAIN, "request_id": "b", "cached_tokens": 7}, PLAIN, {**PLAIN, "node_ttft_s": 0, "logprobs": None}),
    _frame({**PLAIN, "token_ids": [1.0]}),  # the model takes a whole float as an int
    _frame({**PLAIN, "logprobs": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.0}]}),
]
PLAIN_COUNT = 8
MALFORMED = [
    _frame(),
    _frame({**PLAIN, "token_ids": ["eleven"]}),
    _frame({**PLAIN, "token_ids": [True]}) + "x",
    _frame({**PLAIN, "token_ids": 5}),
    _frame({**PLAIN, "token_ids": [[5]]}),
    _frame({**PLAIN, "request_id": 7}),
    _frame({**PLAIN, "text": None}),
    _frame({**PLAIN, "finish_reason": "done"}),
    _frame({**PLAIN, "finish_reason": ["stop"]}),
    _frame({**PLAIN, "type": "first_token"}),
    _frame({**PLAIN, "surprise": 1}),
    _frame({k: v for k, v in PLAIN.items() if k != "request_id"}),
    _frame(PLAIN, {**PLAIN, "token_ids": [-1.5]}),
    _frame({**PLAIN, "cached_tokens": -1}),
    _frame({**PLAIN, "node_ttft_s": float("nan")}),
    _frame({**PLAIN, "node_ttft_s": -0.5}),
    _frame({**PLAIN, "cached_tokens": 1.5}),
    _frame({**PLAIN, "cached_tokens": "3"}) + "]",
    _frame(PLAIN).replace('"hé\\n"', '"\\ud800"'),  # half a surrogate pair
    json.dumps({"type": "token_deltas", "deltas": [PLAIN], "more": 1}),
    json.dumps({"type": "token_deltas", "deltas": {"0": PLAIN}}),
    json.dumps({"deltas": [PLAIN]}),
    json.dumps([{"type": "token_deltas", "deltas": [PLAIN]}]),
    '{"type": "token_deltas", "deltas": [' + "[" * 5000 + "]" * 5000 + "]}",
    _frame(PLAIN)[:-2],
    _frame({**PLAIN, "text": "x" * protocol.MAX_MESSAGE_BYTES}),
]


@pytest.mark.parametrize("frame", VALID, ids=range(len(VALID)))
def test_a_frame_the_model_takes_gives_the_models_values_or_goes_its_way(frame: str):
    model = protocol.parse_node_message(frame)
    assert isinstance(model, protocol.TokenDeltas)
    plain = plain_deltas(frame)
    assert (plain is not None) == (VALID.index(frame) < PLAIN_COUNT)
    if plain is not None:
        assert [d if isinstance(d, protocol.TokenDelta) else delta_model(d) for d in plain] == model.deltas
        # only a delta with a prefill report is a model; the rest are plain tuples
        assert [d for d in plain if not isinstance(d, protocol.TokenDelta)] == [
            (d.request_id, d.token_ids, d.text, d.finish_reason) for d in model.deltas
            if d.cached_tokens is None and d.node_ttft_s is None]
        for d in plain:
            if isinstance(d, protocol.TokenDelta):
                assert type(d.node_ttft_s) is not int  # seconds as the model holds them


@pytest.mark.parametrize("frame", MALFORMED, ids=range(len(MALFORMED)))
def test_a_frame_the_model_refuses_is_never_read_the_fast_way(frame: str):
    with pytest.raises(ValueError):
        protocol.parse_node_message(frame)
    assert plain_deltas(frame) is None


@pytest.fixture
async def ctx():
    os.environ.setdefault("PD_CLUSTER_TOKEN", "delta-frames-test")
    yield create_app(MasterSettings()).state.ctx


def _delta(attempt_id: str, step: int, stream: int) -> dict[str, Any]:
    delta: dict[str, Any] = {"type": "token_delta", "request_id": attempt_id, "token_ids": [1000 + step],
                             "text": TRICKY[(step + stream) % len(TRICKY)]}
    if step == STEPS - 1:
        delta["finish_reason"] = "length"
    if step == 0:
        delta.update(cached_tokens=0, node_ttft_s=0.001)
    return delta


def _by_model(ctx: Any, record: Any, frame: str) -> None:
    """The frame applied through the model, as every frame was before the fast path."""
    for delta in protocol.parse_node_message(frame).deltas:
        ctx.relay.on_token_delta(record, delta)


async def _answer(ctx: Any, clients: list[Client], apply: Any) -> list[bool]:
    """Stream every client's answer, a frame a node a step; whether each frame was plain."""
    records = {record.node_id: record for record in _register(ctx, 2)}
    opened = [await _open(ctx, True, c, i) for i, c in enumerate(clients)]
    for _ in range(5):
        await asyncio.sleep(0)
    plain = []
    for step in range(STEPS):
        for node_id, record in records.items():
            deltas = [json.dumps(_delta(a, step, s), ensure_ascii=False)
                      for s, (_, d, a) in enumerate(opened) if d == node_id]
            for frame in frames_of(deltas):
                plain.append(plain_deltas(frame) is not None)
                apply(ctx, record, frame)
        for _ in range(5):
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*(task for task, _, _ in opened if not task.done())), 5.0)
    return plain


async def test_a_stream_gets_the_same_bytes_through_the_fast_path_as_through_the_model(ctx: Any):
    fast, general = [Client() for _ in range(12)], [Client() for _ in range(12)]
    plain = await _answer(ctx, fast, handle_frame)
    await _answer(create_app(MasterSettings()).state.ctx, general, _by_model)
    assert all(plain)  # the first deltas, with their prefill report, too
    for f, g in zip(fast, general):
        assert bytes(f.body) == bytes(g.body)
        assert bytes(f.body).endswith(b"data: [DONE]\n\n") and bytes(f.body).count(b"data: ") == STEPS + 2


async def test_a_malformed_token_deltas_frame_applies_none_of_it_and_ends_the_streams_it_names(ctx: Any):
    record = _register(ctx, 1)[0]
    clients = [Client(), Client()]
    opened = [await _open(ctx, True, c, i) for i, c in enumerate(clients)]
    for _ in range(5):
        await asyncio.sleep(0)
    first = _frame(*[_delta(a, 0, s) for s, (_, _, a) in enumerate(opened)])
    handle_frame(ctx, record, first)
    good, bad = ({**_delta(a, 1, s), "text": f"token {s}"} for s, (_, _, a) in enumerate(opened))
    handle_frame(ctx, record, _frame(good, {**bad, "token_ids": ["eleven"]}))
    assert record.malformed_frames == 1
    await asyncio.wait_for(asyncio.gather(*(task for task, _, _ in opened)), 5.0)
    for client in clients:
        body = bytes(client.body).decode()
        assert "token 0" not in body and "token 1" not in body  # the plain delta beside it was not applied
        assert "sent a malformed token_deltas report" in body and body.endswith("data: [DONE]\n\n")
