"""In-place KV writes: a P on D's host writes the missing KV straight into D's reserved slots.

Everything here is real (services, sockets, handshake, leases, the engines) except how P maps
D's pool: on a GPU that is CUDA IPC between processes (tests/gpu); here a ``local`` handle kind
stands in for it, with both services in this process.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from decode_node.receiver import DISCONNECT_GRACE_S
from decode_node.service import DecodeService
from pd_cluster.config import EngineConfig
from pd_cluster.handover import CommitKV, MatchPrefix, MatchResult, PushAck
from pd_cluster.llm import LLM
from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.transfer import ipc
from pd_cluster.transfer.handshake import Hello, share_pool_with
from pd_cluster.kv_spec import KVSpec
from prefill_node.service import PrefillService

TOKEN = "direct-kv-token"
NEW_TOKENS = 8


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


def engine_config(model_dir, block_size: int = 16) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                        block_size=block_size)


class Pair:
    def __init__(self, p: PrefillService, d: DecodeService) -> None:
        self.p, self.d = p, d
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    def on_tokens(self, updates) -> None:
        with self.lock:
            for u in updates:
                self.tokens.setdefault(u.request_id, []).append(u.token_id)
                if u.finish_reason is not None:
                    self.finished.add(u.request_id)

    async def run(self, prompt: list[int]):
        job = PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt,
                         sampling=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                         decode_node_id="d0", decode_address=self.d.data_address, deadline_s=60.0)
        firsts = []

        async def report(first) -> None:
            firsts.append(first)

        result = await self.p.run_job(job, report)
        await poll(lambda: job.request_id in self.finished, 60.0, "the decode node to finish")
        return [firsts[0].token_id] + self.tokens[job.request_id], result

    async def d_stats(self) -> dict:
        engine = self.d.engine
        return await self.d.worker.call(lambda: {
            "idle": engine.pool.num_free + engine.cache.evictable_tokens, "capacity": engine.pool.capacity,
            "reservations": len(self.d.reservations.pending),
        })


async def poll(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def start_pair(model_dir, *, share: bool = True, block_size: int = 16, **p_options) -> Pair:
    pair = Pair(None, None)  # type: ignore[arg-type]
    d = DecodeService(engine_config(model_dir, block_size), node_id="d0", cluster_token=TOKEN,
                      on_tokens=pair.on_tokens, share_kv_pool=share, warm_up=False)
    await d.start()
    p = PrefillService(engine_config(model_dir, block_size), node_id="p0", cluster_token=TOKEN, warm_up=False,
                       lease_s=30.0, **p_options)
    await p.start()
    pair.p, pair.d = p, d
    return pair


@pytest.fixture
async def pair(default_model_dir, local_handles) -> AsyncIterator[Pair]:
    pair = await start_pair(default_model_dir)
    yield pair
    await pair.p.stop()
    await pair.d.stop()


@pytest.fixture(scope="module")
def engine_outputs(default_model_dir, chat_prompts) -> list[list[int]]:
    llm = LLM(str(default_model_dir), device="cpu", dtype="float32", max_total_tokens=4096, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(chat_prompts[:2], params)]


async def test_p_on_d_host_writes_kv_in_place_with_output_identical_to_the_engine(pair, chat_prompts,
                                                                                  engine_outputs):
    idle = (await pair.d_stats())["idle"]
    tokens, result = await pair.run(chat_prompts[0])
    assert tokens == engine_outputs[0]
    channel = pair.p.pool.peek(pair.d.data_address)
    assert channel is not None and channel.transport == "ipc"
    spec = pair.d.engine.kv_spec
    n = len(chat_prompts[0])
    # The delta rule: exactly the missing tokens' bytes, and none through the tensor channel.
    assert result.transfer_bytes == n * spec.bytes_per_token == pair.d.counters.kv_bytes_received
    assert channel.channel.bytes_sent == 0 and channel.bytes_written == result.transfer_bytes
    stats = await pair.d_stats()
    assert stats["reservations"] == 0 and stats["idle"] == idle == stats["capacity"]


async def test_a_prefix_hit_on_d_writes_only_the_missing_tokens(pair, chat_prompts):
    first = chat_prompts[1]
    await pair.run(first)
    received = pair.d.counters.kv_bytes_received
    follow_up = first + chat_prompts[0][-40:]
    _, result = await pair.run(follow_up)
    bs = pair.d.engine.kv_spec.block_size
    assert result.hit_blocks == len(first) // bs > 0
    missing = len(follow_up) - result.hit_blocks * bs
    assert result.transfer_bytes == missing * pair.d.engine.kv_spec.bytes_per_token
    assert pair.d.counters.kv_bytes_received - received == result.transfer_bytes


async def test_without_a_shared_pool_the_kv_goes_through_the_tensor_channel(default_model_dir, local_handles,
                                                                           chat_prompts, engine_outputs):
    pair = await start_pair(default_model_dir, share=False)
    try:
        tokens, result = await pair.run(chat_prompts[0])
        channel = pair.p.pool.peek(pair.d.data_address)
        assert channel is not None and channel.transport == "gloo" and channel.shared_pool is None
        assert tokens == engine_outputs[0]
        assert channel.channel.bytes_sent == result.transfer_bytes > 0
    finally:
        await pair.p.stop()
        await pair.d.stop()


@pytest.mark.parametrize("layers_per_send", [1, 4, 7])
async def test_layer_groups_through_the_tensor_channel_match_the_engine(default_model_dir, chat_prompts,
                                                                        engine_outputs, layers_per_send):
    """The network path, layer by layer during the prefill, several layers per send."""
    pair = await start_pair(default_model_dir, share=False, layerwise=True, layerwise_min_tokens=0,
                            layers_per_send=layers_per_send)
    try:
        tokens, result = await pair.run(chat_prompts[1])
        assert tokens == engine_outputs[1]
        spec = pair.d.engine.kv_spec
        padded = -(-len(chat_prompts[1]) // spec.block_size) * spec.block_size
        assert result.transfer_bytes == padded * spec.bytes_per_token == pair.d.counters.kv_bytes_received
    finally:
        await pair.p.stop()
        await pair.d.stop()


async def _direct_lease(pair: Pair, prompt: list[int]):
    channel = await pair.p.pool.get(pair.d.data_address)
    match = await channel.request(MatchPrefix(request_id=uuid.uuid4().hex, token_ids=prompt,
                                              sampling=SamplingParams(temperature=0.0, max_tokens=4),
                                              lease_s=30.0, direct=True), 10.0)
    assert isinstance(match, MatchResult) and match.lease_id and match.slots
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


async def test_a_p_that_disconnects_loses_its_leases_after_a_short_grace(pair, chat_prompts):
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

    def hello(**kw) -> Hello:
        return Hello(token="t", node_id="p", kv_spec=spec, device_type="cuda", **kw)

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
async def test_the_same_prompt_twice_writes_only_what_d_lacks(default_model_dir, local_handles, chat_prompts,
                                                              engine_outputs, block_size):
    """The second time D holds every whole block of the prompt (with blocks of one token, all of
    it: an empty slot list), and P all of it."""
    pair = await start_pair(default_model_dir, block_size=block_size)
    try:
        first, _ = await pair.run(chat_prompts[0])
        again, result = await pair.run(chat_prompts[0])
    finally:
        await pair.p.stop()
        await pair.d.stop()
    assert first == again == engine_outputs[0]
    bs = pair.d.engine.kv_spec.block_size
    assert result.hit_blocks == len(chat_prompts[0]) // bs
    assert result.transfer_bytes == (len(chat_prompts[0]) - result.hit_blocks * bs) * pair.d.engine.kv_spec.bytes_per_token
