"""In-place KV writes: a P on D's host writes the missing KV straight into D's reserved slots.

Everything here is real (services, leases, the engines). How the KV's bytes and the messages
travel: through the loopback backend (D's pool handed to P directly) where the handover is
what is tested, and over the real data plane on localhost (sockets, handshake, a gloo pair
group) where the transport is; there a ``local`` handle kind stands in for CUDA IPC, which
maps D's pool between processes on a GPU (tests/gpu).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from pd_cluster.handover import DISCONNECT_GRACE_S
from pd_cluster.handover.messages import CommitKV, PushAck
from pd_cluster.transfer import ipc
from pd_cluster.transfer.handshake import Join, share_pool_with
from pd_cluster.kv_spec import KVSpec
from tests.handover_pairs import ServicePair, single_engine_tokens, start_pair
from tests.pool_writes import PoolWrites


@pytest.fixture
def local_handles():
    """The ``local`` kind: handles name tensors of this process (the CPU stand-in for CUDA IPC)."""
    pools: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def export(k: torch.Tensor, v: torch.Tensor) -> ipc.KVPoolHandle:
        key = uuid.uuid4().hex
        pools[key] = (k, v)

        def handle(t: torch.Tensor) -> ipc.TensorHandle:
            return ipc.TensorHandle(size=list(t.shape), stride=list(t.stride()), storage_offset=0,
                                    dtype=str(t.dtype).removeprefix("torch."), device_index=0, handle=key,
                                    storage_bytes=t.numel() * t.element_size(), storage_offset_bytes=0)

        return ipc.KVPoolHandle(kind="local", k_cache=handle(k), v_cache=handle(v))

    def open_(handle: ipc.KVPoolHandle) -> ipc.SharedPool:
        return ipc.SharedPool(*pools[handle.k_cache.handle])

    ipc.register_kind("local", "cpu", export, open_)
    yield pools
    ipc.unregister_kind("local")


@pytest.fixture
async def pair(default_model_dir) -> AsyncIterator[ServicePair]:
    """P and D over a loopback link, D's pool shared with P."""
    pair = await start_pair(default_model_dir, share=True)
    yield pair
    await pair.stop()


@pytest.fixture
async def socket_pair(default_model_dir, local_handles) -> AsyncIterator[ServicePair]:
    """P and D over the data plane on localhost; the handshake offers D's pool and P opens it."""
    pair = await start_pair(default_model_dir, loopback=False, share=True)
    yield pair
    await pair.stop()


@pytest.fixture(params=["loopback", "socket"])
async def either_pair(request, default_model_dir, local_handles) -> AsyncIterator[ServicePair]:
    pair = await start_pair(default_model_dir, loopback=request.param == "loopback", share=True)
    yield pair
    await pair.stop()


@pytest.fixture(scope="module")
def engine_outputs(default_model_dir, chat_prompts) -> list[list[int]]:
    return single_engine_tokens(default_model_dir, chat_prompts[:2])


async def test_p_on_d_host_writes_kv_in_place_with_output_identical_to_the_engine(either_pair, chat_prompts,
                                                                                  engine_outputs):
    pair = either_pair
    prompt = chat_prompts[0]
    idle = (await pair.d_stats())["idle"]
    writes = PoolWrites(pair.d)
    await writes.arm()
    tokens, result = await pair.run(prompt)
    assert tokens == engine_outputs[0]
    channel = pair.channel()
    assert channel is not None and channel.transport == "ipc"
    spec = pair.d.engine.kv_spec
    n = len(prompt)
    # The delta rule, measured in D's pool: exactly the missing tokens' slots were written, and
    # nothing went through the tensor channel.
    assert writes.bytes_at_commit == [n * spec.bytes_per_token]
    assert result.transfer_bytes == n * spec.bytes_per_token == pair.d.counters.kv_bytes_received
    assert channel.channel.bytes_sent == 0 and channel.bytes_written == result.transfer_bytes
    stats = await pair.d_stats()
    assert stats["reservations"] == 0 and stats["idle"] == idle == stats["capacity"]


async def test_a_prefix_hit_on_d_writes_only_the_missing_tokens(pair, chat_prompts):
    first = chat_prompts[1]
    await pair.run(first)
    received = pair.d.counters.kv_bytes_received
    follow_up = first + chat_prompts[0][-40:]
    writes = PoolWrites(pair.d)
    await writes.arm()
    _, result = await pair.run(follow_up)
    bs = pair.d.engine.kv_spec.block_size
    assert result.hit_blocks == len(first) // bs > 0
    missing = len(follow_up) - result.hit_blocks * bs
    # Measured in D's pool: the missing tokens' slots, none of the slots D already held.
    assert writes.bytes_at_commit == [missing * pair.d.engine.kv_spec.bytes_per_token]
    assert result.transfer_bytes == missing * pair.d.engine.kv_spec.bytes_per_token
    assert pair.d.counters.kv_bytes_received - received == result.transfer_bytes


async def test_without_a_shared_pool_the_kv_goes_through_the_tensor_channel(default_model_dir, local_handles,
                                                                           chat_prompts, engine_outputs):
    pair = await start_pair(default_model_dir, loopback=False, share=False)
    try:
        tokens, result = await pair.run(chat_prompts[0])
        channel = pair.channel()
        assert channel is not None and channel.transport == "gloo" and not channel.shared_pools
        assert tokens == engine_outputs[0]
        assert channel.channel.bytes_sent == result.transfer_bytes > 0
    finally:
        await pair.stop()


@pytest.mark.parametrize("loopback, layers_per_send", [(True, 1), (True, 7), (False, 4)],
                         ids=["loopback-1", "loopback-7", "gloo-4"])
