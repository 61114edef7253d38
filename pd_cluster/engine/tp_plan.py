"""A step's plan as rank 0 sends it to the other ranks: a header and one payload of model inputs.

A fixed-size header says what follows (a step, a keep-alive or the end) and the sizes; one int64
payload holds every input of :class:`~pd_cluster.model.forward_batch.ForwardBatch` (an eager
step) or of a CUDA graph's static buffers (a replayed one), then the request table's writes since
the last step (the ranks' tables follow rank 0's: their graphs read them). Header and payload go
together, in one message of :class:`~pd_cluster.engine.tp_channel.PlanChannel`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from pd_cluster.model.forward_batch import ForwardBatch

HEADER_LEN = 8


class Op(enum.IntEnum):
    STOP = 0
    FORWARD = 1
    KEEP_ALIVE = 2
    #: KV written on rank 0 from outside (a handover): the slots, then (over the model group)
    #: every head's KV there; each rank keeps its own heads.
    PUT_KV = 3
    #: KV leaving the node (a handover): the slots; the ranks' heads there go to rank 0 (an
    #: all-gather over the model group).
    GATHER_KV = 4
    #: A step replayed as a CUDA graph: its shape, then its packed static inputs.
    FORWARD_GRAPH = 5
    #: Capture the CUDA graphs: their settings (:func:`graph_settings`).
    CAPTURE = 6
    #: Export each rank's KV pool for a P on the host: the request's number (the kinds and the
    #: answers go through the node's store, :mod:`pd_cluster.engine.tp_pools`).
    EXPORT_POOLS = 7


#: Header field of the request-table writes' count (FORWARD and FORWARD_GRAPH).
JOURNAL = 7


def header(op: Op, batch: ForwardBatch | None = None) -> list[int]:
    """A message's header: ``op``, then the sizes of what follows (a plain list: it goes into the
    ring as it is, with no tensor made per step)."""
    head = [int(op)] + [0] * (HEADER_LEN - 1)
    if batch is not None:
        b, max_ctx = batch.slot_table.shape
        head[1:7] = [batch.num_tokens, b, max_ctx, batch.logits_indices.numel(), int(batch.is_decode),
                     batch.num_decode]
    return head


def slots_header(op: Op, n_slots: int) -> list[int]:
    """The header of a KV op (:attr:`Op.PUT_KV`, :attr:`Op.GATHER_KV`) on ``n_slots`` slots."""
    head = header(op)
    head[1] = n_slots
    return head


def graph_header(decode: int, tokens: int, inputs: int, prev_ids: bool, journal: int = 0) -> list[int]:
    """A replayed step's header: its graph's shape (``decode`` rows, ``tokens`` prefill tokens),
    its packed inputs' length, whether the last step's sampled ids follow (over the model group),
    and the request table's writes that follow its inputs."""
    return [int(Op.FORWARD_GRAPH), decode, tokens, inputs, int(prev_ids), 0, 0, journal]


def with_journal(head: list[int], journal: torch.Tensor) -> list[int]:
    head[JOURNAL] = journal.shape[1]
    return head


def pack(batch: ForwardBatch) -> torch.Tensor:
    """The batch's inputs in one host int64 tensor (the order :func:`unpack` reads)."""
    parts = (batch.input_ids, batch.positions, batch.out_slots, batch.slot_table.reshape(-1), batch.ctx_lens,
             batch.q_lens, batch.q_start_loc, batch.logits_indices)
    return torch.cat([p.to(device="cpu", dtype=torch.int64) for p in parts])


def split_journal(head: Sequence[int], payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's inputs, the journal ``[3, n]``) of a payload."""
    n = int(head[JOURNAL])
    cut = payload.numel() - 3 * n
    return payload[:cut], payload[cut:].view(3, n)


def graph_settings(batch_sizes: list[int], prefill_tokens: list[int], max_prefills: int, pad_slot: int,
                   draws: bool, table_shape: tuple[int, int]) -> torch.Tensor:
    """What every rank's CUDA graphs must share with rank 0's, in one int64 tensor."""
    return torch.tensor([pad_slot, max_prefills, int(draws), *table_shape, len(batch_sizes), len(prefill_tokens),
                         *batch_sizes, *prefill_tokens], dtype=torch.int64)


def read_graph_settings(values: list[int]) -> tuple[list[int], list[int], int, int, bool, tuple[int, int]]:
    """:func:`graph_settings` back: (batch sizes, prefill tokens, max prefills, pad slot, draws, table shape)."""
    pad_slot, max_prefills, draws, rows, width, n_batch, n_prefill = values[:7]
    sizes = values[7:]
    return sizes[:n_batch], sizes[n_batch:n_batch + n_prefill], max_prefills, pad_slot, bool(draws), (rows, width)


def unpack(head: Sequence[int], payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    t, b, max_ctx, k, is_decode, num_decode = (int(x) for x in head[1:7])
    sizes = (t, t, t, b * max_ctx, b, b, b, k)
    ids, positions, slots, table, ctx_lens, q_lens, q_start, logits = payload.to(device).split(sizes)
    return ForwardBatch(input_ids=ids, positions=positions, out_slots=slots, slot_table=table.view(b, max_ctx),
                        ctx_lens=ctx_lens, q_lens=q_lens, q_start_loc=q_start, logits_indices=logits,
                        is_decode=bool(is_decode), num_decode=num_decode)
