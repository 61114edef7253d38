"""Turns a batch of next-token logits into tokens, one request's sampling settings per row.

Everything runs as batched tensor ops on the logits' device; the host only packs each row's
settings into two small tensors and reads back one tensor per step (the ids, plus logprobs when a
row asks for them).

Order of operations (vLLM's): logprobs from the raw logits; then logit_bias; then repetition,
frequency and presence penalties (from token counts kept on the device,
:mod:`pd_cluster.engine.penalties`); then greedy rows take the argmax, and the other rows are
scaled by their temperature, cut by top-k, top-p and min-p, and drawn by inverse transform: one
uniform ``u`` per row picks the first token whose cumulative probability exceeds ``u`` (in
vocabulary order, so a row's token does not depend on the rest of the batch). The cuts and the
draw are one kernel (:mod:`kernels.sampling`): thresholds found without sorting the vocabulary.

The uniform is counter-based (:mod:`pd_cluster.engine.random_stream`): a hash of (the request's
seed, the output position), so CPU and CUDA give the same bits. A seeded request therefore draws
the same stream on a prefill node, a decode node and after a retry, with no generator state to
ship: a node only needs the seed and how many tokens came before.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kernels._triton import use_triton
from kernels.argmax import argmax_rows, choose_ids
from kernels.penalties import apply_penalties as penalize
from kernels.sampling import filtered_weights_ref, sample_filtered_ref, sample_filtered_triton
from pd_cluster.engine.penalties import PenaltyBook
from pd_cluster.engine.device_copy import PinnedRing, tensor_on, to_device
from pd_cluster.engine.mapped_ids import MappedIds
from pd_cluster.engine.random_stream import random_bits, stream_key, uniform
from pd_cluster.protocol import TokenLogprob
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Temperatures below this are treated as greedy (dividing by them would overflow).
_MIN_TEMPERATURE = 1e-5

# ---- per-request state --------------------------------------------------------------------


@dataclass
class SamplingState:
    """One request's sampling settings, its random stream's seed and the tokens penalties see."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    key: tuple[int, int] = field(init=False)
    # Built once: prompts and biases do not change.
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    #: The state's row in a :class:`PenaltyBook` (only with penalties), and how many output tokens it counts.
    penalty_book: PenaltyBook | None = field(default=None, init=False, repr=False, compare=False)
    penalty_row: int | None = field(default=None, init=False, repr=False, compare=False)
    penalty_len: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = stream_key(self.seed)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: list[int]) -> "SamplingState":
        """A state on ``params.seed``'s stream, or on a fresh random seed when it is None
        (the master picks one for every request, so only offline use lands here)."""
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(params=params, seed=seed, prompt_token_ids=list(prompt_token_ids))

    @property
    def position(self) -> int:
        """Output position of the next token: where it reads the seed's stream."""
        return self.params.output_offset + len(self.output_token_ids)

    def counted_output(self) -> list[int]:
        """The tokens frequency and presence penalties count: earlier output carried in the
        prompt (``output_offset``), then this node's output."""
        offset = self.params.output_offset
        carried = self.prompt_token_ids[len(self.prompt_token_ids) - offset :] if offset else []
        return carried + self.output_token_ids

    def prompt_ids_tensor(self) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(set(self.prompt_token_ids)), dtype=torch.int64)
        return self._prompt_ids

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, values) of ``params.logit_bias`` (CPU)."""
        if self._bias is None:
            bias = self.params.logit_bias or {}
            self._bias = (torch.tensor(list(bias), dtype=torch.int64),
                          torch.tensor(list(bias.values()), dtype=torch.float32))
        return self._bias


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _MIN_TEMPERATURE


# ---- the batch -----------------------------------------------------------------------------

# Columns of the per-row float settings.
_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES = range(6)
# Columns of the per-row integer settings.
_K0, _K1, _POS, _TOP_K, _GREEDY = range(5)
_NUM_FLOATS, _NUM_INTS = 6, 5


@dataclass
class _Batch:
    """What ``sample`` needs to know about the rows, gathered in one pass over the states."""

    floats: torch.Tensor | None  # [B, 6] on the device (None: every row plain greedy)
    ints: torch.Tensor | None  # [B, 5] on the device
    any_random: bool
    any_greedy: bool
    bias_rows: list[int]
    use_rep: bool
    use_counts: bool
    logprob_rows: list[int]
    max_logprobs: int


#: What a batch's rows ask of the sampling, gathered on the host (their settings on the device).
BatchSettings = _Batch

#: The rows of a batch whose every row takes the plain argmax (no settings to copy to the device).
_PLAIN_GREEDY = _Batch(floats=None, ints=None, any_random=False, any_greedy=True,
                       bias_rows=[], use_rep=False, use_counts=False, logprob_rows=[], max_logprobs=0)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes or reads the logits: the argmax of the raw logits."""
    return is_greedy(params) and params.logprobs is None and _drawable(params)