async def test_layer_groups_through_the_tensor_channel_match_the_engine(default_model_dir, chat_prompts,
                                                                        engine_outputs, loopback, layers_per_send):
    """The network path, layer by layer during the prefill, several layers per send."""
    pair = await start_pair(default_model_dir, loopback=loopback, share=False, layerwise=True,
                            layerwise_min_tokens=0, layers_per_send=layers_per_send)
    try:
        tokens, result = await pair.run(chat_prompts[1])
        assert tokens == engine_outputs[1]
        spec = pair.d.engine.kv_spec
        padded = -(-len(chat_prompts[1]) // spec.block_size) * spec.block_size
        assert result.transfer_bytes == padded * spec.bytes_per_token == pair.d.counters.kv_bytes_received
    finally:
        await pair.stop()


async def _direct_lease(pair: ServicePair, prompt: list[int]):
    channel, match = await pair.lease(prompt, direct=True)
    assert match.slots
    return channel, match


async def test_a_commit_claiming_the_wrong_write_is_refused_and_frees_the_slots(pair, chat_prompts):
    idle = (await pair.d_stats())["idle"]
    channel, match = await _direct_lease(pair, chat_prompts[2])
    reserved = ipc.decode_slots(match.slots)
    assert reserved.numel() == len(chat_prompts[2])
    assert (await pair.d_stats())["idle"] == idle - reserved.numel()
    ack = await channel.request(CommitKV(lease_id=match.lease_id, first_token=1,
                                         written_tokens=reserved.numel() - 1), 10.0)
    assert isinstance(ack, PushAck) and not ack.ok and "written" in (ack.error or "")
    stats = await pair.d_stats()
    assert stats["reservations"] == 0 and stats["idle"] == idle


async def test_a_commit_without_written_tokens_on_a_direct_lease_is_refused(pair, chat_prompts):
    channel, match = await _direct_lease(pair, chat_prompts[3])
    ack = await channel.request(CommitKV(lease_id=match.lease_id, first_token=1), 10.0)
    assert isinstance(ack, PushAck) and not ack.ok


async def test_a_p_that_disconnects_loses_its_leases_after_a_short_grace(socket_pair, chat_prompts):
    """D's data-plane server tells the receiver of every connection that ends."""
    pair = socket_pair
    idle = (await pair.d_stats())["idle"]
    channel, match = await _direct_lease(pair, chat_prompts[4])
    assert (await pair.d_stats())["reservations"] == 1
    closed_at = time.monotonic()
    await channel.aclose()  # P gone with a lease (30 s) it never committed
    deadline = closed_at + DISCONNECT_GRACE_S + 10.0
    while True:
        stats = await pair.d_stats()
        if stats["reservations"] == 0:
            break
        assert time.monotonic() < deadline, f"the lease outlived its P: {stats}"
        await asyncio.sleep(0.05)
    assert time.monotonic() - closed_at >= DISCONNECT_GRACE_S - 0.5  # not before the grace
    assert stats["idle"] == idle


def test_the_pool_is_offered_only_on_the_same_host_and_gpu():
    spec = KVSpec(model="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", block_size=16)

    def hello(**kw) -> Join:
        return Join(proof="0" * 64, kv_spec=spec, device_type="cuda", **kw)

    host = ipc.host_identity()
    same = hello(host_id=host, device_uuid="GPU-a", kv_ipc_kinds=["cuda"])
    assert share_pool_with(same, host, "GPU-a", across_gpus=False)
    assert not share_pool_with(hello(host_id="other/host", device_uuid="GPU-a", kv_ipc_kinds=["cuda"]), host, "GPU-a",
                               across_gpus=False)
    assert not share_pool_with(hello(host_id=host, device_uuid="GPU-a", kv_ipc_kinds=[]), host, "GPU-a",
                               across_gpus=False)
    other_gpu = hello(host_id=host, device_uuid="GPU-b", kv_ipc_kinds=["cuda"])
    assert not share_pool_with(other_gpu, host, "GPU-a", across_gpus=False)
    assert share_pool_with(other_gpu, host, "GPU-a", across_gpus=True)


def test_slot_lists_round_trip_and_bad_ones_are_refused():
    slots = torch.tensor([5, 0, 4095, 17])
    assert torch.equal(ipc.decode_slots(ipc.encode_slots(slots)), slots)
    assert ipc.decode_slots(ipc.encode_slots(torch.empty(0, dtype=torch.int64))).numel() == 0
    with pytest.raises(ValueError):
        ipc.decode_slots("AAAA")  # 3 bytes: not a whole int64


@pytest.mark.parametrize("block_size", [16, 1])
async def test_the_same_prompt_twice_writes_only_what_d_lacks(default_model_dir, chat_prompts, engine_outputs,
                                                              block_size):
    """The second time D holds every whole block of the prompt (with blocks of one token, all of
    it: an empty slot list), and P all of it."""
    pair = await start_pair(default_model_dir, share=True, block_size=block_size)
    writes = PoolWrites(pair.d)
    try:
        first, _ = await pair.run(chat_prompts[0])
        await writes.arm()  # D's free slots (those of the last partial block among them) reset
        again, result = await pair.run(chat_prompts[0])
    finally:
        await pair.stop()
    assert first == again == engine_outputs[0]
    bs = pair.d.engine.kv_spec.block_size
    assert result.hit_blocks == len(chat_prompts[0]) // bs
    missing_bytes = (len(chat_prompts[0]) - result.hit_blocks * bs) * pair.d.engine.kv_spec.bytes_per_token
    assert writes.bytes_at_commit == [missing_bytes]  # measured in D's pool
    assert result.transfer_bytes == missing_bytes
