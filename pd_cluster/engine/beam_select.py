"""A beam step's choice of continuations, made where the logits are.

Every search's candidates are the top ``k`` of ``log_softmax(logits) + cumulative logprob`` over
its ``[beams x vocab]`` scores. Taken on the host, that meant reading back the whole vocabulary of
every beam and ranking it there: most of a beam step's time beside its forward. Here the
log-softmax, the sums and the top-``k`` of every search run as batched tensor ops on the logits'
device, and one small read-back brings the ``k`` (score, token, parent) of each search, the
chosen tokens' own logprobs and, where asked, each beam's top alternatives.

The beams that live on (:class:`~pd_cluster.engine.beam_scorer.BeamScorer`'s rule: the best
``keep`` that do not end, in rank order) are picked on the device too, so the next step can run
from them before the host has read anything back: their tokens are its inputs, their parents
say whose KV each row lists, their sums are the next selection's. The read-back is queued
behind the selection into pinned memory and waited for only when the host takes it
(:meth:`DeviceSelection.fetch`). The arithmetic is float32, as transformers' is, so scores and
ties come out the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.device_copy import tensor_on
from pd_cluster.engine.sampler import HostCopies

_HOST_COPIES = HostCopies()


@dataclass(frozen=True)
class SelectionAsk:
    """What one search needs from a step: how many live beams (consecutive rows of the logits),
    how many continuations to rank, how many alternatives per beam (0: none), how many
    continuations live on as the next step's beams (0: none, the search's last step) and the ids
    that end a beam (on the logits' device; None: none)."""

    rows: int
    k: int
    top_logprobs: int = 0
    keep: int = 0
    stop_ids: torch.Tensor | None = None


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
    #: The continuations (indices into the lists above) the device kept as the next beams.
    kept: list[int]


@dataclass
class KeptBeams:
    """One search's next beams, on the device: their tokens, their parents (rows of the search's
    part of the step) and their cumulative logprobs (float32)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    cum_logprobs: torch.Tensor


@dataclass
class DeviceSelection:
    """A step's selection: the kept beams of each search that asked (None for the others) and the
    packed candidates on their way to the host."""

    asks: list[SelectionAsk]
    kept: list[KeptBeams | None]
    sizes: list[int]
    vocab: int
    packed: torch.Tensor
    ready: torch.cuda.Event | None = None
    _read: list[Candidates] | None = None

    def fetch(self) -> list[Candidates]:
        """Each search's candidates (waits for the device to reach the end of this selection only)."""
        if self._read is None:
            if self.ready is not None:
                self.ready.synchronize()
            flat = self.packed.tolist()
            if self.ready is not None:
                _HOST_COPIES.give_back(self.packed, self.ready)
            self._read = _unpack(flat, self.asks, self.sizes, self.vocab)
        return self._read


def select(logits: torch.Tensor, asks: list[SelectionAsk], cum_logprobs: list[float]) -> list[Candidates]:
    """The candidates of each search whose beams are ``logits``' rows, consecutive in ``asks``'
    order, with the beams' cumulative logprobs (``logits`` ``[sum of rows, vocab]``, any device)."""
    cums = tensor_on(cum_logprobs, torch.float32, logits.device)
    return select_on_device(logits, cums, asks).fetch()


def select_on_device(logits: torch.Tensor, cum_logprobs: torch.Tensor, asks: list[SelectionAsk]) -> DeviceSelection:
    """:func:`select` with the sums on the device (float32, one a row), up to the host copy:
    on a GPU this returns before the kernels ran."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    vocab = log_probs.shape[1]
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    kept: list[KeptBeams | None] = []
    start = 0
    for ask in asks:
        rows = log_probs[start : start + ask.rows]
        total = (rows + cum_logprobs[start : start + ask.rows, None]).reshape(-1)
        start += ask.rows
        values, indices = torch.topk(total, min(ask.k, total.numel()))
        own = rows.reshape(-1).index_select(0, indices)
        parts += [values, indices, own]
        if ask.top_logprobs:
            top_values, top_ids = torch.topk(rows, ask.top_logprobs, dim=-1)
            parts += [top_values.reshape(-1), top_ids.reshape(-1)]
        sizes.append(values.numel())
        kept.append(_keep(values, indices, ask, vocab, parts) if ask.keep else None)
    # float64 holds every float32 and every index below 2**53 exactly: one tensor, one copy.
    packed = torch.cat([p.to(torch.float64) for p in parts])
    selection = DeviceSelection(asks, kept, sizes, vocab, packed)
    if packed.device.type == "cuda":
        host, selection.ready = _HOST_COPIES.take(packed)
        host.copy_(packed, non_blocking=True)
        selection.ready.record(torch.cuda.current_stream(packed.device))
        selection.packed = host
    return selection


def _keep(values: torch.Tensor, indices: torch.Tensor, ask: SelectionAsk, vocab: int,
          parts: list[torch.Tensor]) -> KeptBeams:
    """The best ``ask.keep`` continuations that do not end, in rank order (those that end after
    them where too few do not: the scorer's rule); with stop ids, their ranks join ``parts``."""
    keep = min(ask.keep, indices.numel())
    if ask.stop_ids is None:
        chosen, sums = indices[:keep], values[:keep]
    else:
        # A compare against each of the few stop ids (torch.isin may pick a path that syncs).
        ends = ((indices % vocab)[:, None] == ask.stop_ids[None, :]).any(dim=1).to(torch.int32)
        order = torch.sort(ends, stable=True).indices[:keep]
        chosen, sums = indices.index_select(0, order), values.index_select(0, order)
        parts.append(order)
    return KeptBeams(chosen % vocab, chosen // vocab, sums)


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
        keep = min(ask.keep, k)
        kept = list(range(keep))
        if keep and ask.stop_ids is not None:
            kept = [int(i) for i in packed[at : at + keep]]
            at += keep
        flat = [int(i) for i in indices]
        out.append(Candidates(values, [i // vocab for i in flat], [i % vocab for i in flat], own, top, kept))
    return out
