"""Overlap scheduling (EngineConfig.overlap_schedule): the previous step's tokens are detokenized
and checked for stop strings after the next step is launched. The answers must be exactly those
of the plain loop (greedy identical to transformers; stop strings, EOS, stop ids, length and
seeded sampling the same), and the extra token drawn for a request a stop string ended must be
dropped with its KV slot freed."""

from __future__ import annotations

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.outputs import RequestOutput
from pd_cluster.engine.request import PENDING

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engines(default_model_dir) -> tuple[LLM, LLM]:
    # A small step budget so long prompts are prefilled in chunks, mixed with decodes.
    options = dict(max_total_tokens=8192, max_num_batched_tokens=256)
    return LLM(str(default_model_dir), **options), LLM(str(default_model_dir), overlap_schedule=True, **options)


def _answer(out: RequestOutput) -> tuple:
    # Logprobs to 1e-4: a prefix-cache hit on one engine and not the other moves them by ~1e-6.
    logprobs = [(e.token_id, pytest.approx(e.logprob, abs=1e-4)) for e in out.logprobs] if out.logprobs else None
    return out.token_ids, out.text, out.finish_reason, out.stop_reason, logprobs


def _pool_is_whole(llm: LLM) -> bool:
    engine = llm.engine
    return not engine.has_unfinished() and engine.pool.num_free + engine.cache.evictable_tokens == engine.pool.capacity


def test_overlapped_greedy_is_token_identical_to_transformers(engines, chat_prompts, hf_reference):
    _, overlapped = engines
    outputs = overlapped.generate(chat_prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(chat_prompts, outputs):
        assert out.token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
        assert out.finish_reason == "length"
    assert _pool_is_whole(overlapped)


def test_overlapped_answers_equal_the_plain_loop_and_late_stops_drop_their_extra_token(engines, chat_prompts):
    plain, overlapped = engines
    prompts = chat_prompts[:6]
    free_run = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    # A stop string from the middle of each answer: found only once its token is detokenized.
    stops = [out.text[len(out.text) // 2 : len(out.text) // 2 + 3] for out in free_run]
    assert all(len(s) == 3 for s in stops)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stops[0]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stops[1]], ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=NEW_TOKENS, stop=[stops[2]],
                       frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[free_run[3].token_ids[5]]),
        SamplingParams(temperature=0.8, seed=11, max_tokens=7, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=64),  # EOS, or the length limit
    ]
    dropped_before = overlapped.engine.stats.dropped_tokens
    expected = [_answer(o) for o in plain.generate(prompts, params)]
    got = [_answer(o) for o in overlapped.generate(prompts, params)]
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, i
    assert expected[0][2] == expected[1][2] == "stop" and expected[3][3] == free_run[3].token_ids[5]
    # Each greedy stop-string request drew one token past its stop, and dropped it.
    assert overlapped.engine.stats.dropped_tokens - dropped_before >= 2
    assert _pool_is_whole(plain) and _pool_is_whole(overlapped)


