"""A plain delta's output (no logprobs) taken by ``RelayRequest.add_plain`` leaves the request as
``add_output`` of the same chunk would: its ids, text and first-token time, the sink offered the
text while it takes pieces, and the chunk buffered (its task woken) when the sink refuses it, when
earlier output still waits, or when it is the last piece (the finish is the task's to write)."""

from __future__ import annotations

import pytest

from master.relay_request import RelayRequest, TokenChunk
from master.routing import RouteRequest
from pd_cluster.sampling_params import SamplingParams


class Sink:
    def __init__(self, takes: bool, busy: bool = False) -> None:
        self.takes, self._busy = takes, busy
        self.offered: list[tuple[list[int], str]] = []

    def offer(self, chunk: TokenChunk) -> bool:
        raise AssertionError("a plain piece is offered as text")

    def offer_plain(self, token_ids: list[int], text: str) -> bool:
        self.offered.append((token_ids, text))
        return self.takes

    @property
    def busy(self) -> bool:
        return self._busy

    async def settle(self) -> None:
        pass


def _request(sink: Sink | None, stream: bool = True) -> RelayRequest:
    prompt = [1, 2, 3]
    r = RelayRequest(request_id="chatcmpl-plain", token_ids=prompt, sampling=SamplingParams(max_tokens=8),
                     stream=stream, arrival=0.0, deadline=600.0, route=RouteRequest(prompt, 11))
    r.sink = sink
    return r


def _state(r: RelayRequest) -> tuple:
    return (list(r.output_ids), r.text, r.first_token_at, r.sent, list(r.buffer), r.wakeup.is_set())


@pytest.mark.parametrize("takes,busy,finish,stream,waiting", [
    (True, False, None, True, False), (True, True, None, True, False), (False, False, None, True, False),
    (True, False, "length", True, False), (True, False, None, True, True), (True, False, None, False, False)])
def test_add_plain_leaves_the_request_as_add_output_does(takes, busy, finish, stream, waiting) -> None:
    plain, model = _request(Sink(takes, busy), stream), _request(None, stream)
    for r in (plain, model):
        if waiting:
            r.buffer.append(TokenChunk([7], "x", None, None))
    plain.add_plain([9, 10], "ab", finish, 5.0)
    model.add_output(TokenChunk([9, 10], "ab", None, finish), 5.0)
    offered = stream and finish is None and not waiting
    assert plain.sink.offered == ([([9, 10], "ab")] if offered else [])
    taken = offered and takes
    expected = _state(model)
    if taken:  # written by the sink: nothing buffered, the task woken only to settle a busy write
        expected = (*expected[:4], [], busy)
    assert _state(plain) == expected
