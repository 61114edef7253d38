"""Token counts for the penalties, kept on the logits' device.

Frequency and presence penalties need each row's output token counts, and the repetition penalty
the set of tokens its prompt and output hold. Building them from the host's token lists every
step costs host time that grows with the output. Instead each request with a penalty gets a row
in two device tables, filled once from its lists and then bumped on the device by every token
sampled for it: a step reads its rows with one gather and writes them with one scatter.

A row reflects a known number of the request's output tokens (:attr:`PenalizedState.penalty_len`);
when the host's list no longer matches it (a token the engine dropped, a request restarted) the
row is rebuilt from the lists, so the tables are a cache that cannot drift from the host's truth.

Tables grow by doubling; row 0 stays empty and stands for the rows of a batch without penalties.
At a 128k vocabulary a row costs 640 KiB (int32 counts and a bool set).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from pd_cluster.engine.device_copy import tensor_on, to_device
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_NEUTRAL = 0
_FIRST_CAPACITY = 8


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class PenalizedState(Protocol):
    """What the book reads and keeps of one request's sampling state (the sampler's
    ``SamplingState``): its settings and token lists, and its row here."""

    params: SamplingParams
    output_token_ids: list[int]
    penalty_book: PenaltyBook | None
    penalty_row: int | None
    penalty_len: int

    def counted_output(self) -> list[int]: ...

    def prompt_ids_tensor(self) -> torch.Tensor: ...


class PenaltyBook:
    """Device rows of output-token counts and seen-token sets, one per request with a penalty."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.counts: torch.Tensor | None = None  # [capacity, vocab] int32
        self.seen: torch.Tensor | None = None  # [capacity, vocab] bool
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    @property
    def rows_in_use(self) -> int:
        return max(self.capacity - 1 - len(self._free), 0)

    def _grow(self) -> None:
        old = self.capacity
        new = max(_FIRST_CAPACITY, 2 * old)
        counts = torch.zeros((new, self.vocab), dtype=torch.int32, device=self.device)
        seen = torch.zeros((new, self.vocab), dtype=torch.bool, device=self.device)
        if self.counts is not None and self.seen is not None:
            counts[:old].copy_(self.counts)
            seen[:old].copy_(self.seen)
        self.counts, self.seen = counts, seen
        self._free.extend(range(new - 1, max(old, 1) - 1, -1))
        logger.debug("penalty tables grown to %d rows", new)

    def _fill(self, state: PenalizedState) -> None:
        """(Re)build ``state``'s row from its token lists."""
        assert self.counts is not None and self.seen is not None
        row = state.penalty_row
        # Tokens still on the device (negative placeholders) are counted when they are recorded.
        counted = torch.tensor([t for t in state.counted_output() if t >= 0], dtype=torch.int64)
        counted = to_device(counted, self.device)
        output = torch.tensor([t for t in state.output_token_ids if t >= 0], dtype=torch.int64)
        seen_ids = torch.cat((state.prompt_ids_tensor(), output))
        self.counts[row].zero_()
        self.counts[row].index_add_(0, counted, torch.ones_like(counted, dtype=torch.int32))
        self.seen[row].zero_()
        seen = to_device(seen_ids, self.device)
        self.seen[row].index_fill_(0, seen, True)
        state.penalty_len = len(state.output_token_ids)

    def rows(self, states: Sequence[PenalizedState]) -> list[int]:
        """Each state's row (row 0 for a state without penalties), taking and filling rows for new
        ones and rebuilding rows whose state moved on without them."""
        out = []
        for state in states:
            if not has_penalties(state.params):
                out.append(_NEUTRAL)
                continue
            if state.penalty_book is not self:
                if not self._free:
                    self._grow()
                state.penalty_row = self._free.pop()
                state.penalty_book = self
                self._fill(state)
            elif state.penalty_len != len(state.output_token_ids):
                self._fill(state)
            out.append(state.penalty_row)
        return out

    def record(self, states: Sequence[PenalizedState], tokens: torch.Tensor) -> None:
        """Count ``tokens`` ``[B]`` (on the device; row i sampled for ``states[i]``) into the rows
        of the states with penalties; the host appends the same tokens to their lists."""
        picked = [(i, s.penalty_row) for i, s in enumerate(states) if s.penalty_book is self]
        if not picked or self.counts is None or self.seen is None:
            return
        index = tensor_on(picked, torch.int64, self.device)
        rows, drawn = index[:, 1], tokens.index_select(0, index[:, 0])
        self.counts.index_put_((rows, drawn), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
        # A tensor value: assigning the Python scalar True copies it from pageable memory and
        # waits for the device.
        self.seen.index_put_((rows, drawn), torch.ones_like(rows, dtype=torch.bool))
        for i, _ in picked:
            states[i].penalty_len += 1

    def release(self, state: PenalizedState) -> None:
        """Give ``state``'s row back (a finished or aborted request)."""
        if state.penalty_book is self and state.penalty_row is not None:
            self._free.append(state.penalty_row)
        state.penalty_row = None
        state.penalty_book = None
