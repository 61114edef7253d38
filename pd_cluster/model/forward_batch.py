"""What one model step reads: the new tokens of a ragged batch and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Flattened inputs of one step.

    Sequence ``b`` adds ``q_lens[b]`` tokens at the end of a context of ``ctx_lens[b]`` tokens
    whose KV slots are ``slot_table[b, :ctx_lens[b]]``; the new tokens' slots are ``out_slots``.
    ``logits_indices`` picks the rows (of the flattened tokens) that need next-token logits.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    slot_table: torch.Tensor  # [B, max_ctx] int64
    ctx_lens: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    q_start_loc: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [K] int64
    is_decode: bool  # every sequence adds exactly one token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
