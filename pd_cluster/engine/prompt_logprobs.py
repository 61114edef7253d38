"""Logprobs of a prompt's own tokens (``SamplingParams.prompt_logprobs``), computed as its
prefill chunks run: what evaluation harnesses score (each choice's loglikelihood, perplexity).

The logits at position ``p`` of the prompt predict token ``p + 1``, so a chunk covering positions
``[start, start + q)`` yields the entries of tokens ``start + 1 .. start + q`` (the prompt's last
position predicts the first generated token, which sampling reports). The model hands back the
chunk's final hidden states (normed) for those rows only, and this module applies the LM head a
block of :data:`ROWS_PER_BLOCK` rows at a time: a long prompt never holds ``[prompt, vocab]``
float32 logits at once, and only the chosen token's logprob and the top ``k`` leave the device.

Values come from the raw logits (before bias, penalties or grammar masks), as vLLM reports them.
A position served from the prefix cache has no logits: a request that asks is matched against
the cache only up to what it has computed (see ``Scheduler._admit``), so it recomputes the rest.
Requests that do not ask cost nothing: the runner checks one empty set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pd_cluster.protocol import PromptLogprobs

#: Hidden rows turned into logits at once: ``ROWS_PER_BLOCK x vocab`` float32 at most.
ROWS_PER_BLOCK = 256


@dataclass(eq=False)
class PromptLogprobsState:
    """One request's prompt logprobs as its chunks compute them: entry ``i`` is token ``i + 1``'s."""

    token_ids: list[int]
    top: int
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def needed(self) -> int:
        return len(self.token_ids) - 1

    @property
    def done(self) -> int:
        """Leading positions whose entry is computed: the prefix cache may serve that many tokens."""
        return len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.done >= self.needed

    def rows_of(self, start: int, q_len: int) -> range:
        """The positions of a chunk ``[start, start + q_len)`` whose entry is still missing (a
        recomputed chunk after a preemption finds its earlier entries kept)."""
        return range(max(start, self.done), min(start + q_len, self.needed))

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(logprobs=self.logprobs, ranks=self.ranks, top_ids=self.top_ids if self.top else [],
                              top_logprobs=self.top_logprobs if self.top else [])


@dataclass
class PromptRowsPlan:
    """The flat rows of one step whose logits are prompt entries, and whose they are."""

    #: Rows of the step's flattened input, in order.
    rows: list[int] = field(default_factory=list)
    #: The token each row's logits score (the next prompt token).
    targets: list[int] = field(default_factory=list)
    #: (request's state, how many consecutive rows are its), in row order.
    owners: list[tuple[PromptLogprobsState, int]] = field(default_factory=list)
    top: int = 0

    def add(self, state: PromptLogprobsState, flat_start: int, positions: range) -> None:
        if not positions:
            return
        offset = flat_start - positions.start
        self.rows.extend(p + offset for p in positions)
        self.targets.extend(state.token_ids[positions.start + 1:positions.stop + 1])
        self.owners.append((state, len(positions)))
        self.top = max(self.top, state.top)


def plan_rows(states: list[tuple[PromptLogprobsState, int, int, int]]) -> PromptRowsPlan | None:
    """``states``: (state, chunk's first position, chunk's length, its first flat row) of each
    asking request in the step; None when none has a row left to score."""
    plan = PromptRowsPlan()
    for state, start, q_len, flat_start in states:
        positions = state.rows_of(start, q_len)
        plan.add(state, flat_start + (positions.start - start) if positions else 0, positions)
    return plan if plan.rows else None


@torch.inference_mode()
def score_rows(hidden: torch.Tensor, lm_head: torch.Tensor, plan: PromptRowsPlan) -> None:
    """Apply the LM head to ``hidden`` (the plan's rows, normed, in order) a block at a time and
    append each request's entries to its state."""
    targets = torch.tensor(plan.targets, dtype=torch.int64, device=hidden.device)
    chosen_parts, rank_parts, top_values, top_ids = [], [], [], []
    for begin in range(0, hidden.shape[0], ROWS_PER_BLOCK):
        end = min(begin + ROWS_PER_BLOCK, hidden.shape[0])
        logprobs = F.linear(hidden[begin:end], lm_head).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[begin:end].unsqueeze(1))
        chosen_parts.append(chosen.squeeze(1))
        rank_parts.append((logprobs > chosen).sum(dim=1) + 1)
        if plan.top:
            top = logprobs.topk(min(plan.top, logprobs.shape[1]), dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
        del logprobs
    chosen_list = torch.cat(chosen_parts).cpu().tolist()
    ranks = torch.cat(rank_parts).cpu().tolist()
    values = torch.cat(top_values).cpu().tolist() if plan.top else None
    ids = torch.cat(top_ids).cpu().tolist() if plan.top else None
    row = 0
    for state, count in plan.owners:
        state.logprobs.extend(chosen_list[row:row + count])
        state.ranks.extend(ranks[row:row + count])
        if state.top and values is not None and ids is not None:
            state.top_logprobs.extend(v[:state.top] for v in values[row:row + count])
            state.top_ids.extend(i[:state.top] for i in ids[row:row + count])
        row += count