def test_overlapped_engine_aborts_and_warms_up_cleanly(engines, chat_prompts):
    _, overlapped = engines
    engine = overlapped.engine
    engine.add_request("to-abort", chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("to-finish", chat_prompts[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    updates = []
    for _ in range(200):  # bounded: every step makes progress
        updates += engine.step()
        if any(u.request_id == "to-abort" for u in updates) and "to-abort" in engine.requests:
            engine.abort("to-abort")
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    finishing = [u for u in updates if u.request_id == "to-finish"]
    assert len(finishing) == 3 and finishing[-1].finish_reason == "length" and finishing[0].first_token
    assert engine.warm_up() > 0 and not engine.has_unfinished()
    assert _pool_is_whole(overlapped)


def test_overlapped_steps_launch_on_the_device_ids_of_the_step_before(engines, chat_prompts):
    _, overlapped = engines
    engine = overlapped.engine
    runner = engine.runner
    fed_from_device = []
    original = runner.run

    def spying(step, hooks=None, device_tokens=None):
        fed_from_device.append(device_tokens is not None and any(
            r.token_ids(r.num_computed, r.num_computed + 1)[0] == PENDING for r in step.requests))
        return original(step, hooks, device_tokens)

    runner.run = spying
    try:
        for i, prompt in enumerate(chat_prompts[:3]):
            engine.add_request(f"pipelined-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        pending_seen = False
        for _ in range(100):  # bounded: every step makes progress
            engine.step()
            pending_seen |= any(PENDING in r.output_token_ids for r in engine.requests.values())
            if not engine.has_unfinished():
                break
    finally:
        del runner.run
    assert pending_seen and sum(fed_from_device) >= 4  # the decode steps took their ids on the device
    assert not engine.has_unfinished() and _pool_is_whole(overlapped)


def test_overlapped_engine_preempts_a_request_with_a_token_on_the_device_and_recomputes_it(
        default_model_dir, chat_prompts, hf_reference):
    """Admission trusts the length predictor; requests that run longer are preempted while a step
    is in flight, and must come back with their token read back and answers unchanged."""
    prompts = sorted(chat_prompts, key=len)[:4]
    llm = LLM(str(default_model_dir), max_total_tokens=max(len(p) for p in prompts) + 80, overlap_schedule=True)
    for _ in range(32):
        llm.engine.predictor.observe(2)  # history says outputs are tiny...
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[], ignore_eos=False)
    outputs = llm.generate(prompts, params)
    eos = set(llm.engine.eos_token_ids)
    for prompt, out in zip(prompts, outputs):
        ref = hf_reference.greedy(prompt, 24)
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.token_ids == ref[:cut]
    engine = llm.engine
    assert engine.stats.preemptions > 0
    engine.cache.flush()
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.capacity
    assert engine.table.num_free_rows == engine.config.max_running_requests


def test_slots_are_read_from_the_host_mirror_and_answers_stay_the_same(default_model_dir, chat_prompts, hf_reference,
                                                                       monkeypatch):
    """With the request table mirrored on the host (as on a GPU, where a read of the device table
    would wait for the step in flight), ended requests cache and free the slots the mirror holds:
    every row read equals the table's, and a second round served from those cached slots gives
    transformers' tokens."""
    import functools

    import pd_cluster.engine.llm_engine as llm_engine
    from pd_cluster.engine.req_table import ReqSlotTable

    monkeypatch.setattr(llm_engine, "ReqSlotTable", functools.partial(ReqSlotTable, host_mirror=True))
    llm = LLM(str(default_model_dir), max_total_tokens=8192, max_num_batched_tokens=256, overlap_schedule=True)
    engine = llm.engine
    assert engine.table._host is not None
    reads = []
    real_read = engine.table.read

    def checked_read(row: int, length: int):
        got = real_read(row, length)
        reads.append(bool((got == engine.table.table[row, :length]).all()))
        return got

    engine.table.read = checked_read
    prompts = chat_prompts[:4]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            assert out.token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
    assert reads and all(reads)
    assert engine.cache.match_prefix(prompts[0]).num_tokens >= len(prompts[0]) - 1  # the first round's, reused
    assert _pool_is_whole(llm)


def test_slots_freed_while_a_step_runs_are_settled_before_a_prefill_node_writes_them(engines, chat_prompts):
    """A request that ends while the next step is in flight frees (or caches) its slots without
    waiting for the device; a reservation for KV written from outside first settles them."""
    _, overlapped = engines
    engine = overlapped.engine
    engine.add_request("ends-early", chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.add_request("runs-on", chat_prompts[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    ended_in_flight = False
    while engine.has_unfinished():
        engine.step()
        if engine._frees_at_launch != (engine.pool.frees, engine.table.frees):
            ended_in_flight = True
            engine.settle_freed_slots()
            assert engine._frees_at_launch == (engine.pool.frees, engine.table.frees)
    assert ended_in_flight
