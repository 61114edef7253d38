"""The single-node engine against transformers, and its memory behaviour."""

from __future__ import annotations

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.model.llama import FUSED_ROWS_SMALL

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    # A small step budget so long prompts are prefilled in chunks, mixed with decodes.
    return LLM(str(default_model_dir), max_total_tokens=8192, max_num_batched_tokens=256)


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batched_greedy_is_token_identical_to_transformers(llm, chat_prompts, hf_reference):
    lengths = sorted(len(p) for p in chat_prompts)
    assert lengths[-1] > 10 * lengths[0], "prompts must differ widely in length"
    outputs = llm.generate(chat_prompts, greedy())
    for prompt, out in zip(chat_prompts, outputs):
        assert out.token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt


def test_shared_prefix_computes_only_unshared_tokens(default_model_dir, chat_prompts):
    long_prompt = max(chat_prompts, key=len)
    follow_up = long_prompt + [13, 504, 3458, 314, 260, 1345, 282]
    with_cache = LLM(str(default_model_dir), max_total_tokens=4096)
    with_cache.generate([long_prompt], greedy(8))
    before = with_cache.engine.stats.computed_tokens
    [out] = with_cache.generate([follow_up], greedy(8))
    computed = with_cache.engine.stats.computed_tokens - before

    # The first request left prompt + 7 of its 8 generated tokens in the cache; the follow-up
    # shares only the prompt.
    assert out.num_cached_tokens == len(long_prompt)
    assert computed == (len(follow_up) - len(long_prompt)) + 7  # unshared prefill + 7 decode steps

    without_cache = LLM(str(default_model_dir), max_total_tokens=4096, enable_prefix_cache=False)
    [plain] = without_cache.generate([follow_up], greedy(8))
    assert plain.num_cached_tokens == 0
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("block_size", [16])
def test_prefix_cache_matches_whole_blocks_only(default_model_dir, chat_prompts, block_size):
    long_prompt = max(chat_prompts, key=len)
    llm = LLM(str(default_model_dir), max_total_tokens=4096, block_size=block_size)
    llm.generate([long_prompt], greedy(4))
    follow_up = long_prompt + [28, 29, 30]
    [out] = llm.generate([follow_up], greedy(4))
    cached_tokens = len(long_prompt) + 3  # prompt + 3 of 4 generated have KV
    assert out.num_cached_tokens == min(cached_tokens, len(follow_up) - 1) // block_size * block_size
    assert out.num_cached_tokens % block_size == 0


def test_kv_budget_below_demand_still_completes_correctly(default_model_dir, chat_prompts, hf_reference):
    prompts = sorted(chat_prompts, key=len)[:6]
    demand = sum(len(p) + NEW_TOKENS for p in prompts)
    capacity = max(len(p) for p in prompts) + NEW_TOKENS + 40
    assert capacity < demand / 2
    llm = LLM(str(default_model_dir), max_total_tokens=capacity, max_num_batched_tokens=128)
    outputs = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
    engine = llm.engine
    assert not engine.has_unfinished()
    engine.cache.flush()
    assert engine.pool.num_free == engine.pool.capacity
    assert engine.table.num_free_rows == engine.config.max_running_requests


def test_preemption_recomputes_when_predictions_are_wrong(default_model_dir, chat_prompts, hf_reference):
    """Admission trusts the length predictor; a request that runs longer is preempted, not lost."""
    prompts = sorted(chat_prompts, key=len)[:4]
    llm = LLM(str(default_model_dir), max_total_tokens=max(len(p) for p in prompts) + 80)
    predictor = llm.engine.predictor
    for _ in range(32):
        predictor.observe(2)  # history says outputs are tiny...
    # ...but these requests run to max_tokens (no ignore_eos, so the predictor is consulted).
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[], ignore_eos=False)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        ref = hf_reference.greedy(prompt, 24)
        eos = set(llm.engine.eos_token_ids)
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.token_ids == ref[:cut]
    assert llm.engine.stats.preemptions > 0
    llm.engine.cache.flush()
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_same_seed_same_output_and_top_k_one_is_greedy(llm, chat_prompts):
    prompts = chat_prompts[:3]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts, sampled)
    second = llm.generate(prompts, sampled)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    other_seed = llm.generate(prompts, sampled.model_copy(update={"seed": 4321}))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in first]

    top1 = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, seed=7, max_tokens=16, ignore_eos=True))
    plain = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in top1] == [o.token_ids for o in plain]


