"""A float32 P at TP 1 handing over to a D of TP 2 that stores int8 KV: the two differ in both ways
at once. P converts the prompt's rows to D's int8 and pushes them over the data plane (D's rank 0
hands each rank its heads), or, on D's host, writes each rank's pool its own heads in place,
converted on the way; each rank's pool stores int8 rows, the stream continues as the single
engine's would, and D's prefix cache serves a later turn."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.transfer import ipc
from tests.handover_pairs import single_engine_tokens, start_pair
from tests.pool_writes import RankWrites

#: Least share of greedy tokens at the single engine's positions, as for a TP 1 D storing int8
#: (test_handover_kv_dtypes.py).
LEAST_AGREEMENT = 0.75


@pytest.mark.parametrize("share", [False, True], ids=["gloo", "shared-pools"])
async def test_an_int8_d_of_two_ranks_takes_a_float32_p_of_one(share, default_model_dir, chat_prompts, shm_offered):
    prompts = chat_prompts[:3]
    want = single_engine_tokens(default_model_dir, prompts)
    pair = await start_pair(default_model_dir, loopback=False, share=share, p_tp=1, d_tp=2, d_kv_dtype="int8")
    try:
        p_spec, d_spec = pair.p.engine.kv_spec, pair.d.engine.kv_spec
        assert (p_spec.kv_dtype, d_spec.kv_dtype) == ("float32", "int8")
        # Each rank's pool (rank 1's in its own process, opened here from D's offer) stores its own
        # heads as int8 rows: codes padded to 16 bytes, then the scale.
        pools = [ipc.open_pool(h) for h in pair.d.engine.node_kv.pool_offer(["shm"])(["shm"])]
        assert [p.num_heads for p in pools] == [1, 2]
        for pool in pools:
            assert pool.k_cache.dtype == torch.uint8 and pool.k_cache.shape[-1] == d_spec.pool_row_width
        # Values and scales, one byte a value and four a scale, every head of every layer.
        row_bytes = 2 * d_spec.num_layers * d_spec.num_kv_heads * (d_spec.head_dim + 4)
        writes = RankWrites(pair.d, pools)
        same = total = sent = 0
        for prompt, expected in zip(prompts, want):
            await writes.arm()
            got, result = await pair.run(prompt)
            moved, rest = divmod(result.transfer_bytes, row_bytes)  # D's rows, never P's float32 ones
            missing = len(prompt) - result.hit_blocks * d_spec.block_size
            assert rest == 0 and moved >= missing > 0
            sent += result.transfer_bytes
            if share:  # each rank's pool took exactly its own heads' rows of the missing tokens
                (ranks,) = writes.at_commit
                head_bytes = d_spec.pool_bytes_per_token // d_spec.num_kv_heads
                assert [nbytes for nbytes, _ in ranks] == [missing * p.num_heads * head_bytes for p in pools]
            same += sum(a == b for a, b in zip(got, expected))
            total += len(expected)
        channel = pair.channel()
        # Pushed through the data plane, or converted and written in place: nothing through the channel.
        assert channel.transport == ("ipc" if share else "gloo")
        assert channel.channel.bytes_sent == (0 if share else sent)
        print(f"int8 KV on a TP 2 D ({channel.transport}): {same}/{total} greedy tokens as the "
              "single engine's")
        assert same / total >= LEAST_AGREEMENT
        stats = await pair.d_stats()
        assert stats["reservations"] == 0 and stats["external_held"] == 0
        _, match = await pair.lease(prompts[0] + prompts[1])
        assert match.hit_blocks > 0
    finally:
        await pair.stop()


async def test_int8_ps_and_ds_of_two_ranks_write_each_rank_in_place(default_model_dir, chat_prompts, shm_offered):
    """Both of TP 2 and storing int8: P gathers its ranks' rows as stored (no conversion) and writes
    each of D's ranks its own heads in place, nothing through the channel; the bytes each rank's
    pool received are those rows (the second prompt's shared prefix, a hit, not among them)."""
    prompts = chat_prompts[:2]
    want = single_engine_tokens(default_model_dir, prompts)
    pair = await start_pair(default_model_dir, loopback=False, share=True, p_tp=2, d_tp=2, d_kv_dtype="int8",
                            p_kv_dtype="int8")
    try:
        spec = pair.d.engine.kv_spec
        assert pair.p.engine.kv_spec.kv_dtype == spec.kv_dtype == "int8"
        pools = [ipc.open_pool(h) for h in pair.d.engine.node_kv.pool_offer(["shm"])(["shm"])]
        writes = RankWrites(pair.d, pools)
        same = total = 0
        for prompt, expected in zip(prompts, want):
            await writes.arm()
            got, result = await pair.run(prompt)
            (ranks,) = writes.at_commit
            head_bytes = spec.pool_bytes_per_token // spec.num_kv_heads  # rows as stored, padding included
            missing = len(prompt) - result.hit_blocks * spec.block_size  # a prefix D holds is not written
            assert [nbytes for nbytes, _ in ranks] == [missing * p.num_heads * head_bytes for p in pools]
            assert all(len(slots) == missing for _, slots in ranks) and ranks[0][1] == ranks[1][1]
            same += sum(a == b for a, b in zip(got, expected))
            total += len(expected)
        channel = pair.channel()
        assert channel.transport == "ipc" and channel.channel.bytes_sent == 0
        print(f"int8 KV, TP 2 to TP 2 in place: {same}/{total} greedy tokens as the single engine's")
        assert same / total >= LEAST_AGREEMENT
    finally:
        await pair.stop()

