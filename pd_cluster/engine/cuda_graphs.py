"""CUDA graphs for engine steps: decode batches, alone or with short prefill chunks mixed in.

A step launches the same few hundred small kernels every time; run eagerly, launching them
costs more than running them (an 8B-shape step with a 128-token chunk in it: about 25 ms of host
time for 10 ms of kernels). :class:`StepGraphs` captures ``LlamaModel.forward`` once per shape over
static input buffers and replays the smallest shape that holds a step:

- ``GraphShape(decode=B)``: a pure-decode batch of up to B rows;
- ``GraphShape(decode=B, tokens=T)``: up to B decode rows plus up to ``max_prefills`` prefill
  chunks of T tokens in all (``B`` may be 0): a decode node prefilling a short miss locally, a
  mixed node admitting a short prompt, a later chunk of a chunked prompt.

A graph's first kernel makes its inputs ready on the device: ids the last step sampled (still on
the device, read from the buffer the last graph's argmax or draw wrote), the new tokens' slots
into the request table, then the embeddings; so a replay is one copy of host inputs and one
launch.

Padding rows and tokens write their KV to a slot reserved for them (no request owns it); padding
decode rows read one token of context; padding prefill sequences have no tokens; their logits
are dropped. The slot table is as wide as the request table (the model's context length), so one
capture serves every context length. Mixed graphs keep their logits in the model's dtype; the
rows a step samples are converted to float32 after the replay. Pure-decode graphs also take each
row's argmax, so a greedy batch's sampling is part of the replay (see :attr:`StepGraphs.last_argmax`),
and store those ids into a pinned host row as well (:attr:`StepGraphs.last_mapped`), so they reach the
host with the replay rather than by a copy queued behind it.
With draws asked for, each pure-decode shape is also captured with the sampling draw after its
argmax (:attr:`StepGraphs.last_drawn`): a sampled batch with nothing that changes its logits
first copies its rows' settings to static buffers, then replays that graph, which ends by storing
each row's id (its draw, or its argmax for a greedy row) where the next step reads it and into the
pinned host row. A sampled step is then one replay, as a greedy one is, with no kernel launched
from the host and no copy behind it.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from pd_cluster.engine.device_copy import PinnedRing, tensor_on
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.mapped_ids import MappedIdRing, MappedIds
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.sampler import BatchSettings, DrawInputs, GraphDrawn, graph_can_draw, write_graph_draw
from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.engine.step_layout import StepLayout
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LlamaModel

logger = logging.getLogger(__name__)

# Rows of the static per-token inputs (ids, positions, KV slots, request-table rows) and of the
# per-sequence inputs (context length, new tokens, first token, logits row, request-table row).
_IDS, _POS, _SLOTS, _TROW = range(4)
_CTX, _QLEN, _QSTART, _LOGIT, _SROW = range(5)

#: Least decode size of a mixed graph above none (smaller batches pad to it).
MIXED_MIN_DECODE = 8


@dataclass(frozen=True, order=True)
class GraphShape:
    """A captured step: ``decode`` one-token rows, then ``tokens`` prefill tokens (0: none)."""

    decode: int
    tokens: int = 0


#: Told a step's graph inputs just before its replay: (its shape, the packed inputs on the host as
#: the static buffer takes them, valid only during the call, whether the graph reads ids left on
#: the device by the last step).
BeforeReplay = Callable[["GraphShape", np.ndarray, bool], None]


def _bucket(sizes: list[int], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StepGraphs:
    """Captured step forwards on one CUDA device."""

    def __init__(
        self, model: LlamaModel, pool: KVPool, table: ReqSlotTable, batch_sizes: Sequence[int], pad_slot: int,
        prefill_tokens: Sequence[int] = (), max_prefills: int = 0, draws: bool = False,
    ) -> None:
        """``batch_sizes`` empty: prefill-only graphs (no decode rows), such as a second set with
        buffers of its own for steps on a second stream. ``draws``: also capture each pure-decode
        shape with its sampling draw (see :class:`DrawInputs`)."""
        self.model = model
        self.pool = pool
        self.table = table
        self.device = pool.device
        self.batch_sizes = sorted(set(batch_sizes))
        self.prefill_sizes = sorted(set(prefill_tokens)) if max_prefills > 0 else []
        self.max_prefills = max_prefills if self.prefill_sizes else 0
        self.max_batch = self.batch_sizes[-1] if self.batch_sizes else 0
        self.pad_slot = pad_slot
        dev = self.device
        max_tokens = self.max_batch + (self.prefill_sizes[-1] if self.prefill_sizes else 0)
        max_seqs = self.max_batch + self.max_prefills
        # Every shape's inputs, packed: its 4 token rows, its 5 sequence rows, then the row of
        # ``mapped_ids`` its argmax writes to; read by its graph as views of the front of one buffer,
        # so a step's inputs are one host-to-device copy.
        self._inputs = torch.zeros(4 * max_tokens + 5 * max_seqs + 1, dtype=torch.int64, device=dev)
        # The last step's sampled ids where a step's graph reads those still on the device (an id
        # ``-r - 1`` in the inputs is row ``r`` here): pure-decode graphs write their argmax here, so
        # a greedy step's ids are read in place; others' are copied in before the replay.
        self._prev_tokens = torch.zeros(max(max_seqs, table.table.shape[0]), dtype=torch.int64, device=dev)
        self._staging = PinnedRing(self._inputs.numel(), torch.int64, self.device)
        #: Pinned host rows the pure-decode graphs' argmax also writes its ids to (None: no such graphs).
        self.mapped_ids = MappedIdRing(self.max_batch, dev) if self.batch_sizes else None
        # A mixed step's padded decode rows cost a GEMM row and one token of attention each, little
        # beside its prefill tokens: coarse decode sizes keep the graph count (and capture time) down.
        self.mixed_decode_sizes = [0] + [b for b in self.batch_sizes if b >= MIXED_MIN_DECODE or b == self.max_batch]
        if not self.batch_sizes and not self.prefill_sizes:
            raise ValueError("no shapes to capture: neither decode batch sizes nor prefill sizes")
        self.shapes = [GraphShape(b) for b in self.batch_sizes] + [
            GraphShape(b, t) for b in self.mixed_decode_sizes for t in self.prefill_sizes
        ]
        self._arange = list(range(max_seqs))
        self._graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphShape, torch.Tensor] = {}
        self._argmax: dict[GraphShape, torch.Tensor] = {}
        #: (shape, rows) -> views of the first rows of its logits and argmax (:meth:`_decode_rows`).
        self._row_views: dict[tuple[GraphShape, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        #: Each sampling row's argmax from the last :meth:`replay`, computed in its graph (a view
        #: valid until the next replay), or None: that step's graph took none (a mixed step, or
        #: rows that do not sample).
        self.last_argmax: torch.Tensor | None = None
        #: The same ids in a held pinned host row, written by that graph (None: the spare row was
        #: written, every other one being held, or the step took no argmax).
        self.last_mapped: MappedIds | None = None
        self.draws = draws and bool(self.batch_sizes)
        #: The draws' settings buffers (None: no draws).
        self.draw_inputs: DrawInputs | None = DrawInputs(self.max_batch, dev) if self.draws else None
        #: Each pure-decode shape captured with its draw: (graph, logits, every row's id).
        self._drawn_graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        #: The ids the last :meth:`replay`'s graph drew (a sampled pure-decode step), or None.
        self.last_drawn: GraphDrawn | None = None

    # ---- shapes --------------------------------------------------------------------------------

    def _num_seqs(self, shape: GraphShape) -> int:
        return shape.decode + (self.max_prefills if shape.tokens else 0)

    def _token_rows(self, shape: GraphShape) -> torch.Tensor:
        """``shape``'s per-token inputs ``[4, tokens]`` (ids, positions, KV slots, table rows)."""
        n_tok = shape.decode + shape.tokens
        return self._inputs[: 4 * n_tok].view(4, n_tok)

    def _seq_rows(self, shape: GraphShape) -> torch.Tensor:
        """``shape``'s per-sequence inputs ``[5, sequences]`` (see ``_CTX`` ... ``_SROW``)."""
        n_tok, n_seq = shape.decode + shape.tokens, self._num_seqs(shape)
        return self._inputs[4 * n_tok : 4 * n_tok + 5 * n_seq].view(5, n_seq)

    def _host_row(self, shape: GraphShape) -> torch.Tensor:
        """``shape``'s row of :attr:`mapped_ids` for its ids (one int64, after its sequence rows)."""
        at = 4 * (shape.decode + shape.tokens) + 5 * self._num_seqs(shape)
        return self._inputs[at : at + 1]

    def _batch(self, shape: GraphShape) -> ForwardBatch:
        tokens = self._token_rows(shape)
        seqs = self._seq_rows(shape)
        return ForwardBatch(
            input_ids=tokens[_IDS],
            positions=tokens[_POS],
            out_slots=tokens[_SLOTS],
            slot_table=self.table.table,  # read in place, through each sequence's request-table row
            ctx_lens=seqs[_CTX],
            q_lens=seqs[_QLEN],
            q_start_loc=seqs[_QSTART],
            logits_indices=seqs[_LOGIT],
            is_decode=shape.tokens == 0,
            num_decode=shape.decode,
            table_rows=seqs[_SROW],
        )

    def graph_size(self, batch: int) -> int | None:
        """The captured decode size a batch of ``batch`` rows pads to (None: larger than any)."""
        return _bucket(self.batch_sizes, batch)

    def shape_for(self, layout: StepLayout) -> GraphShape | None:
        """The smallest captured shape that holds a step (None: it runs eagerly)."""
        if not layout.prefill:
            decode = self.graph_size(layout.num_decode)
            return GraphShape(decode) if decode else None
        if len(layout.prefill) > self.max_prefills:
            return None
        decode = _bucket(self.mixed_decode_sizes, layout.num_decode)
        tokens = _bucket(self.prefill_sizes, layout.prefill_tokens)
        return None if decode is None or tokens is None else GraphShape(decode, tokens)

    # ---- capture -------------------------------------------------------------------------------

    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every shape, largest first, in one memory pool."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        # A collection during a capture may free another engine's graphs or pinned buffers, a CUDA
        # call the capture forbids (it fails the capture): collect first, then hold the collector.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if gc_was_on:
                gc.enable()

    def _capture_all(self) -> None:
        started = time.monotonic()
        self._row_views.clear()
        reserved = torch.cuda.memory_reserved(self.device)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        mempool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: (s.decode + s.tokens, s), reverse=True):
            self._write(*self._padding(shape), shape)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self.forward(shape)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=side, capture_error_mode="thread_local"):
                self._logits[shape], argmax = self.forward(shape)
                if argmax is not None:
                    self._argmax[shape] = argmax
            self._graphs[shape] = graph
            if self.draws and argmax is not None:  # the same step with its draw, in the same pool
                self._capture_drawn(shape, side, mempool)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batches %s; decode batches %s with prefill chunks of up to %s tokens, "
            "%d prompts; %d decode batches also with their draw) in %.1fs, %.0f MiB", len(self._graphs),
            self.batch_sizes, self.mixed_decode_sizes, self.prefill_sizes, self.max_prefills,
            len(self._drawn_graphs), time.monotonic() - started,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def _capture_drawn(self, shape: GraphShape, stream: torch.cuda.Stream, mempool: tuple) -> None:
        """``shape``'s step with its draw: greedy batches (most) replay the step alone, sampled
        ones this graph, with no kernel launched from the host either way."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self.forward_and_draw(shape)  # compiles the draw's kernels outside the capture
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode="thread_local"):
            logits, tokens = self.forward_and_draw(shape)
        self._drawn_graphs[shape] = (graph, logits, tokens)

    def forward_and_draw(self, shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:
        """What the drawing graph of a pure-decode ``shape`` runs: its forward and argmax, then the
        draw over the settings in :attr:`draw_inputs`; (its logits, every row's id). The ids go
        where the argmax went (the next step reads them there) and to the pinned host row."""
        assert self.draw_inputs is not None and self.mapped_ids is not None
        logits, argmax = self.forward(shape, store_host=False)
        assert argmax is not None
        tokens = self.draw_inputs.draw(logits, argmax, out=self._prev_tokens[: shape.decode],
                                       host_out=self.mapped_ids.buffer, host_row=self._host_row(shape))
        return logits, tokens

    def run_drawn(self, shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the drawing graph of ``shape`` on the inputs and settings written last; (its
        logits, every row's id)."""
        graph, logits, tokens = self._drawn_graphs[shape]
        graph.replay()
        return logits, tokens

    def _padding(self, shape: GraphShape) -> tuple[list[int], list[int]]:
        """Host inputs of an all-padding step of ``shape``: (tokens, sequences), flattened by row."""
        n_tok, n_seq, d = shape.decode + shape.tokens, self._num_seqs(shape), shape.decode
        tokens = [0] * n_tok + [0] * n_tok + [self.pad_slot] * n_tok + [0] * n_tok
        seqs = ([1] * n_seq                                   # context: one token
                + [1] * d + [0] * (n_seq - d)                 # decode rows add one; prefill ones none
                + list(range(d)) + [d] * (n_seq - d)          # first token
                + list(range(d)) + [0] * (n_seq - d)          # logits row
                + [0] * n_seq)                                # request-table row
        return tokens, seqs

    def forward(self, shape: GraphShape, store_host: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph of ``shape`` runs on the static inputs: (its logits, and for a pure-decode
        shape each row's argmax, written where the next step reads the ids left on the device and,
        with ``store_host``, into the step's pinned host row).

        Its first kernel reads those ids (from the last step's sampled ones), writes the new
        tokens' slots to the request table and embeds the ids."""
        tokens = self._token_rows(shape)
        embedded = kernels.embed_step_inputs(tokens[_IDS], self._prev_tokens, tokens[_POS], tokens[_SLOTS],
                                             tokens[_TROW], self.table.table, self.pad_slot, self.model.weights.embed)
        float_logits = shape.tokens == 0
        logits = self.model.forward(self._batch(shape), self.pool, float_logits=float_logits, embedded=embedded)
        argmax = None
        if float_logits:
            mapped = self.mapped_ids if store_host else None
            argmax = kernels.argmax_rows(logits, out=self._prev_tokens[: shape.decode],
                                         host_out=mapped.buffer if mapped is not None else None,
                                         host_row=self._host_row(shape) if mapped is not None else None)
        return logits, argmax

    def _write(self, tokens: list[int], seqs: list[int], shape: GraphShape,
               host_row: int | None = None) -> np.ndarray:
        """One host-to-device copy of a step's inputs (``shape``'s token rows, then its sequence
        rows, flattened, then ``host_row``: the :attr:`mapped_ids` row for its ids, by default the
        spare) into the front of the static input buffer; the staged words (a view, rewritten a
        few steps later)."""
        array = self._staging.stage()
        n_tok, n_in = len(tokens), len(tokens) + len(seqs)
        array[:n_tok] = tokens
        array[n_tok:n_in] = seqs
        if host_row is None:
            host_row = self.mapped_ids.spare if self.mapped_ids is not None else 0
        array[n_in] = host_row
        self._staging.copy(self._inputs, n_in + 1)
        return array[:n_in + 1]

    # ---- replay --------------------------------------------------------------------------------

    def replay(self, step: ScheduledStep, layout: StepLayout, shape: GraphShape,
               device_tokens: torch.Tensor | None = None, before_replay: BeforeReplay | None = None) -> torch.Tensor:
        """Run ``step`` in the graph of ``shape``; float32 logits ``[K, vocab]`` of the requests that
        sample, in step order (for a pure-decode step in order, a view valid until the next replay).
        ``device_tokens``: the previous step's sampled ids on the device, for inputs still there.
        ``before_replay``: told the inputs first (a tensor-parallel node's other ranks replay the
        same graph on them, :meth:`replay_packed`)."""
        if shape.tokens == 0:
            tokens, seqs, starts = self._decode_inputs(step, shape)
        else:
            tokens, seqs, starts = self._mixed_inputs(step, layout, shape)
        d = shape.decode
        n_tok = shape.decode + shape.tokens
        pending = device_tokens is not None and self._mark_device_ids(step, layout, starts, tokens, n_tok,
                                                                      device_tokens)
        mapped = self.mapped_ids if shape.tokens == 0 else None
        host_row = mapped.take() if mapped is not None else None
        staged = self._write(tokens, seqs, shape, host_row)
        if before_replay is not None:
            before_replay(shape, staged, pending)
        # The graph's first kernel writes the new tokens' slots to the device's request table; the
        # host's mirror of it is kept here (decode part, then prefill part).
        for lo, hi in ((0, layout.num_decode), (d, d + layout.prefill_tokens)):
            if hi > lo:
                self.table.record(tokens[_TROW * n_tok + lo : _TROW * n_tok + hi],
                                  tokens[_POS * n_tok + lo : _POS * n_tok + hi],
                                  tokens[_SLOTS * n_tok + lo : _SLOTS * n_tok + hi])
        drawing = self._drawing_settings(step, shape)
        if drawing is not None:
            logits, drawn_ids = self.run_drawn(shape)
        else:
            logits, drawn_ids = self.run_graph(shape), None
        self.last_argmax = None
        self.last_mapped = None
        self.last_drawn = None
        n = len(step.requests)
        held = None
        if mapped is not None and host_row is not None:
            if all(step.samples) and shape in self._argmax:
                held = mapped.hold(host_row, n)
            else:  # not to be read: a later graph may write it
                mapped.give_back(host_row)
        if shape.tokens == 0 and all(step.samples):  # decode rows only, in step order
            if drawing is not None and drawn_ids is not None:
                self.last_drawn = GraphDrawn(drawing, drawn_ids[:n], held)
                return logits[:n]
            rows = self._decode_rows(shape, n)
            self.last_argmax = rows[1]
            self.last_mapped = held
            return rows[0]
        rows_of = {i: s for s, i in enumerate(layout.decode)}
        rows_of.update({i: d + j for j, i in enumerate(layout.prefill)})
        keep = [rows_of[i] for i, sample in enumerate(step.samples) if sample]
        return logits.index_select(0, tensor_on(keep, torch.int64, self.device)).float()

    def _drawing_settings(self, step: ScheduledStep, shape: GraphShape) -> BatchSettings | None:
        """For a pure-decode step whose graph is to draw its rows (every row samples, none has a
        grammar, logit bias or penalty, not all take the plain argmax): its rows' settings, their
        copy to the draw buffers queued; else None."""
        if self.draw_inputs is None or shape.tokens or shape not in self._drawn_graphs or not all(step.samples):
            return None
        reqs = step.requests
        if any(r.grammar is not None for r in reqs):
            return None
        states = [r.sampling for r in reqs]
        if not graph_can_draw(states):
            return None
        return write_graph_draw(states, self.model.config.vocab_size, self.draw_inputs)

    def _mark_device_ids(self, step: ScheduledStep, layout: StepLayout, starts: list[int], tokens: list[int],
                         n_tok: int, device_tokens: torch.Tensor) -> bool:
        """Mark in ``tokens`` the inputs still on the device (row ``r`` of ``device_tokens`` as
        ``-r - 1``), and put those rows where the graph reads them, unless they are there already (the
        last step's ids came from a decode graph's argmax or its draw); whether there were any."""
        where, rows = layout.pending_inputs(step, starts)
        if not where:
            return False
        for at, row in zip(where, rows):
            tokens[_IDS * n_tok + at] = -row - 1
        if device_tokens.data_ptr() != self._prev_tokens.data_ptr():
            if device_tokens.shape[0] > self._prev_tokens.shape[0]:
                raise ValueError(f"{device_tokens.shape[0]} sampled ids for {self._prev_tokens.shape[0]} rows")
            self._prev_tokens[: device_tokens.shape[0]].copy_(device_tokens)
        return True

    @property
    def prev_ids(self) -> torch.Tensor:
        """Where the graphs read the last step's sampled ids left on the device (an input ``-r - 1``: row ``r``)."""
        return self._prev_tokens

    def replay_packed(self, shape: GraphShape, inputs: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Replay the graph of ``shape`` on ``inputs`` (host int64) packed as :meth:`replay` told
        them (another rank's step: ids left on the device are read from :attr:`prev_ids`, filled
        first); its logits."""
        n = inputs.shape[0]
        array = self._staging.stage()
        array[:n] = np.asarray(inputs)
        self._staging.copy(self._inputs, n)
        return self.run_graph(shape)

    def _decode_inputs(self, step: ScheduledStep, shape: GraphShape) -> tuple[list[int], list[int], list[int]]:
        """Host inputs of a pure-decode step (its rows in step order): (tokens, sequences, each
        request's flat position)."""
        reqs, size = step.requests, shape.decode
        pad = size - len(reqs)
        positions = [r.num_computed for r in reqs]
        ids = [r.token_ids(p, p + 1)[0] for r, p in zip(reqs, positions)]
        rows = [r.row for r in reqs]
        ctx = [p + 1 for p in positions]
        slots = step.slot_list()
        zeros, order = [0] * pad, self._arange[:size]
        tokens = ids + zeros + positions + zeros + slots + [self.pad_slot] * pad + rows + zeros
        seqs = ctx + [1] * pad + [1] * size + order + order + rows + zeros
        return tokens, seqs, self._arange[: len(reqs)]

    def _mixed_inputs(self, step: ScheduledStep, layout: StepLayout,
                      shape: GraphShape) -> tuple[list[int], list[int], list[int]]:
        """Host inputs of a step with prefill chunks: decode rows, then the chunks (see
        :class:`StepLayout`), padded to ``shape``."""
        tokens, seqs = self._padding(shape)
        n_tok, n_seq, d = shape.decode + shape.tokens, self._num_seqs(shape), shape.decode
        ids, pos, slots, trow = (tokens[k * n_tok : (k + 1) * n_tok] for k in range(4))
        ctx, qlen, qstart, logit, srow = (seqs[k * n_seq : (k + 1) * n_seq] for k in range(5))
        starts = layout.token_starts(step, d)
        new_slots = step.slot_list()
        slot_at = [0]
        for q_len in step.q_lens:
            slot_at.append(slot_at[-1] + q_len)
        for s, i in enumerate(layout.decode + layout.prefill):
            req, q_len = step.requests[i], step.q_lens[i]
            first, at = req.num_computed, starts[i]
            end = at + q_len
            ids[at:end] = req.token_ids(first, first + q_len)
            pos[at:end] = range(first, first + q_len)
            slots[at:end] = new_slots[slot_at[i] : slot_at[i + 1]]
            trow[at:end] = [req.row] * q_len
            row = s if s < layout.num_decode else d + s - layout.num_decode
            ctx[row], qlen[row], qstart[row], logit[row], srow[row] = first + q_len, q_len, at, end - 1, req.row
        return ids + pos + slots + trow, ctx + qlen + qstart + logit + srow, starts

    def _decode_rows(self, shape: GraphShape, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``n`` rows of a pure-decode graph's logits and argmax: views made once (two
        torch ops a step saved)."""
        rows = self._row_views.get((shape, n))
        if rows is None:
            argmax = self._argmax.get(shape)
            rows = self._row_views[(shape, n)] = (self._logits[shape][:n], argmax[:n] if argmax is not None else None)
        return rows

    def run_graph(self, shape: GraphShape | int) -> torch.Tensor:
        """Replay the graph of ``shape`` (an int: a pure-decode batch size) on the inputs written
        last; its logits ``[sequences, vocab]``."""
        if isinstance(shape, int):
            shape = GraphShape(shape)
        self._graphs[shape].replay()
        return self._logits[shape]
