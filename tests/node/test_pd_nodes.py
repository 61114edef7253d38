"""Prefill and decode nodes in separate processes over the gloo data plane (no master)."""

from __future__ import annotations

import math
import time
import uuid

import pytest

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.protocol import PrefillJob
from tests.pd_harness import decode_main, prefill_main, start_node

TOKEN = "test-cluster-token"
NEW_TOKENS = 16


def engine_config(model_dir, block_size: int = 1, **extra) -> dict:
    return {"model": str(model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 6144,
            "block_size": block_size, **extra}


def job(prompt: list[int], d_address: str, max_tokens: int = NEW_TOKENS, deadline_s: float = 120.0) -> str:
    return PrefillJob(
        request_id=uuid.uuid4().hex, token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        decode_node_id="d0", decode_address=d_address, deadline_s=deadline_s,
    ).model_dump_json()


def run(p, d, prompt: list[int], max_tokens: int = NEW_TOKENS) -> tuple[list[int], dict]:
    d_address = d.info[1]
    spec = job(prompt, d_address, max_tokens)
    request_id = PrefillJob.model_validate_json(spec).request_id
    result = p.call("job", spec)
    tokens = [result["first"]["token_id"]] + d.wait_finished(request_id)
    return tokens, result


@pytest.fixture(scope="module", params=[(1, None), (16, None), (1, 24)], ids=["block1", "block16", "block1-chunks24"])
def pd_pair(request, default_model_dir):
    # chunks24: P prefills a prompt 24 tokens a step (as in graph-sized chunks on a GPU), holding
    # the KV of every chunk until it is sent.
    block_size, chunk = request.param
    d = start_node(decode_main, engine_config(default_model_dir, block_size), TOKEN)
    p_extra = {} if chunk is None else {"prefill_chunk_tokens": chunk}
    p = start_node(prefill_main, engine_config(default_model_dir, block_size, **p_extra), TOKEN, 30.0)
    yield block_size, p, d
    p.stop()
    d.stop()


def test_greedy_through_p_and_d_matches_the_single_node_engine(pd_pair, chat_prompts, hf_reference):
    block_size, p, d = pd_pair
    for prompt in chat_prompts[:5]:
        tokens, result = run(p, d, prompt)
        assert tokens == hf_reference.greedy(prompt, NEW_TOKENS)
        assert result["committed"]


def test_multi_turn_moves_only_the_missing_blocks(pd_pair, chat_prompts, tokenizer, hf_reference):
    block_size, p, d = pd_pair
    bytes_per_block = d.info[2]
    d.call("flush")
    history = list(chat_prompts[3])
    previous_kv_tokens = 0
    for turn, message in enumerate(["Tell me more.", "Give an example.", "Thanks! Summarize."]):
        tokens, result = run(p, d, history)
        assert tokens == hf_reference.greedy(history, NEW_TOKENS)
        n_blocks = math.ceil(len(history) / block_size)
        hit_blocks = result["hit_blocks"]
        # D keeps the earlier turns' prompt and answer (all but the last token, which has no KV).
        assert hit_blocks == previous_kv_tokens // block_size
        assert result["transfer_bytes"] == (n_blocks - hit_blocks) * bytes_per_block
        if turn:
            assert hit_blocks > 0
        previous_kv_tokens = len(history) + len(tokens) - 1
        follow_up = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        # Continue the same conversation at the token level: history + answer + the next message.
        history = history + tokens + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + list(follow_up)[-12:]


def test_full_hit_moves_at_most_the_last_partial_block(pd_pair, chat_prompts, hf_reference):
    block_size, p, d = pd_pair
    bytes_per_block = d.info[2]
    prompt = chat_prompts[4]
    first, _ = run(p, d, prompt)
    again, result = run(p, d, prompt)
    assert again == first == hf_reference.greedy(prompt, NEW_TOKENS)
    assert result["hit_blocks"] == len(prompt) // block_size
    assert result["transfer_bytes"] == (math.ceil(len(prompt) / block_size) - len(prompt) // block_size) * bytes_per_block
    assert result["transfer_bytes"] <= bytes_per_block


def test_decode_frees_a_dead_prefills_lease(default_model_dir, chat_prompts):
    d = start_node(decode_main, engine_config(default_model_dir), TOKEN)
    p = start_node(prefill_main, engine_config(default_model_dir), TOKEN, 2.0)  # 2 s leases
    try:
        baseline = d.call("stats")
        reply = p.call("match_only", job(chat_prompts[6], d.info[1]))
        assert reply["lease_id"]
        held = d.call("stats")
        assert held["reservations"] == 1
        assert held["free"] + held["evictable"] < baseline["free"] + baseline["evictable"]
        p.kill()  # after match, before commit
        deadline = time.monotonic() + 30
        while True:
            stats = d.call("stats")
            if stats["reservations"] == 0 and stats["free"] == baseline["free"]:
                break
            assert time.monotonic() < deadline, f"lease never freed: {stats} vs {baseline}"
            time.sleep(0.2)
        assert stats["expired_leases"] == 1
    finally:
        p.stop()
        d.stop()


def test_prefill_fails_within_deadline_when_decode_dies_mid_transfer(default_model_dir, chat_prompts):
    d = start_node(decode_main, engine_config(default_model_dir), TOKEN, True, True)  # stalls on push
    p = start_node(prefill_main, engine_config(default_model_dir), TOKEN, 30.0)
    try:
        p.conn.send(("job", job(chat_prompts[6], d.info[1], deadline_s=20.0)))
        d.wait_event("push_started", timeout=60)
        d.kill()
        started = time.monotonic()
        # The fault is D's: the master re-runs it on another decode node, not back on this one.
        with pytest.raises(RuntimeError, match=r"PrefillFailed\(retryable=True, decode_lost=True\): lost decode node d0"):
            p.reply(timeout=60)
        assert time.monotonic() - started < 20.0
        assert p.process.is_alive()
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize(
    "p_overrides, token, expected",
    [({"block_size": 16}, TOKEN, "block_size"), ({}, "wrong-token", "authentication failed")],
    ids=["kv-spec-mismatch", "wrong-token"],
)
def test_handshake_refuses_mismatch_and_bad_token(default_model_dir, chat_prompts, p_overrides, token, expected):
    d = start_node(decode_main, engine_config(default_model_dir), TOKEN)
    p = start_node(prefill_main, engine_config(default_model_dir, **p_overrides), token, 30.0)
    try:
        with pytest.raises(RuntimeError, match=expected):
            p.call("job", job(chat_prompts[0], d.info[1]))
        assert d.call("stats")["reservations"] == 0
    finally:
        p.stop()
        d.stop()
