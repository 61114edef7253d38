"""A beam step's selection on the logits' device against the same ranking done over the whole
vocabulary on the host: the same continuations, parents, scores and alternatives, search by search."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.beam_select import SelectionAsk, select

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
    asks = [SelectionAsk([0.0], 8), SelectionAsk([-1.5, -2.25, -2.5, -7.0], 8), SelectionAsk([-3.0, -3.125], 6)]
    chosen = select(logits, asks)
    start = 0
    for ask, got in zip(asks, chosen):
        expected = host_ranking(logits[start : start + ask.rows], ask.cum_logprobs, ask.k)
        start += ask.rows
        assert list(zip(got.cum_logprobs, got.parents, got.token_ids, got.logprobs)) == expected
        assert got.top == [{} for _ in range(ask.rows)]


def test_alternatives_are_each_beams_own_top(logits):
    [got] = select(logits[:3], [SelectionAsk([-1.0, -2.0, -4.0], 8, top_logprobs=3)])
    log_probs = torch.log_softmax(logits[:3], dim=-1)
    for row, top in zip(log_probs, got.top):
        values, ids = torch.topk(row, 3)
        assert top == dict(zip(ids.tolist(), values.tolist()))


def test_a_search_of_one_beam_over_a_tiny_vocabulary_keeps_what_there_is():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    [got] = select(logits, [SelectionAsk([0.0], 8)])
    assert got.token_ids == [2, 1, 0] and got.parents == [0, 0, 0]
    assert sum(torch.tensor(got.cum_logprobs).exp().tolist()) == pytest.approx(1.0)
