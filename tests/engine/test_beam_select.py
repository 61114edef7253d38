"""A beam step's selection on the logits' device against the same ranking done over the whole
vocabulary on the host: the same continuations, parents, scores and alternatives, search by search."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.beam_select import SelectionAsk, select, select_on_device

VOCAB = 1000


def host_ranking(logits: torch.Tensor, cums: list[float], k: int) -> list[tuple[float, int, int, float]]:
    """(cumulative logprob, parent, token, own logprob) of the top ``k``, best first."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    total = (log_probs + torch.tensor(cums, dtype=torch.float32)[:, None]).reshape(-1)
    values, indices = torch.topk(total, k)
    return [(v, i // VOCAB, i % VOCAB, float(log_probs.reshape(-1)[i])) for v, i in zip(values.tolist(), indices.tolist())]


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(3)) * 4


def test_each_search_gets_its_own_top_continuations(logits):
    sums = [[0.0], [-1.5, -2.25, -2.5, -7.0], [-3.0, -3.125]]
    asks = [SelectionAsk(1, 8), SelectionAsk(4, 8), SelectionAsk(2, 6)]
    chosen = select(logits, asks, [c for cums in sums for c in cums])
    start = 0
    for ask, cums, got in zip(asks, sums, chosen):
        expected = host_ranking(logits[start : start + ask.rows], cums, ask.k)
        start += ask.rows
        assert list(zip(got.cum_logprobs, got.parents, got.token_ids, got.logprobs)) == expected
        assert got.top == [{} for _ in range(ask.rows)]


def test_alternatives_are_each_beams_own_top(logits):
    [got] = select(logits[:3], [SelectionAsk(3, 8, top_logprobs=3)], [-1.0, -2.0, -4.0])
    log_probs = torch.log_softmax(logits[:3], dim=-1)
    for row, top in zip(log_probs, got.top):
        values, ids = torch.topk(row, 3)
        assert top == dict(zip(ids.tolist(), values.tolist()))


def test_a_search_of_one_beam_over_a_tiny_vocabulary_keeps_what_there_is():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    [got] = select(logits, [SelectionAsk(1, 8)], [0.0])
    assert got.token_ids == [2, 1, 0] and got.parents == [0, 0, 0]
    assert sum(torch.tensor(got.cum_logprobs).exp().tolist()) == pytest.approx(1.0)


def test_the_kept_beams_are_the_best_that_do_not_end_in_rank_order(logits):
    """On the device, as the scorer's rule: the best ``keep`` continuations whose token is no
    stop id, ranked as the candidates are; their tokens, parents and sums stay on the device."""
    sums = [-1.0, -1.25, -3.0, -0.5, -2.0, -2.5, -4.0]
    [plain] = select(logits, [SelectionAsk(7, 12)], sums)
    stop = torch.tensor(plain.token_ids[:3:2])  # the first and third ranked end
    asks = [SelectionAsk(3, 8, keep=2), SelectionAsk(4, 12, keep=4, stop_ids=stop)]
    selection = select_on_device(logits, torch.tensor(sums), asks)
    first, second = selection.fetch()
    assert first.kept == [0, 1]
    ends = [t in stop.tolist() for t in second.token_ids]
    expected = [i for i in range(len(ends)) if not ends[i]][:4]
    assert any(ends[:4]) and second.kept == expected
    for got, kept in zip((first, second), selection.kept):
        assert kept.tokens.tolist() == [got.token_ids[i] for i in got.kept]
        assert kept.parents.tolist() == [got.parents[i] for i in got.kept]
        assert kept.cum_logprobs.tolist() == [got.cum_logprobs[i] for i in got.kept]


def test_a_last_step_keeps_nothing(logits):
    selection = select_on_device(logits[:2], torch.zeros(2), [SelectionAsk(2, 8)])
    assert selection.kept == [None] and selection.fetch()[0].kept == []
