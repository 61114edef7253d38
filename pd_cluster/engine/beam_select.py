"""A beam step's choice of continuations, made where the logits are.

Every search's candidates are the top ``k`` of ``log_softmax(logits) + cumulative logprob`` over
its ``[beams x vocab]`` scores. Taken on the host, that meant reading back the whole vocabulary of
every beam and ranking it there: most of a beam step's time beside its forward. Here the
log-softmax, the sums and the top-``k`` of every search run as batched tensor ops on the logits'
device, and one small read-back brings the ``k`` (score, token, parent) of each search, the
chosen tokens' own logprobs and, where asked, each beam's top alternatives. The arithmetic is
float32, as transformers' is, so scores and ties come out the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.device_copy import tensor_on


@dataclass(frozen=True)
class SelectionAsk:
    """What one search needs from a step: its live beams' rows (in order) and their cumulative
    logprobs, how many continuations to keep, and how many alternatives per beam (0: none)."""

    cum_logprobs: list[float]
    k: int
    top_logprobs: int = 0

    @property
    def rows(self) -> int:
        return len(self.cum_logprobs)


@dataclass
class Candidates:
    """One search's best continuations this step, best first."""

    cum_logprobs: list[float]
    parents: list[int]
    token_ids: list[int]
    #: Each continuation's own token logprob (not summed).
    logprobs: list[float]
    #: Per live beam, its top alternatives ``{token: logprob}`` (empty dicts: none asked for).
    top: list[dict[int, float]]


def select(logits: torch.Tensor, asks: list[SelectionAsk]) -> list[Candidates]:
    """The candidates of each search whose beams are ``logits``' rows, consecutive in ``asks``'
    order (``logits`` ``[sum of rows, vocab]``, on any device); one read-back in all."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    vocab = log_probs.shape[1]
    cums = tensor_on([c for ask in asks for c in ask.cum_logprobs], torch.float32, log_probs.device)
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    start = 0
    for ask in asks:
        rows = log_probs[start : start + ask.rows]
        total = (rows + cums[start : start + ask.rows, None]).reshape(-1)
        start += ask.rows
        values, indices = torch.topk(total, min(ask.k, total.numel()))
        own = rows.reshape(-1).index_select(0, indices)
        parts += [values, indices, own]
        if ask.top_logprobs:
            top_values, top_ids = torch.topk(rows, ask.top_logprobs, dim=-1)
            parts += [top_values.reshape(-1), top_ids.reshape(-1)]
        sizes.append(values.numel())
    # float64 holds every float32 and every index below 2**53 exactly: one tensor, one copy.
    packed = torch.cat([p.to(torch.float64) for p in parts]).cpu().tolist()
    return _unpack(packed, asks, sizes, vocab)


def _unpack(packed: list[float], asks: list[SelectionAsk], sizes: list[int], vocab: int) -> list[Candidates]:
    out = []
    at = 0
    for ask, k in zip(asks, sizes):
        values, indices, own = packed[at : at + k], packed[at + k : at + 2 * k], packed[at + 2 * k : at + 3 * k]
        at += 3 * k
        top: list[dict[int, float]] = [{} for _ in range(ask.rows)]
        if ask.top_logprobs:
            n = ask.rows * ask.top_logprobs
            top_values, top_ids = packed[at : at + n], packed[at + n : at + 2 * n]
            at += 2 * n
            t = ask.top_logprobs
            top = [dict(zip((int(i) for i in top_ids[r * t : (r + 1) * t]), top_values[r * t : (r + 1) * t]))
                   for r in range(ask.rows)]
        flat = [int(i) for i in indices]
        out.append(Candidates(values, [i // vocab for i in flat], [i % vocab for i in flat], own, top))
    return out
