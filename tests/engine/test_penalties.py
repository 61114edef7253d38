"""Penalty counts kept on the device (PenaltyBook): a step reads rows the sampler bumped itself,
and must draw exactly what counts built from the host's token lists give, through row reuse,
table growth, drift between a row and its list, and a whole engine's requests."""

from __future__ import annotations

import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.penalties import PenaltyBook
from pd_cluster.engine.sampler import SamplingState, sample

VOCAB = 64

PENALIZED = [
    dict(seed=1, temperature=0.9, frequency_penalty=0.8),
    dict(seed=2, temperature=0.0, repetition_penalty=1.6),
    dict(seed=3, temperature=1.1, presence_penalty=1.5, top_p=0.9),
    dict(seed=4, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(seed=5, temperature=0.8),  # no penalty: reads the empty row
]


def _states(settings: list[dict], prompt_len: int = 6) -> list[SamplingState]:
    gen = torch.Generator().manual_seed(len(settings))
    return [SamplingState.create(SamplingParams(**kw), torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist())
            for kw in settings]


def _logits(step: int, batch: int) -> torch.Tensor:
    # Peaked rows, so penalties on the few likely tokens change what is drawn.
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 3


def _run(states: list[SamplingState], book: PenaltyBook | None, steps: int) -> list[list[int]]:
    for step in range(steps):
        for state, tok in zip(states, sample(_logits(step, len(states)), states, book)):
            state.output_token_ids.append(tok.token_id)
    return [s.output_token_ids for s in states]


def test_device_counts_draw_what_host_lists_draw() -> None:
    book = PenaltyBook(VOCAB, torch.device("cpu"))
    kept = _run(_states(PENALIZED), book, steps=40)
    rebuilt = _run(_states(PENALIZED), None, steps=40)  # counts built from the lists every step
    assert kept == rebuilt
    assert any(len(set(out)) > 5 for out in kept)  # the penalties spread the draws
    assert book.rows_in_use == 4  # the state without a penalty took no row


def test_penalties_change_the_draws() -> None:
    plain = [{k: v for k, v in kw.items() if "penalty" not in k} for kw in PENALIZED]
    assert _run(_states(PENALIZED), None, steps=30) != _run(_states(plain), None, steps=30)


def test_a_released_row_starts_clean_for_the_next_request() -> None:
    book = PenaltyBook(VOCAB, torch.device("cpu"))
    first = _states(PENALIZED[:1])
    _run(first, book, steps=25)
    book.release(first[0])
    assert book.rows_in_use == 0
    second = _states(PENALIZED[:1], prompt_len=3)
    assert _run(second, book, steps=20) == _run(_states(PENALIZED[:1], prompt_len=3), None, steps=20)
    assert second[0].penalty_row == first[0].penalty_row or first[0].penalty_row is None


def test_a_row_out_of_step_with_its_list_is_rebuilt() -> None:
    book = PenaltyBook(VOCAB, torch.device("cpu"))
    states = _states(PENALIZED)
    _run(states, book, steps=10)
    for s in states:
        del s.output_token_ids[-3:]  # tokens the engine dropped
    reference = _states(PENALIZED)
    for s, r in zip(states, reference):
        r.output_token_ids.extend(s.output_token_ids)
    tail = [sample(_logits(99, len(states)), states, book)[i].token_id for i in range(len(states))]
    assert tail == [t.token_id for t in sample(_logits(99, len(states)), reference)]


def test_tables_grow_and_keep_their_rows() -> None:
    many = [dict(seed=i, temperature=0.9, frequency_penalty=1.0, presence_penalty=0.5) for i in range(21)]
    book = PenaltyBook(VOCAB, torch.device("cpu"))
    assert _run(_states(many), book, steps=12) == _run(_states(many), None, steps=12)
    assert book.capacity >= 22 and book.rows_in_use == 21


def test_engine_rows_follow_requests_and_batches_do_not_mix(default_model_dir, chat_prompts) -> None:
    params = [SamplingParams(seed=10 + i, temperature=0.8, max_tokens=16, frequency_penalty=1.2, presence_penalty=0.5,
                             repetition_penalty=1.2) for i in range(len(chat_prompts))]
    llm = LLM(str(default_model_dir), max_total_tokens=8192)
    together = [o.token_ids for o in llm.generate(chat_prompts, params)]
    assert llm.engine.penalties.rows_in_use == 0  # every finished request gave its row back
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(chat_prompts, params)]
    assert together == alone

    engine = llm.engine
    req = engine.add_request("to-abort", chat_prompts[0], params[0])
    while len(req.output_token_ids) < 3:
        engine.step()
    assert engine.penalties.rows_in_use == 1
    engine.abort("to-abort")
    assert engine.penalties.rows_in_use == 0
