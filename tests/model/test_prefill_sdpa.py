"""Which prefill steps take the library's attention (:mod:`pd_cluster.model.prefill_sdpa`): only
long fresh prompts, on a GPU, outside graph captures. The GPU tests compare its output."""

from __future__ import annotations

import torch

from pd_cluster.model.prefill_sdpa import MIN_TOKENS, fresh_spans, sdpa_applies


def test_only_long_fresh_prompts_take_it() -> None:
    n = MIN_TOKENS
    assert fresh_spans([(0, n, n), (n, n + 5, n + 5)], 0) == [(0, n), (n, n + 5)]
    # Decode rows first are left out; the prompts after them still count.
    assert fresh_spans([(0, 1, 90), (1, n, n)], 1) == [(1, n)]
    assert fresh_spans([(0, n, n + 10)], 0) is None  # a cached prefix
    assert fresh_spans([(0, n, n), (n, n - 1, n - 1)], 0) is None  # a short prompt beside a long one
    assert fresh_spans([(0, 1, 90)], 1) is None  # decode rows only
    assert fresh_spans(None, 0) is None  # a step whose builder has no host lengths (a graph, a TP rank)


def test_not_off_a_gpu() -> None:
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert not sdpa_applies(q, torch.zeros(8, 1, 8, dtype=torch.bfloat16), None)
