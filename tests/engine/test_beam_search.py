"""Beam search in the engine against transformers' ``generate(num_beams=4)``, and its KV books."""

from __future__ import annotations


import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.kv_spec import KVSpec
from tests.beam_reference import BEAM_MESSAGES

WIDTH = 4
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM(str(default_model_dir), max_total_tokens=4096)


@pytest.fixture(scope="module")
def beam_prompts(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for m in BEAM_MESSAGES]


def beam_params(**kw) -> SamplingParams:
    settings = {"beam_width": WIDTH, "beam_outputs": WIDTH, "max_tokens": NEW_TOKENS, "length_penalty": 1.0,
                "early_stopping": True, **kw}
    return SamplingParams(use_beam_search=True, temperature=0.0, **settings)


def run_all(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_beam_request(f"beam-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return {r.request_id: r for r in engine.take_beam_results()}


@pytest.fixture(scope="module")
def searched(llm, beam_prompts) -> dict:
    """The sixteen searches, run at once (their rows batched), and the pool's free count before."""
    free = llm.engine.pool.num_free
    return {"results": run_all(llm, beam_prompts, beam_params()), "free": free}


def test_searches_return_every_slot_and_row(llm, beam_prompts, searched):
    assert len(beam_prompts) == len(searched["results"]) == 16
    assert llm.engine.pool.num_free == searched["free"]
    assert llm.engine.scheduler.external_held == 0


@pytest.mark.parametrize("index", range(len(BEAM_MESSAGES)))
def test_beams_and_scores_equal_transformers(index, beam_prompts, searched, beam_reference):
    expected = beam_reference.beams(beam_prompts[index], WIDTH, NEW_TOKENS)
    got = searched["results"][f"beam-{index}"].beams
    assert [b.token_ids for b in got] == [b.token_ids for b in expected]
    assert [b.score for b in got] == pytest.approx([b.score for b in expected], abs=1e-4)
    for beam in got:
        assert beam.score == pytest.approx(beam.cum_logprob / len(beam.token_ids), abs=1e-5)
        assert sum(e.logprob for e in beam.logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)


def test_logprobs_carry_the_top_alternatives(llm, beam_prompts):
    [result] = run_all(llm, beam_prompts[:1], beam_params(logprobs=3)).values()
    for beam in result.beams:
        for entry in beam.logprobs:
            assert len(entry.top) == 3
            assert max(entry.top.values()) >= entry.logprob


def test_aborted_and_finished_searches_leave_no_slot_held(llm, beam_prompts):
    engine = llm.engine
    free, rows = engine.pool.num_free, engine.table.num_free_rows
    for i, prompt in enumerate(beam_prompts[:3]):
        engine.add_beam_request(f"leak-{i}", prompt, beam_params(max_tokens=24, early_stopping=False))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free < free
    assert any(engine.pool.holders(s) > 1 for s in range(engine.pool.capacity)), "beams share their prefix"
    assert engine.abort("leak-0") and engine.abort("leak-1")
    while engine.has_unfinished():
        engine.step()
    assert [r.request_id for r in engine.take_beam_results()] == ["leak-2"]
    assert (engine.pool.num_free, engine.table.num_free_rows) == (free, rows)
    assert engine.scheduler.external_held == 0


def test_greedy_requests_run_beside_beam_searches(llm, beam_prompts, hf_reference):
    engine = llm.engine
    engine.add_beam_request("beside", beam_prompts[2], beam_params())
    [out] = llm.generate([beam_prompts[3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out.token_ids == hf_reference.greedy(beam_prompts[3], 8)
    while engine.has_unfinished():
        engine.step()
    assert [r.request_id for r in engine.take_beam_results()] == ["beside"]


@pytest.mark.parametrize("field, value", [("temperature", 0.7), ("top_p", 0.9), ("seed", 1), ("stop", ["x"])])
def test_beam_search_refuses_sampling_knobs(field, value):
    settings = {"use_beam_search": True, "temperature": 0.0, "beam_width": 2, field: value}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**settings)


def test_a_shared_slot_returns_to_the_pool_with_its_last_holder():
    pool = KVPool(KVSpec(model="m", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_size=4), 8)
    slots = pool.alloc(3)
    pool.share(slots[:2])
    pool.share(slots[:1])
    assert [pool.holders(int(s)) for s in slots] == [3, 2, 1]
    pool.free(slots)
    assert pool.num_free == 6 and [pool.holders(int(s)) for s in slots] == [2, 1, 0]
    pool.free(slots[:2])
    pool.free(slots[:1])
    assert pool.num_free == 8
    with pytest.raises(RuntimeError):
        pool.free(torch.tensor([int(slots[0])]))
    with pytest.raises(RuntimeError):
        pool.share(torch.tensor([int(slots[0])]))


def test_a_search_started_from_handed_over_kv_equals_transformers(llm, beam_prompts, beam_reference):
    """As on a decode node after a handover: the prompt's KV is already in slots the search is
    given (here a held prefill's, shared, as a prefix-cache hit is); it recomputes only the last
    prompt token and answers what transformers does, then gives back every slot it held."""
    engine, prompt = llm.engine, beam_prompts[5]
    engine.cache.evict(engine.cache.evictable_tokens)
    free, rows = engine.pool.num_free, engine.table.num_free_rows
    req = engine.add_request("held", prompt, SamplingParams(temperature=0.0, max_tokens=2), hold_kv=True,
                             prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    slots = engine.held_slots(req)
    assert slots.numel() == len(prompt)
    engine.pool.share(slots)
    engine.add_beam_request("handed", prompt, beam_params(), prompt_slots=slots)
    engine.release(req)
    [row] = engine.beams.running[0].rows
    assert row.num_tokens - row.num_computed == 1  # its first step computes the last prompt token only
    while engine.has_unfinished():
        engine.step()
    [result] = engine.take_beam_results()
    expected = beam_reference.beams(prompt, WIDTH, NEW_TOKENS)
    assert [b.token_ids for b in result.beams] == [b.token_ids for b in expected]
    assert [b.score for b in result.beams] == pytest.approx([b.score for b in expected], abs=1e-4)
    engine.cache.evict(engine.cache.evictable_tokens)
    assert (engine.pool.num_free, engine.table.num_free_rows) == (free, rows)
    assert engine.scheduler.external_held == 0


def test_a_handed_over_search_without_room_gives_its_slots_back(llm, beam_prompts):
    engine, prompt = llm.engine, beam_prompts[0]
    free = engine.pool.num_free
    hold = engine.pool.alloc(free - len(prompt) - 8)
    slots = engine.pool.alloc(len(prompt))
    with pytest.raises(ValueError, match="no room"):
        engine.add_beam_request("cramped", prompt, beam_params(), prompt_slots=slots)
    assert engine.pool.num_free == len(prompt) + 8 and not engine.beams.has_work()
    engine.pool.free(hold)
    assert engine.pool.num_free == free and engine.scheduler.external_held == 0


@pytest.fixture(scope="module")
def pipelined_llm(default_model_dir) -> LLM:
    return LLM(str(default_model_dir), max_total_tokens=4096, overlap_schedule=True)


def test_pipelined_searches_equal_the_step_by_step_ones(pipelined_llm, beam_prompts, searched):
    """With overlap scheduling (a GPU's default) a call launches each search's next step, its rows
    forked on the device from the beams the device kept, before it reads the step before back:
    the same beams and scores, and every slot and row back at the end."""
    engine = pipelined_llm.engine
    assert engine.beams.pipelined
    free, rows = engine.pool.num_free, engine.table.num_free_rows
    got = run_all(pipelined_llm, beam_prompts[:6], beam_params())
    for i in range(6):
        expected = searched["results"][f"beam-{i}"].beams
        assert [b.token_ids for b in got[f"beam-{i}"].beams] == [b.token_ids for b in expected]
        assert [b.score for b in got[f"beam-{i}"].beams] == pytest.approx([b.score for b in expected], abs=1e-4)
    assert (engine.pool.num_free, engine.table.num_free_rows) == (free, rows)
    assert engine.scheduler.external_held == 0


def test_a_search_aborted_with_its_step_in_flight_gives_everything_back(pipelined_llm, beam_prompts):
    engine = pipelined_llm.engine
    free, rows = engine.pool.num_free, engine.table.num_free_rows
    for i, prompt in enumerate(beam_prompts[:2]):
        engine.add_beam_request(f"cut-{i}", prompt, beam_params(max_tokens=24, early_stopping=False))
    for _ in range(4):
        engine.step()
    assert engine.beams.frees_at_launch is not None  # a step is in flight
    assert engine.abort("cut-0")
    while engine.has_unfinished():
        engine.step()
    assert [r.request_id for r in engine.take_beam_results()] == ["cut-1"]
    assert (engine.pool.num_free, engine.table.num_free_rows) == (free, rows)
    assert engine.beams.frees_at_launch is None and engine.scheduler.external_held == 0
