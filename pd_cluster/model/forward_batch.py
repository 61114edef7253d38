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

    The first ``num_decode`` sequences add one token each and hold the first ``num_decode``
    tokens: the decode kernel serves them, the prefill kernel the rest (a step that mixes prefill
    chunks into a decode batch). A pure-decode step (``is_decode``) has every sequence there.
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
    num_decode: int = 0
    #: When set, ``slot_table`` is the engine's request table, read in place: sequence ``b``'s
    #: slots are its row ``table_rows[b]`` (CUDA graphs: no per-step copy of the rows).
    table_rows: torch.Tensor | None = None  # [B] int64
    #: Rows (of the flattened tokens) whose final hidden states, normed, the step hands back in
    #: ``hidden_out`` beside the logits (a prompt's logprobs are scored from them a block at a time).
    hidden_rows: torch.Tensor | None = None  # [R] int64
    hidden_out: torch.Tensor | None = None  # [R, hidden], set by the forward
    #: Each sequence's ``(q_start, q_len, ctx_len)`` on the host, where the step's builder knows
    #: them (an eager step): long fresh prompts then take the library's attention.
    host_spans: list[tuple[int, int, int]] | None = None

    def prefill_part(self) -> PrefillPart:
        """The sequences after the first ``num_decode``, their token offsets rebased to that part."""
        nd = self.num_decode
        rows = self.table_rows
        return PrefillPart(
            slot_table=self.slot_table if rows is not None else self.slot_table[nd:],
            ctx_lens=self.ctx_lens[nd:],
            q_lens=self.q_lens[nd:],
            q_start_loc=self.q_start_loc[nd:] - nd if nd else self.q_start_loc,
            table_rows=rows[nd:] if rows is not None else None,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PrefillPart:
    """The prefill sequences of a step, addressed from their first token (see ``ForwardBatch``)."""

    slot_table: torch.Tensor
    ctx_lens: torch.Tensor
    q_lens: torch.Tensor
    q_start_loc: torch.Tensor
    table_rows: torch.Tensor | None = None
