"""P in float32, D storing int8 or fp8_e4m3 KV: P converts each prompt's KV into D's rows before
sending (over the loopback link and over the real data plane) or as it writes them into D's shared
pool, D counts the bytes that moved, its prefix cache still serves a later prompt, and greedy
output stays close to the single engine's."""

from __future__ import annotations

import pytest

from tests.handover_pairs import single_engine_tokens, start_pair

#: Least share of greedy tokens at the single engine's positions, over 4 prompts x 8 tokens (a
#: first difference shifts the rest): fp8 e4m3 keeps 3 bits of mantissa, int8 7 (fp8 measured
#: 23/32 with the default model; the 95% bar for int8 is the cluster test's, over 32 x 64).
LEAST_AGREEMENT = {"int8": 0.75, "fp8_e4m3": 0.5}


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("loopback", "share"), [(True, False), (False, False), (True, True)],
                         ids=["loopback", "gloo", "shared-pool"])
async def test_a_quantized_d_receives_its_own_rows_and_continues_the_stream(kind, loopback, share,
                                                                            default_model_dir, chat_prompts):
    prompts = chat_prompts[:4]
    want = single_engine_tokens(default_model_dir, prompts)
    pair = await start_pair(default_model_dir, loopback=loopback, share=share, d_kv_dtype=kind)
    try:
        p_spec, d_spec = pair.p.engine.kv_spec, pair.d.engine.kv_spec
        assert (p_spec.kv_dtype, d_spec.kv_dtype) == ("float32", kind)
        same = total = 0
        for prompt, expected in zip(prompts, want):
            before = pair.d.receiver.counters.kv_bytes_received
            got, result = await pair.run(prompt)
            moved = pair.d.receiver.counters.kv_bytes_received - before
            sent_tokens = moved // d_spec.bytes_per_token
            assert moved == sent_tokens * d_spec.bytes_per_token > 0  # D's rows, never P's float32 ones
            assert moved < sent_tokens * p_spec.bytes_per_token / 3
            # Values and scales, one byte a value and four a scale: a stored row's padding never moves.
            assert moved == sent_tokens * 2 * d_spec.num_layers * d_spec.num_kv_heads * (d_spec.head_dim + 4)
            same += sum(a == b for a, b in zip(got, expected))
            total += len(expected)
        channel = pair.channel()
        if share:  # written into D's pool in place, converted on the way: nothing through the channel
            assert channel.transport == "ipc" and channel.channel.bytes_sent == 0
        else:
            assert channel.channel.bytes_sent > 0
        print(f"{kind} KV on D ({channel.transport}): {same}/{total} greedy tokens as the single engine's")
        assert same / total >= LEAST_AGREEMENT[kind]
        # A second prompt sharing the first's prefix: D's cache serves it, only the rest moves.
        _, match = await pair.lease(prompts[0] + prompts[1])
        assert match.hit_blocks > 0
    finally:
        await pair.stop()