def test_stop_string_cuts_text_and_sets_finish_reason(llm, chat_prompts, tokenizer):
    prompt = chat_prompts[2]
    [full] = llm.generate([prompt], greedy(24))
    words = full.text.split()
    assert len(words) >= 3
    stop = words[2]
    [stopped] = llm.generate([prompt], greedy(24, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.text == full.text[: full.text.index(stop)]


def test_eos_stops_without_ignore_eos(llm, chat_prompts, hf_reference):
    prompt = chat_prompts[1]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))
    ref = hf_reference.greedy(prompt, 64)
    eos = llm.engine.eos_token_ids
    if any(t in eos for t in ref):
        cut = next(i for i, t in enumerate(ref) if t in eos)
        assert out.finish_reason == "stop"
        assert out.token_ids == ref[: cut + 1]
    else:
        assert out.finish_reason == "length"
        assert out.token_ids == ref


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("max_tokens", 0), ("min_p", 2.0),
     ("repetition_penalty", 0.0), ("logprobs", 1000), ("stop", [""])],
)
def test_bad_sampling_parameters_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_prompt_longer_than_context_is_refused(llm):
    too_long = [1] * (llm.engine.max_model_len)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([too_long], greedy(8))
    assert not llm.engine.has_unfinished()


def test_logprobs_report_the_chosen_token_and_top_alternatives(llm, chat_prompts):
    [out] = llm.generate([chat_prompts[0]], greedy(4, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id
        assert len(lp.top) == 3
        assert lp.logprob == pytest.approx(max(lp.top.values()))  # greedy picks the most likely


def test_warm_up_leaves_the_kv_pool_and_prefix_cache_as_they_were(default_model_dir, chat_prompts, hf_reference):
    from pd_cluster.engine.outputs import EngineStats

    llm = LLM(str(default_model_dir), max_total_tokens=2048, block_size=4)
    engine = llm.engine
    events: list = []
    engine.cache.event_sink = lambda stored, evicted: events.append((stored, evicted))
    free_stack = engine.pool._free_stack.copy()

    assert engine.warm_up(prompt_tokens=16, decode_steps=2) > 0

    assert engine.pool.num_free == engine.pool.capacity == 2048
    assert set(engine.pool._free_stack.tolist()) == set(free_stack.tolist())
    assert engine.cache.cached_tokens == 0 and not engine.cache.root.children and engine.cache.enabled
    assert events == []  # the master hears of no block
    assert engine.stats == EngineStats() and not engine.requests and not engine.has_unfinished()
    assert engine.scheduler.num_preemptions == 0
    # The engine serves as before, and caches what it serves.
    [out] = llm.generate([chat_prompts[0]], greedy(8))
    assert out.token_ids == hf_reference.greedy(chat_prompts[0], 8) and out.num_cached_tokens == 0
    assert engine.cache.cached_tokens > 0 and events


def test_warm_up_needs_an_idle_engine(llm, chat_prompts):
    llm.engine.add_request("busy", chat_prompts[0], greedy(2))
    try:
        with pytest.raises(RuntimeError, match="idle"):
            llm.engine.warm_up()
    finally:
        llm.engine.abort("busy")
    assert not llm.engine.has_unfinished()


def test_one_stream_decodes_through_the_fused_projections_token_identical(llm, chat_prompts, hf_reference, monkeypatch):
    """A lone stream's decode steps take the fused-projection layers (each norm folded into the
    projection after it; on CPU the same ops unfused), still token-identical to transformers."""
    model = llm.engine.model
    assert model.fused_rows == FUSED_ROWS_SMALL  # the default model's layer inputs fit one block
    calls = []
    fused_layer = model._fused_layer

    def counted(*args, **kwargs):
        calls.append(args[4].num_tokens)  # the ForwardBatch
        return fused_layer(*args, **kwargs)

    monkeypatch.setattr(model, "_fused_layer", counted)
    # A prompt no other test sent: its prefill is more than one token (a wholly cached prompt's
    # one-token prefill would be a decode-shaped step too).
    prompt = chat_prompts[0] + [504, 3458, 314]
    assert llm.generate([prompt], greedy())[0].token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
    # Every decode step (all but the first token's) ran every layer fused, one row each.
    assert calls == [1] * (NEW_TOKENS - 1) * model.config.num_layers


def test_a_few_streams_decode_through_the_fused_projections_token_identical(llm, chat_prompts, hf_reference,
                                                                            monkeypatch):
    """Two streams' decode steps take the fused-projection layers too (two rows a step), each
    stream still token-identical to transformers."""
    model = llm.engine.model
    calls = []
    fused_layer = model._fused_layer

    def counted(*args, **kwargs):
        calls.append(args[4].num_tokens)
        return fused_layer(*args, **kwargs)

    monkeypatch.setattr(model, "_fused_layer", counted)
    prompts = [chat_prompts[1] + [504, 3458], chat_prompts[2] + [314, 504]]
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == [hf_reference.greedy(p, NEW_TOKENS) for p in prompts]
    assert 2 in calls


def test_prompt_tokens_a_step_are_capped_apart_from_decode_rows(default_model_dir, chat_prompts, hf_reference):
    # The cap CUDA graphs set (their largest prefill size), below the step's budget: the prompts
    # are prefilled 48 tokens a step in all, beside the rows already decoding.
    llm = LLM(str(default_model_dir), max_total_tokens=8192, max_num_batched_tokens=256, prefill_chunk_tokens=48)
    scheduler = llm.engine.scheduler
    assert scheduler.prefill_chunk_tokens == 48
    steps: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        step = schedule()
        steps.append((step.num_tokens - step.decode_rows, step.decode_rows))
        return step

    scheduler.schedule = recording_schedule
    outputs = llm.generate(chat_prompts, greedy())
    for prompt, out in zip(chat_prompts, outputs):
        assert out.token_ids == hf_reference.greedy(prompt, NEW_TOKENS)
    assert max(prefill for prefill, _ in steps) == 48
    assert sum(prefill for prefill, _ in steps) >= sum(len(p) for p in chat_prompts) - len(chat_prompts)
    assert any(prefill and decoding for prefill, decoding in steps), "no step mixed prefill with decode rows"


def test_a_whole_prefill_request_passes_the_prompt_cap(default_model_dir, chat_prompts, hf_reference):
    # A prefill node's layer-streamed prompt: prefilled in as few steps as the budget allows.
    llm = LLM(str(default_model_dir), max_total_tokens=8192, max_num_batched_tokens=256, prefill_chunk_tokens=48)
    engine = llm.engine
    whole = max((p for p in chat_prompts if 48 < len(p) <= 256), key=len)
    other = min(chat_prompts, key=len)
    assert len(other) * 3 > 48, "the capped prompt must need several chunks"
    reqs = [engine.add_request("whole", whole, greedy(), whole_prefill=True),
            engine.add_request("capped", other + other + other, greedy())]
    steps: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        steps.append([(r.request_id, q) for r, q in zip(step.requests, step.q_lens)])
        return step

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished():
        engine.step()
    assert steps[0] == [("whole", len(whole))]  # the cap's 48 tokens are spent: the other waits
    assert all(q <= 48 for step in steps for rid, q in step if rid == "capped")
    assert list(reqs[0].output_token_ids) == hf_reference.greedy(whole, NEW_TOKENS)
    assert list(reqs[1].output_token_ids) == hf_reference.greedy(other + other + other, NEW_TOKENS)
