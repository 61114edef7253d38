"""Which beams live on, which end, and when a beam search is over: transformers' rule, step by step.

Each step takes the top ``k`` continuations of all live beams by cumulative logprob (``k`` is
``max(2, 1 + stop ids) * width``, so that ``width`` of them survive whatever ends; ranked on the
logits' device, :mod:`pd_cluster.engine.beam_select`), keeps the best
``width`` that did not end as the next live beams, and offers those among the first ``width``
that ended (a stop id, or the length limit) to the finished list, scored
``cumulative logprob / generated tokens ** length_penalty``. The search ends when no
continuation is left, when ``early_stopping`` holds ``width`` finished beams, or when the best
live beam can no longer beat the worst finished one (scored at its current length). The
arithmetic is float32, as transformers' is, so scores and ties come out the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_cluster.engine.beam_select import Candidates
from pd_cluster.protocol import TokenLogprob

#: transformers' stand-in for "minus infinity" in beam scores.
_NEG = -1.0e9


@dataclass
class Beam:
    """A live beam: its generated tokens, their logprobs and their float32 sum; ``parent`` is
    the index of the live beam of the step before that it continues (-1: the prompt's)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cum_logprob: float = 0.0
    parent: int = -1


@dataclass
class FinishedBeam:
    """An ended beam and its length-penalized score (the ranking key)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    cum_logprob: float
    score: float
    finish_reason: str
    #: The tokens' text, where the caller decodes it (the scorer has no tokenizer).
    text: str = ""


@dataclass
class _Candidate:
    parent: int
    token_id: int
    cum_logprob: float
    ends: bool


class BeamScorer:
    """The state of one beam search between steps (no KV: :mod:`pd_cluster.engine.beam_search`
    moves the rows)."""

    def __init__(self, width: int, max_tokens: int, stop_ids: set[int], *, length_penalty: float = 1.0,
                 early_stopping: bool = False, top_logprobs: int | None = None) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        #: Alternatives kept with each token's logprob (None: no logprobs asked for).
        self.top_logprobs = top_logprobs
        self.running: list[Beam] = [Beam()]
        #: Best first, at most ``width``.
        self.finished: list[FinishedBeam] = []
        self.done = False
        self._can_improve = True

    @property
    def generated(self) -> int:
        """Tokens each live beam has generated (all the same)."""
        return len(self.running[0].token_ids)

    @property
    def k(self) -> int:
        """Continuations ranked a step: enough that ``width`` survive whatever ends."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def advance(self, chosen: Candidates) -> list[Beam]:
        """Take one step's best continuations (ranked :attr:`k` deep) and return the new
        live beams (empty once :attr:`done`)."""
        length = self.generated + 1
        at_limit = length >= self.max_tokens
        candidates = [_Candidate(p, t, v, at_limit or t in self.stop_ids)
                      for p, t, v in zip(chosen.parents, chosen.token_ids, chosen.cum_logprobs)]
        extended = [self._extend(c, own, chosen.top[c.parent]) for c, own in zip(candidates, chosen.logprobs)]
        kept = sorted(range(len(candidates)), key=lambda i: (candidates[i].ends, -candidates[i].cum_logprob))
        if chosen.kept and chosen.kept != kept[: self.width]:
            raise RuntimeError(f"beam search: the device kept continuations {chosen.kept}, the rule {kept[: self.width]}")
        self._offer_finished(candidates[: self.width], extended, length)
        self.running = [extended[i] for i in kept[: self.width]]
        self._check_can_improve(length)
        all_end = all(c.ends for c in candidates)
        full = len(self.finished) == self.width and self.early_stopping
        self.done = all_end or full or not self._can_improve
        if self.done:
            self.running = []
        return self.running

    def best(self, n: int) -> list[FinishedBeam]:
        return self.finished[:n]

    def _extend(self, cand: _Candidate, logprob: float, top: dict[int, float]) -> Beam:
        parent = self.running[cand.parent]
        entry = TokenLogprob(token_id=cand.token_id, logprob=logprob, top=dict(top))
        return Beam(parent.token_ids + [cand.token_id], parent.logprobs + [entry], cand.cum_logprob, cand.parent)

    def _offer_finished(self, first: list[_Candidate], extended: list[Beam], length: int) -> None:
        """The ended among the best ``width`` continuations join the finished list, unless it is
        closed (full under early stopping, or no improvement possible)."""
        if (len(self.finished) == self.width and self.early_stopping) or not self._can_improve:
            return
        penalty = float(length) ** self.length_penalty
        for cand, beam in zip(first, extended):
            if not cand.ends:
                continue
            score = float(torch.tensor(cand.cum_logprob, dtype=torch.float32) / penalty)
            reason = "stop" if cand.token_id in self.stop_ids else "length"
            self.finished.append(FinishedBeam(beam.token_ids, beam.logprobs, beam.cum_logprob, score, reason))
        # Stable: of equal scores the one finished earlier (or ranked higher) stays first.
        self.finished.sort(key=lambda f: -f.score)
        del self.finished[self.width:]

    def _check_can_improve(self, length: int) -> None:
        """Whether the best live beam, scored at its current length, still beats the worst
        finished one (always while the finished list has room)."""
        if not self.running or len(self.finished) < self.width:
            return
        best = float(torch.tensor(self.running[0].cum_logprob, dtype=torch.float32) / float(length) ** self.length_penalty)
        if not best > self.finished[-1].score:
            self._can_improve = False
