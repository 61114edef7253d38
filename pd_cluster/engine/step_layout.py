"""Where a step's requests sit in the model's flattened input.

One-token rows (decode steps) come first, prefill chunks after them: the model serves the first
part with the split-K decode kernel and the rest with the prefill kernel
(:class:`pd_cluster.model.forward_batch.ForwardBatch`). A CUDA graph pads the decode part to its
captured size, so the prefill part may start later than the last decode row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.device_copy import tensor_on
from pd_cluster.engine.request import PENDING
from pd_cluster.engine.scheduler import ScheduledStep


@dataclass(frozen=True)
class StepLayout:
    #: Step indices of the one-token rows, in step order.
    decode: list[int]
    #: Step indices of the prefill chunks (more than one token), in step order.
    prefill: list[int]
    #: Token offset of each prefill chunk within the prefill part, by position in ``prefill``.
    prefill_offsets: list[int]
    #: Tokens of the prefill part.
    prefill_tokens: int

    @classmethod
    def of(cls, step: ScheduledStep) -> StepLayout:
        decode, prefill, offsets = [], [], []
        total = 0
        for i, q_len in enumerate(step.q_lens):
            if q_len == 1:
                decode.append(i)
            else:
                prefill.append(i)
                offsets.append(total)
                total += q_len
        return cls(decode, prefill, offsets, total)

    @property
    def num_decode(self) -> int:
        return len(self.decode)

    def token_starts(self, step: ScheduledStep, decode_rows: int | None = None) -> list[int]:
        """Each request's first token in the flattened input, by step index, with the decode part
        ``decode_rows`` rows long (default: just its own rows)."""
        base = self.num_decode if decode_rows is None else decode_rows
        starts = [0] * len(step.q_lens)
        for row, i in enumerate(self.decode):
            starts[i] = row
        for offset, i in zip(self.prefill_offsets, self.prefill):
            starts[i] = base + offset
        return starts

    def pending_inputs(self, step: ScheduledStep, starts: list[int]) -> tuple[list[int], list[int]]:
        """(flat positions, rows of the last step's sampled ids) of the inputs still on the device."""
        where, rows = [], []
        for i, (req, q_len) in enumerate(zip(step.requests, step.q_lens)):
            last = req.num_computed + q_len - 1
            if req.token_ids(last, last + 1)[0] == PENDING:
                if req.pending_index is None:
                    raise RuntimeError(f"request {req.request_id}: its input is on the device but not in the last step")
                where.append(starts[i] + q_len - 1)
                rows.append(req.pending_index)
        return where, rows

    def take_device_ids(self, step: ScheduledStep, starts: list[int], input_ids: torch.Tensor,
                        device_tokens: torch.Tensor | None) -> None:
        """Write into ``input_ids`` (flattened as ``starts`` says) the ids of the inputs still on the
        device: rows of ``device_tokens``, the last step's sampled ids."""
        if device_tokens is None:
            return
        where, rows = self.pending_inputs(step, starts)
        n = len(where)
        if n and where[-1] == rows[-1] == n - 1 and where == rows == list(range(n)):
            # The common decode step: the same rows in the same order as the last one (no index
            # to copy to the device).
            input_ids[:n].copy_(device_tokens[:n])
        elif where:
            index = tensor_on([where, rows], torch.int64, input_ids.device)
            input_ids.index_copy_(0, index[0], device_tokens.index_select(0, index[1]))
