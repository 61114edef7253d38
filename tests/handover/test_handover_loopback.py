"""The handover through the loopback backend: a real prefill service and a real decode service
(engines, leases, receiver, every sender) in this process, joined without sockets.

Each path (whole push, layer-wise stream, in-place write into D's pool) moves exactly the KV D
lacks, continues token-identically to a single engine, and leaves no KV slot reserved on D
after an abort, an expired lease or a job that failed halfway.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Literal

import pytest
import torch

from pd_cluster.handover import DISCONNECT_GRACE_S, LoopbackLink, rehearse_handover
from pd_cluster.transfer import ChannelError, DataMessage, PeerConnection, RemoteError
from tests.handover_pairs import ServicePair, single_engine_tokens, start_pair

#: How each path is chosen: D shares its pool (in place), else layer-wise or whole over the channel.
PATHS = {
    "push": {"share": False, "layerwise": False},
    "stream": {"share": False, "layerwise": True, "layerwise_min_tokens": 0},
    "direct": {"share": True, "layerwise": False},
}


def expected_bytes(pair: ServicePair, n_tokens: int, hit_blocks: int) -> int:
    """In place: the missing tokens; through the channel: the missing blocks, the last padded."""
    spec = pair.d.engine.kv_spec
    if pair.channel().shared_pools:
        return (n_tokens - hit_blocks * spec.block_size) * spec.bytes_per_token
    return (math.ceil(n_tokens / spec.block_size) - hit_blocks) * spec.bytes_per_block


#: P and D of different TP, and the path each asks for: a tensor-parallel P sends whole (its
#: layer-wise options are dropped); through the channel a tensor-parallel D receives every head and
#: hands each rank its own, in place P writes each D rank's heads into that rank's pool.
TP_PAIRS = {
    "p2-d1-direct": {"p_tp": 2, **PATHS["direct"]},
    "p2-d1-stream": {"p_tp": 2, **PATHS["stream"]},
    "p1-d2-stream": {"d_tp": 2, **PATHS["stream"]},
    "p2-d2-push": {"p_tp": 2, "d_tp": 2, **PATHS["push"]},
    "p1-d2-direct": {"d_tp": 2, **PATHS["direct"]},
    "p2-d2-direct": {"p_tp": 2, "d_tp": 2, **PATHS["direct"]},
}


@pytest.fixture(params=list(PATHS))
async def pair(request, default_model_dir):
    pair = await start_pair(default_model_dir, **PATHS[request.param])
    pair.label = request.param
    yield pair
    await pair.stop()


@pytest.fixture
async def push_pair(default_model_dir):
    pair = await start_pair(default_model_dir)
    yield pair
    await pair.stop()


@pytest.fixture(scope="module")
def engine_outputs(default_model_dir, chat_prompts) -> list[list[int]]:
    return single_engine_tokens(default_model_dir, chat_prompts[:2])


async def test_each_path_moves_the_missing_blocks_and_continues_like_a_single_engine(pair, chat_prompts,
                                                                                     engine_outputs):
    idle = (await pair.d_stats())["idle"]
    tokens, result = await pair.run(chat_prompts[1])
    assert tokens == engine_outputs[1]
    assert result.committed and result.hit_blocks == 0
    # The delta rule, counted by P's result, D's receiver and the link itself.
    moved = expected_bytes(pair, len(chat_prompts[1]), 0)
    assert result.transfer_bytes == moved == pair.d.counters.kv_bytes_received == pair.p.counters.kv_bytes_sent
    channel = pair.channel()
    assert channel.bytes_sent == moved
    assert channel.transport == ("ipc" if pair.label == "direct" else "loopback")
    stats = await pair.d_stats()
    assert stats["reservations"] == 0 and stats["external_held"] == 0 and stats["idle"] == idle


@pytest.mark.parametrize("case", list(TP_PAIRS))
async def test_p_and_d_of_different_tp_hand_over_every_head_and_a_prefix_hit_on_d(case, default_model_dir,
                                                                                  chat_prompts, engine_outputs,
                                                                                  shm_offered):
    pair = await start_pair(default_model_dir, **TP_PAIRS[case])
    try:
        # A TP 2 engine's pool holds only its own KV heads: the handover re-shards.
        for engine in (pair.p.engine, pair.d.engine):
            assert (engine.pool.spec.num_kv_heads < engine.kv_spec.num_kv_heads) == (engine.config.tp > 1)
        broadcasts = count_kv_broadcasts(pair)
        first = chat_prompts[0]
        tokens, result = await pair.run(first)
        assert tokens == engine_outputs[0]
        # In place into every D rank's pool; a layer-wise stream only from a TP 1 P.
        assert (pair.channel().transport == "ipc") == case.endswith("direct")
        assert len(pair.channel().shared_pools) == (pair.d.engine.config.tp if case.endswith("direct") else 0)
        assert result.transfer_bytes == expected_bytes(pair, len(first), 0)
        assert pair.channel().channel.bytes_sent == (0 if case.endswith("direct") else result.transfer_bytes)
        # In place, each D rank already holds its heads: rank 0 broadcasts no KV to the others.
        if pair.d.engine.tp is not None:
            assert (broadcasts == []) == case.endswith("direct")
        # D's prefix cache holds the first prompt on every rank: only the rest moves.
        follow_up = first + chat_prompts[1][-40:]
        want = single_engine_tokens(default_model_dir, [follow_up])[0]
        tokens, result = await pair.run(follow_up)
        assert tokens == want and result.hit_blocks == len(first) // pair.d.engine.kv_spec.block_size > 0
        stats = await pair.d_stats()
        assert stats["reservations"] == 0 and stats["external_held"] == 0
    finally:
        await pair.stop()


def count_kv_broadcasts(pair: ServicePair) -> list[int]:
    """The slots of each KV broadcast from D's rank 0 to its other ranks, as they happen."""
    counts: list[int] = []
    tp = pair.d.engine.tp
    if tp is not None:
        put_kv = tp.put_kv

        def counted(slots, kv) -> None:
            counts.append(slots.numel())
            put_kv(slots, kv)

        tp.put_kv = counted
    return counts


