"""In-place writes into a tensor-parallel decode node: each D rank offers its own pool (in its own
process: the ``shm`` kind here, CUDA IPC on a GPU, tests/gpu), and P writes into each exactly the
KV heads that rank holds, at the slots rank 0 reserved; rank 0 broadcasts no KV to its ranks.

The bytes each rank's pool received are measured in the pools themselves, opened in this process.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pd_cluster.transfer import ipc
from pd_cluster.transfer.client import open_pools
from tests.handover_pairs import single_engine_tokens, start_pair
from tests.pool_writes import RankWrites


@pytest.fixture(scope="module")
def engine_outputs(default_model_dir, chat_prompts) -> list[list[int]]:
    return single_engine_tokens(default_model_dir, chat_prompts[:1])


@pytest.mark.parametrize(("p_tp", "loopback"), [(1, True), (2, True), (1, False)],
                         ids=["p1-d2-loopback", "p2-d2-loopback", "p1-d2-socket"])
async def test_each_d_rank_gets_exactly_its_own_heads_in_place(p_tp, loopback, default_model_dir, chat_prompts,
                                                               engine_outputs, shm_offered):
    pair = await start_pair(default_model_dir, loopback=loopback, share=True, p_tp=p_tp, d_tp=2)
    try:
        engine = pair.d.engine
        # Every rank's pool, opened here from the handles D offers (the same memory P writes into).
        pools = [ipc.open_pool(h) for h in engine.node_kv.pool_offer(["shm"])(["shm"])]
        assert [p.num_heads for p in pools] == [1, 2] and [p.first_head for p in pools] == [0, 1]
        spec = engine.kv_spec
        head_bytes = spec.bytes_per_token // spec.num_kv_heads  # one head of one token: every layer, K and V
        writes = RankWrites(pair.d, pools)
        await writes.arm()
        prompt = chat_prompts[0]
        tokens, result = await pair.run(prompt)
        assert tokens == engine_outputs[0]
        channel = pair.channel()
        assert channel.transport == "ipc" and len(channel.shared_pools) == 2 and channel.channel.bytes_sent == 0
        # Measured: each rank's pool got its own heads of every prompt token, in the same slots.
        (ranks,) = writes.at_commit
        assert [nbytes for nbytes, _ in ranks] == [len(prompt) * p.num_heads * head_bytes for p in pools]
        assert len(ranks[0][1]) == len(prompt) and ranks[0][1] == ranks[1][1]
        assert sum(nbytes for nbytes, _ in ranks) == result.transfer_bytes == len(prompt) * spec.bytes_per_token

        # A prefix hit on D (rank 0's cache, the same slots on every rank): only the rest is written.
        follow_up = prompt + chat_prompts[1][-40:]
        want = single_engine_tokens(default_model_dir, [follow_up])[0]
        await writes.arm()
        tokens, result = await pair.run(follow_up)
        assert tokens == want and result.hit_blocks == len(prompt) // spec.block_size > 0
        missing = len(follow_up) - result.hit_blocks * spec.block_size
        (ranks,) = writes.at_commit
        assert [nbytes for nbytes, _ in ranks] == [missing * p.num_heads * head_bytes for p in pools]
        stats = await pair.d_stats()
        assert stats["reservations"] == 0 and stats["external_held"] == 0
    finally:
        await pair.stop()


#: The exported caches stay alive as a node's pools do (shared memory ends with its last user).
_KEPT: list[torch.Tensor] = []


def _handles(heads: list[tuple[int, int]], kind: str = "shm") -> list[ipc.KVPoolHandle]:
    handles = []
    for first, count in heads:
        k, v = torch.zeros(2, 8, count, 4), torch.zeros(2, 8, count, 4)
        _KEPT.extend((k, v))
        handle = ipc.export_pool(k, v, ["shm"], first)
        assert handle is not None
        handles.append(handle.model_copy(update={"kind": kind}))
    return handles


def test_pools_open_only_when_every_rank_opens_and_every_head_is_held(caplog):
    pools = open_pools(_handles([(0, 1), (1, 2)]), 3, "d0")
    assert [(p.first_head, p.num_heads) for p in pools] == [(0, 1), (1, 2)]
    # Replicas (more ranks than KV heads): each rank's pool holds one head, each head twice.
    assert len(open_pools(_handles([(0, 1), (0, 1), (1, 1), (1, 1)]), 2, "d0")) == 4
    caplog.set_level(logging.WARNING)
    # One rank's pool that cannot be opened, or a head no pool holds: the channel carries the KV.
    assert open_pools([*_handles([(0, 1)]), *_handles([(1, 2)], kind="nowhere")], 3, "d0") == []
    assert "rank 1's (nowhere)" in caplog.text
    assert open_pools(_handles([(0, 1), (2, 1)]), 3, "d0") == []
    assert "no pool holds KV heads [1]" in caplog.text