def _gather(states: Sequence[SamplingState], vocab: int, device: torch.device,
            into: DrawInputs | None = None) -> _Batch:
    """The rows' settings on ``device``: new tensors, or the first rows of ``into``'s static
    buffers (what a captured draw reads)."""
    floats: list[tuple[float, ...]] = []
    ints: list[tuple[int, ...]] = []
    bias_rows, logprob_rows = [], []
    any_random = any_greedy = use_rep = use_counts = False
    max_logprobs = 0
    for i, s in enumerate(states):
        p = s.params
        greedy = is_greedy(p)
        top_k = p.top_k if 0 < p.top_k < vocab and not greedy else vocab
        top_p = p.top_p if not greedy else 1.0
        min_p = p.min_p if not greedy else 0.0
        floats.append((1.0 if greedy else p.temperature, top_p, min_p,
                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        ints.append((s.key[0], s.key[1], s.position, top_k, int(greedy)))
        any_random |= not greedy
        any_greedy |= greedy
        use_rep |= p.repetition_penalty != 1.0
        use_counts |= p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        if p.logit_bias:
            bias_rows.append(i)
        if p.logprobs is not None:
            logprob_rows.append(i)
            max_logprobs = max(max_logprobs, p.logprobs)
    if into is not None:
        float_rows, int_rows = into.write(floats, ints)
    else:
        float_rows, int_rows = tensor_on(floats, torch.float32, device), tensor_on(ints, torch.int64, device)
    return _Batch(
        floats=float_rows,
        ints=int_rows,
        any_random=any_random, any_greedy=any_greedy, bias_rows=bias_rows,
        use_rep=use_rep, use_counts=use_counts, logprob_rows=logprob_rows, max_logprobs=max_logprobs,
    )


@dataclass
class DeviceSample:
    """A batch's sampled ids (and logprobs) still on the device: :func:`fetch` copies them once.

    On a GPU the copy to pinned host memory is queued as soon as the sampling is (``host``,
    ``ready``): the stream runs it right after the sampling kernels, so a pipelined engine that
    queues the next forward before it reads these tokens back waits for this step's sampling
    only, not for the forward queued behind it. A greedy step whose graph stored its ids into
    pinned host memory itself needs no copy: ``host`` is that row (``mapped``, given back once
    read)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    rows: _Batch
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    mapped: MappedIds | None = None
    #: The host copy as a list, once read (``host`` and ``ready`` then serve another batch).
    flat: list | None = None


def sample(logits: torch.Tensor, states: Sequence[SamplingState],
           penalties: PenaltyBook | None = None) -> list[SampledToken]:
    """Pick one token per row of ``logits`` ``[B, V]`` (any float dtype, any device).

    Does not append the tokens to the states; the caller does once it accepts them. An engine
    passes its :class:`PenaltyBook` (and appends every token it samples); without one, the
    penalties' counts are built from the states' lists for this call only.
    """
    if logits.dim() == 2 and logits.shape[0] == 0 and not states:
        return []
    return fetch(sample_on_device(logits, states, penalties), states)


def fetch(result: DeviceSample, states: Sequence[SamplingState]) -> list[SampledToken]:
    """The host's copy of :func:`sample_on_device`'s result (waits for the device to reach the
    end of that sampling, not for what was queued after it)."""
    if result.flat is None:
        if result.mapped is not None:  # the ids the step's graph stored in a pinned row
            if result.mapped.ready is not None:
                result.mapped.ready.synchronize()
            result.flat = result.mapped.host.tolist()
            result.mapped.release()
            result.host = result.ready = result.mapped = None
        elif result.ready is not None:  # a pinned copy on a GPU: its buffer serves another batch after
            result.ready.synchronize()
            result.flat = result.host.tolist()
            _HOST_COPIES.give_back(result.host, result.ready)
            result.host = result.ready = None
        else:
            host = result.host if result.host is not None else _pack(result.tokens, result.logprobs, result.rows)
            result.flat = host.tolist()
    return _unpack(result.flat, result.tokens.shape[0], result.rows, states)


def sample_on_device(logits: torch.Tensor, states: Sequence[SamplingState],
                     penalties: PenaltyBook | None = None, argmax: torch.Tensor | None = None,
                     drawn: GraphDrawn | None = None, mapped: MappedIds | None = None) -> DeviceSample:
    """:func:`sample` up to the host copy: on a GPU this returns before the kernels ran, so the
    host can do other work (the previous step's detokenization) before :func:`fetch`.
    ``argmax``: each row's argmax of ``logits``, already taken (in the step's CUDA graph).
    ``drawn``: the ids the step's graph drew itself (see :func:`write_graph_draw`): nothing is
    launched but the logprobs asked for. ``mapped``: the argmax in pinned host memory, written by
    the graph: a greedy batch that takes the argmax as it is reads it there (no copy); otherwise
    dropping it gives its row back."""
    if logits.dim() != 2 or logits.shape[0] != len(states) or not states:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(states)} states")
    batch, vocab = logits.shape
    device = logits.device
    if all(_plain_greedy(s.params) for s in states):
        # Most decode batches: one argmax, no settings to pack, no copy of the logits.
        if argmax is not None and argmax.shape[0] == batch:
            if mapped is not None and mapped.host.shape[0] == batch:
                return _mapped_result(argmax, mapped)
            tokens = argmax
        else:
            tokens = argmax_rows(logits)
        return _queue_host_copy(DeviceSample(tokens, None, _PLAIN_GREEDY))
    if drawn is not None:
        if drawn.tokens.shape[0] != batch:
            raise ValueError(f"{drawn.tokens.shape[0]} ids drawn in the graph for {batch} rows")
        if mapped is not None:  # the argmax's row: the drawn ids are read
            mapped.release()
        logprobs = _logprobs(logits, drawn.rows)
        if logprobs is None and drawn.mapped is not None:
            return _mapped_result(drawn.tokens, drawn.mapped, drawn.rows)
        if drawn.mapped is not None:  # the logprobs go in the same copy: the row is not read
            drawn.mapped.release()
        return _queue_host_copy(DeviceSample(drawn.tokens, logprobs, drawn.rows))
    rows = _gather(states, vocab, device)
    logprobs = _logprobs(logits, rows)
    # Logit bias and penalties change the logits in place: then on a copy, else read as they are
    # (and the argmax already taken still holds).
    changed = bool(rows.bias_rows) or rows.use_rep or rows.use_counts
    x = logits.to(torch.float32, copy=changed)
    if changed or argmax is None or argmax.shape[0] != batch:
        argmax = None

    book = penalties if penalties is not None else PenaltyBook(vocab, device)
    apply_logit_bias(x, states, rows.bias_rows)
    apply_penalties(x, states, rows, book)

    if not rows.any_random:
        tokens = argmax if argmax is not None else x.argmax(dim=-1)
    elif rows.any_greedy:
        assert rows.ints is not None
        greedy_ids = argmax if argmax is not None else x.argmax(dim=-1)
        tokens = torch.where(rows.ints[:, _GREEDY].bool(), greedy_ids, _sample_random(x, rows))
    else:
        tokens = _sample_random(x, rows)
    if rows.use_rep or rows.use_counts:
        book.record(states, tokens)
    return _queue_host_copy(DeviceSample(tokens, logprobs, rows))


class HostCopies:
    """Pinned buffers and events for sampled batches' copies to the host, reused once a batch is
    read: allocating pinned memory and an event cost a step's host more than the copy."""

    #: Buffers kept per (device, size, dtype); more in use at once are allocated and dropped.
    KEEP = 8

    def __init__(self) -> None:
        self._free: dict[tuple[int, int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer shaped as ``like`` (a device tensor) and an event of its device."""
        try:
            return self._free[(like.device.index or 0, like.numel(), like.dtype)].pop()
        except (KeyError, IndexError):  # none kept (or another engine's thread took the last one)
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True), torch.cuda.Event()

    def give_back(self, host: torch.Tensor, event: torch.cuda.Event) -> None:
        """``host`` read and ``event`` waited on: both free for a later batch (of the event's device)."""
        free = self._free.setdefault((event.device.index or 0, host.numel(), host.dtype), [])
        if len(free) < self.KEEP:
            free.append((host, event))


_HOST_COPIES = HostCopies()


def _logprobs(logits: torch.Tensor, rows: _Batch) -> torch.Tensor | None:
    """The log-softmax of the rows asking for logprobs, of the raw logits (before bias and
    penalties); None when none asks."""
    if not rows.logprob_rows:
        return None
    index = tensor_on(rows.logprob_rows, torch.int64, logits.device)
    return torch.log_softmax(logits.index_select(0, index).float(), dim=-1)


def _mapped_result(ids: torch.Tensor, mapped: MappedIds, rows: _Batch = _PLAIN_GREEDY) -> DeviceSample:
    """A batch whose ids the step's graph also stored in a pinned row: ready once the stream
    reaches the end of that graph (the event recorded here, behind it)."""
    if mapped.ready is not None:
        mapped.ready.record(torch.cuda.current_stream(ids.device))
    return DeviceSample(ids, None, rows, host=mapped.host, ready=mapped.ready, mapped=mapped)


def _queue_host_copy(result: DeviceSample) -> DeviceSample:
    """Queue the copy of the result to the host right behind the sampling (on a GPU, to pinned
    memory, with an event to wait on). Elsewhere the copy is made at once: the ids may live in a
    buffer the next step overwrites (a captured step's argmax)."""
    packed = _pack(result.tokens, result.logprobs, result.rows)
    if packed.device.type != "cuda":
        result.host = packed.clone() if packed is result.tokens else packed
        return result
    result.host, result.ready = _HOST_COPIES.take(packed)
    result.host.copy_(packed, non_blocking=True)
    # The stream of the tokens' device, named: the bare call resolves the current device the slow
    # way, a cost of every step.
    result.ready.record(torch.cuda.current_stream(packed.device))
    return result


def apply_logit_bias(x: torch.Tensor, states: Sequence[SamplingState], bias_rows: list[int]) -> None:
    """Add each row's logit_bias to its logits, in place (one scatter for the batch)."""
    if not bias_rows:
        return
    vocab = x.shape[1]
    ids, values = zip(*(states[i].bias_tensors() for i in bias_rows))
    flat = to_device(torch.cat([i * vocab + t for i, t in zip(bias_rows, ids)]), x.device)
    x.view(-1).index_add_(0, flat, to_device(torch.cat(values), x.device))


def apply_penalties(x: torch.Tensor, states: Sequence[SamplingState], rows: _Batch, book: PenaltyBook) -> None:
    """Repetition (HF-style, over prompt + output) and frequency/presence (OpenAI-style, over the
    output), in place, from the rows of ``book`` (rows without penalties read its empty row and
    have neutral settings: their logits come out unchanged)."""
    if not (rows.use_rep or rows.use_counts):
        return
    index = tensor_on(book.rows(states), torch.int64, x.device)
    assert book.counts is not None and book.seen is not None
    f = rows.floats
    penalize(x, index, book.counts, book.seen, f[:, _REP], f[:, _FREQ], f[:, _PRES], rows.use_rep, rows.use_counts)


def _drawable(params: SamplingParams) -> bool:
    """Nothing changes this row's logits before its draw (what a captured draw assumes)."""
    return (not params.logit_bias and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0)


class DrawInputs:
    """Static device buffers of a batch's sampling settings (the columns :func:`_gather` packs),
    read by the draws captured in decode CUDA graphs: a step writes its rows' settings here (one
    host copy, queued before its replay) and replays the graph that draws."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        # Both tables in one device buffer (floats, then ints: 8-byte aligned, as 24 bytes a row
        # keeps it), so a step's settings are one copy from one pinned staging buffer.
        self._float_bytes = max_rows * _NUM_FLOATS * 4
        size = self._float_bytes + max_rows * _NUM_INTS * 8
        self._packed = torch.zeros(size, dtype=torch.uint8, device=device)
        self.floats = self._packed[: self._float_bytes].view(torch.float32).view(max_rows, _NUM_FLOATS)
        self.ints = self._packed[self._float_bytes :].view(torch.int64).view(max_rows, _NUM_INTS)
        self._max_rows = max_rows
        self._staging = PinnedRing(size, torch.uint8, device)

    @property
    def max_rows(self) -> int:
        return self._max_rows

    def write(self, floats: list[tuple[float, ...]], ints: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the rows' settings into the first rows of the buffers (queued); those rows."""
        n = len(floats)
        array = self._staging.stage()
        array[: self._float_bytes].view(np.float32).reshape(self._max_rows, _NUM_FLOATS)[:n] = floats
        array[self._float_bytes :].view(np.int64).reshape(self._max_rows, _NUM_INTS)[:n] = ints
        self._staging.copy(self._packed, self._float_bytes + n * _NUM_INTS * 8)
        return self.floats[:n], self.ints[:n]

    def draw(self, logits: torch.Tensor, argmax: torch.Tensor, out: torch.Tensor,
             host_out: torch.Tensor | None = None, host_row: torch.Tensor | None = None) -> torch.Tensor:
        """What a captured draw computes for the first ``len(logits)`` rows: greedy rows take
        ``argmax``, the others the inverse-transform draw (every cut's code compiled in: a row
        without a cut skips it). The ids go to ``out`` (it may be ``argmax`` itself) and, with
        ``host_out``, to its row ``host_row`` as :func:`kernels.argmax.argmax_rows` stores them."""
        n = logits.shape[0]
        rows = _Batch(floats=self.floats[:n], ints=self.ints[:n], any_random=True, any_greedy=True, bias_rows=[], use_rep=False, use_counts=False, logprob_rows=[],
                      max_logprobs=0)
        return choose_ids(self.ints[:n, _GREEDY], argmax, _sample_random(logits, rows), out, host_out, host_row)


@dataclass(frozen=True)
class GraphDrawn:
    """A decode step whose CUDA graph drew its rows' ids itself: the rows' settings (as
    :func:`write_graph_draw` wrote them), the ids on the device (valid until the next replay)
    and, where the graph stored them there, in a held pinned host row (``mapped``)."""

    rows: _Batch
    tokens: torch.Tensor
    mapped: MappedIds | None = None


def graph_can_draw(states: Sequence[SamplingState]) -> bool:
    """Whether a decode step's graph may draw these rows itself: nothing changes their logits
    before the draw (no logit bias or penalty; grammars are the caller's to rule out), and not
    every row takes the plain argmax (the graph without the draw serves those)."""
    return all(_drawable(s.params) for s in states) and not all(_plain_greedy(s.params) for s in states)


def write_graph_draw(states: Sequence[SamplingState], vocab: int, inputs: DrawInputs) -> _Batch:
    """Queue the copy of the rows' settings into ``inputs`` (before the replay of the graph that
    draws them); what :class:`GraphDrawn` keeps of them."""
    if len(states) > inputs.max_rows:
        raise ValueError(f"{len(states)} rows to draw, the draw buffers hold {inputs.max_rows}")
    return _gather(states, vocab, inputs.floats.device, inputs)


def _sample_random(x: torch.Tensor, rows: _Batch) -> torch.Tensor:
    """The inverse-transform draw from each row's filtered distribution (greedy rows run with
    neutral settings and are replaced by the caller). A row whose logits overflowed (inf or NaN:
    no distribution to draw from) takes its most likely token rather than an id past the
    vocabulary, which would fault the next step."""
    f, i = rows.floats, rows.ints
    settings = (x, f[:, _TEMP], i[:, _TOP_K], f[:, _TOP_P], f[:, _MIN_P])
    if use_triton(x):
        # The kernels hash each row's uniform from its stream keys themselves. Every cut's code is
        # compiled in (a row without a cut skips it), as in a captured draw: one build of the
        # kernels, compiled by the engine's warm-up, serves every request's settings.
        return sample_filtered_triton(*settings, keys=(i[:, _K0], i[:, _K1], i[:, _POS]))
    return sample_filtered_ref(*settings, uniform(random_bits(i[:, _K0], i[:, _K1], i[:, _POS])))


def processed_logits(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The logits after logit_bias and penalties: what a greedy row takes the argmax of."""
    rows = _gather(states, logits.shape[1], logits.device)
    x = logits.to(torch.float32, copy=True)
    apply_logit_bias(x, states, rows.bias_rows)
    apply_penalties(x, states, rows, PenaltyBook(logits.shape[1], logits.device))
    return x


def target_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The distribution each non-greedy row of :func:`sample` draws its token from."""
    rows = _gather(states, logits.shape[1], logits.device)
    f, i = rows.floats, rows.ints
    kept = filtered_weights_ref(processed_logits(logits, states), f[:, _TEMP], i[:, _TOP_K], f[:, _TOP_P], f[:, _MIN_P])
    return kept / kept.sum(dim=-1, keepdim=True)


def _pack(tokens: torch.Tensor, logprobs: torch.Tensor | None, rows: _Batch) -> torch.Tensor:
    """What the host needs of a sampled batch, in one device tensor (one copy): the ids, then
    (for logprob rows) the chosen token's logprob and the top-N values and ids (N = the most any
    row asked for)."""
    if logprobs is None:
        return tokens
    index = tensor_on(rows.logprob_rows, torch.int64, tokens.device)
    chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1))
    parts = [tokens.to(torch.float64), chosen.to(torch.float64).flatten()]
    n_top = min(rows.max_logprobs, logprobs.shape[1])
    if n_top > 0:
        top = logprobs.topk(n_top, dim=-1)
        parts += [top.values.to(torch.float64).flatten(), top.indices.to(torch.float64).flatten()]
    return torch.cat(parts)


def _unpack(flat: list, batch: int, rows: _Batch, states: Sequence[SamplingState]) -> list[SampledToken]:
    """:func:`_pack`'s tensor, read back as a list, into one :class:`SampledToken` per row."""
    n_rows = len(rows.logprob_rows)
    n_top = (len(flat) - batch - n_rows) // (2 * n_rows) if n_rows else 0
    token_list = [int(t) for t in flat[:batch]]
    chosen_list = flat[batch : batch + n_rows]
    top_values = flat[batch + n_rows : batch + n_rows + n_rows * n_top]
    top_ids = flat[batch + n_rows + n_rows * n_top :]

    out = [SampledToken(token_id=t) for t in token_list]
    for j, i in enumerate(rows.logprob_rows):
        n = min(states[i].params.logprobs or 0, n_top)
        start = j * n_top
        top_n = {int(t): v for t, v in zip(top_ids[start : start + n], top_values[start : start + n])}
        out[i].logprob = TokenLogprob(token_id=token_list[i], logprob=chosen_list[j], top=top_n)
    return out