async def test_a_prefix_hit_moves_only_the_missing_blocks(pair, chat_prompts, engine_outputs):
    first = chat_prompts[0]
    tokens, _ = await pair.run(first)
    assert tokens == engine_outputs[0]
    received = pair.d.counters.kv_bytes_received
    follow_up = first + chat_prompts[1][-40:]
    _, result = await pair.run(follow_up)
    assert result.hit_blocks == len(first) // pair.d.engine.kv_spec.block_size > 0
    assert result.transfer_bytes == expected_bytes(pair, len(follow_up), result.hit_blocks)
    assert pair.d.counters.kv_bytes_received - received == result.transfer_bytes


async def test_a_job_that_fails_after_its_lease_gives_every_slot_back(pair, chat_prompts):
    idle = (await pair.d_stats())["idle"]

    async def master_gone(first) -> None:
        raise ConnectionError("the master went away")

    with pytest.raises(ConnectionError):
        await pair.p.run_job(pair.job(chat_prompts[2]), master_gone)
    # Given back at once; a stream cut halfway closes its channel instead, and D ends the lease
    # of a P that hung up after a short grace.
    deadline = time.monotonic() + (DISCONNECT_GRACE_S + 10.0 if pair.label == "stream" else 0.0)
    while (stats := await pair.d_stats())["reservations"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert stats["reservations"] == 0 and stats["external_held"] == 0 and stats["idle"] == idle
    assert not pair.p.engine.requests and pair.p.counters.queued_prefill_tokens == 0
    _, result = await pair.run(chat_prompts[3])  # the pair still works
    assert result.committed


async def test_a_job_cancelled_again_while_it_cleans_up_leaves_p_as_it_found_it(pair, chat_prompts):
    """A request aborted twice (two masters each send the abort): the second lands while the job
    waits for its engine; P still counts it out, gives back its admission and frees the channel."""
    reported = asyncio.Event()

    async def stuck(first) -> None:
        reported.set()
        await asyncio.sleep(3600)

    job = asyncio.create_task(pair.p.run_job(pair.job(chat_prompts[2]), stuck))
    await asyncio.wait_for(reported.wait(), 60.0)
    job.cancel()
    await asyncio.sleep(0)  # its cleanup starts and waits for the engine thread
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert pair.p.counters.queued_prefill_tokens == 0 and pair.p.admission.admitted_tokens == 0
    assert not pair.channel().exclusive().locked()
    deadline = time.monotonic() + 10.0
    while pair.p.engine.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not pair.p.engine.requests
    _, result = await pair.run(chat_prompts[3])  # the pair still works
    assert result.committed


async def test_an_abort_before_the_handover_frees_every_reserved_slot(push_pair, chat_prompts):
    idle = (await push_pair.d_stats())["idle"]
    request_id = uuid.uuid4().hex
    await push_pair.lease(chat_prompts[4], request_id=request_id)
    held = await push_pair.d_stats()
    assert held["reservations"] == 1 and held["idle"] == idle - len(chat_prompts[4])
    assert await push_pair.d.abort(request_id)
    stats = await push_pair.d_stats()
    assert stats["reservations"] == 0 and stats["external_held"] == 0 and stats["idle"] == idle


async def test_an_expired_lease_frees_every_reserved_slot(push_pair, chat_prompts):
    idle = (await push_pair.d_stats())["idle"]
    await push_pair.lease(chat_prompts[5], lease_s=0.3)
    deadline = time.monotonic() + 10.0
    while (stats := await push_pair.d_stats())["reservations"]:
        assert time.monotonic() < deadline, f"the lease never ran out: {stats}"
        await asyncio.sleep(0.05)
    assert stats["idle"] == idle and stats["external_held"] == 0
    assert push_pair.d.counters.expired_leases == 1


async def test_a_rehearsal_leaves_the_decode_engine_as_it_found_it(push_pair):
    before = await push_pair.d_stats()
    assert await rehearse_handover(push_pair.d.engine, push_pair.d.worker, push_pair.d.reservations) > 0
    assert await push_pair.d_stats() == before
    assert push_pair.d.counters.kv_bytes_received == 0 and push_pair.d.counters.kv_transfers == 0
    assert push_pair.d.engine.cache.evictable_tokens == 0


# ---- the link itself -------------------------------------------------------------------------


class Sink(DataMessage):
    """Loopback tests only: D takes ``count`` tensors of ``shape`` and answers their sum."""

    type: Literal["test.loopback.sink"] = "test.loopback.sink"
    count: int
    shape: list[int]


class Summed(DataMessage):
    type: Literal["test.loopback.summed"] = "test.loopback.summed"
    total: float


async def sink_handler(conn: PeerConnection, msg: DataMessage) -> DataMessage:
    if not isinstance(msg, Sink):
        raise ValueError(f"no handler for {msg.type}")
    received = await conn.recv_tensors([(msg.shape, "float32")] * msg.count, 5.0)
    return Summed(total=float(sum(t.sum() for t in received)))


async def test_a_link_delivers_frames_and_copies_tensors_in_order():
    gone: list[PeerConnection] = []
    link = LoopbackLink(sink_handler, address="here", decode_node_id="d", prefill_node_id="p", p_device="cpu",
                        d_device="cpu", on_disconnect=gone.append)
    tensors = [torch.full((2, 3), float(i)) for i in range(3)]
    reply = await link.channel.request(Sink(count=3, shape=[2, 3]), 5.0, tensors=tensors)
    assert isinstance(reply, Summed) and reply.total == 6 * (0 + 1 + 2)
    assert link.channel.bytes_sent == link.connection.bytes_received == 3 * 6 * 4
    with pytest.raises(RemoteError, match="no handler"):  # a failing handler answers, then the link closes
        await link.channel.request(Summed(total=0.0), 5.0)
    assert not link.channel.alive
    await link.aclose()
    assert gone == [link.connection]


async def test_a_tensor_nobody_takes_fails_at_its_deadline_and_tears_the_link_down():
    link = LoopbackLink(sink_handler, address="here", decode_node_id="d", prefill_node_id="p", p_device="cpu",
                        d_device="cpu")
    started = time.monotonic()
    with pytest.raises(ChannelError):
        await link.channel.send_tensor(torch.zeros(4), 0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert not link.channel.alive
    await link.aclose()
