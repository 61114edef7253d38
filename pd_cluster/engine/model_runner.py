"""Turns a scheduled step into model inputs, runs the model and returns the logits to sample."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from kernels._triton import HAS_TRITON
from pd_cluster.config import EngineConfig
from pd_cluster.engine.cuda_graphs import GraphShape, StepGraphs
from pd_cluster.engine.device_copy import tensor_on, to_device
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.mapped_ids import MappedIds
from pd_cluster.engine.prompt_logprobs import PromptLogprobsState, PromptRowsPlan, plan_rows, score_rows
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.sampler import GraphDrawn
from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.engine.step_layout import StepLayout
from pd_cluster.engine.tp_leader import TPLeader
from pd_cluster.engine.tp_plan import graph_settings
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LayerHook, LlamaModel

logger = logging.getLogger(__name__)

#: Given a step before its inputs are written, the layer hook for its forward (None: no hook).
StepHook = Callable[[ScheduledStep], LayerHook | None]


class ModelRunner:
    def __init__(
        self, model: LlamaModel, pool: KVPool, table: ReqSlotTable, device: torch.device,
        config: EngineConfig | None = None, tp: TPLeader | None = None,
    ) -> None:
        self.model = model
        #: The other ranks of a tensor-parallel node, sent each step's inputs before it runs here.
        self.tp = tp
        self.pool = pool
        self.table = table
        self.device = device
        self.graphs: StepGraphs | None = None
        #: The argmax of each row the last :meth:`run` returned, taken inside its CUDA graph (None:
        #: not taken; valid until the next run). A greedy batch samples it without another launch.
        self.last_argmax: torch.Tensor | None = None
        #: The same ids in pinned host memory, written by that graph (None: not there).
        self.last_mapped: MappedIds | None = None
        #: The ids the last :meth:`run`'s graph drew itself (None: it drew none; see StepGraphs).
        self.last_drawn: GraphDrawn | None = None
        #: Prefill-only graphs with buffers of their own, for prefills on the engine's side stream
        #: beside a replay of :attr:`graphs` (see ``LLMEngine._prefill_aside``).
        self.side_graphs: StepGraphs | None = None
        #: Requests whose prompt logprobs are still being scored (empty: no step looks further).
        self.scoring: set[PromptLogprobsState] = set()
        if config is not None and config.cuda_graphs and device.type == "cuda":
            self.graphs, self.side_graphs = self._capture(config)

    def _capture(self, config: EngineConfig) -> tuple[StepGraphs, StepGraphs | None]:
        # One slot no request owns takes the padding rows' KV writes.
        pad_slot = int(self.pool.reserve(1)[0])
        graphs = StepGraphs(self.model, self.pool, self.table, config.graph_batch_sizes(), pad_slot,
                            config.graph_prefill_tokens(), config.mixed_graph_prefills,
                            draws=HAS_TRITON and config.draw_graphs)
        side_sizes = [t for t in config.graph_prefill_tokens() if t <= config.side_prefill_max_tokens]
        side = StepGraphs(self.model, self.pool, self.table, [], pad_slot, side_sizes, 1) if side_sizes else None
        if self.tp is not None:
            if side is not None:
                raise ValueError("side prefill graphs are not captured on a tensor-parallel node")
            # The ranks' tables follow this one (their graphs read them): each plan carries its
            # writes. Every rank captures the same shapes in the same order now: their all-reduces meet.
            self.table.journal = []
            self.tp.capture(graph_settings(graphs.batch_sizes, graphs.prefill_sizes, graphs.max_prefills, pad_slot,
                                           graphs.draws, tuple(self.table.table.shape)))
        with self._on_device():
            graphs.capture()
            if side is not None:
                side.capture()
        return graphs, side

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Kernels launch on the current device, which a node's thread may not have set."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def prepare(self, step: ScheduledStep, layout: StepLayout | None = None,
                starts: list[int] | None = None) -> ForwardBatch:
        """The step's inputs for an eager forward: one-token rows first (see :class:`StepLayout`);
        ``starts``: ``layout.token_starts(step)`` when the caller has it."""
        layout = layout or StepLayout.of(step)
        starts = starts if starts is not None else layout.token_starts(step)
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        ctx_lens: list[int] = []
        q_lens: list[int] = []
        rows: list[int] = []
        for i in layout.decode + layout.prefill:
            req, q_len = step.requests[i], step.q_lens[i]
            start = req.num_computed
            input_ids.extend(req.token_ids(start, start + q_len))
            positions.append(torch.arange(start, start + q_len, dtype=torch.int64))
            new_slots = torch.from_numpy(step.new_slots[i])
            slots.append(new_slots)
            self.table.write(req.row, start, new_slots)
            ctx_lens.append(start + q_len)
            q_lens.append(q_len)
            rows.append(req.row)
        q_start = [starts[i] for i in layout.decode + layout.prefill]
        logits_indices = [starts[i] + q - 1 for i, (q, sample) in enumerate(zip(step.q_lens, step.samples)) if sample]
        max_ctx = max(ctx_lens)
        dev = self.device
        return ForwardBatch(
            input_ids=tensor_on(input_ids, torch.int64, dev),
            positions=to_device(torch.cat(positions), dev),
            out_slots=to_device(torch.cat(slots), dev),
            # Only the live columns are gathered: the table is as wide as the context length.
            slot_table=self.table.table[:, :max_ctx].index_select(0, tensor_on(rows, torch.int64, dev)),
            ctx_lens=tensor_on(ctx_lens, torch.int64, dev),
            q_lens=tensor_on(q_lens, torch.int64, dev),
            q_start_loc=tensor_on(q_start, torch.int64, dev),
            logits_indices=tensor_on(logits_indices, torch.int64, dev),
            is_decode=not layout.prefill,
            num_decode=layout.num_decode,
            host_spans=list(zip(q_start, q_lens, ctx_lens)),
        )

    def run(self, step: ScheduledStep, layer_hooks: StepHook | None = None,
            device_tokens: torch.Tensor | None = None, side: bool = False) -> torch.Tensor:
        """Logits ``[K, vocab]`` for the requests of the step that sample (in step order).

        ``layer_hooks(step)`` may give a hook for this step's layers. Steps without a layer hook
        replay a CUDA graph when one holds them. ``device_tokens``: the previous step's sampled ids,
        still on the device; a request whose input is :data:`PENDING` reads its id there (row
        ``request.pending_index``). ``side``: a step on the engine's side stream, beside a replay of
        the main graphs: it replays a side graph (buffers of its own) or runs eagerly."""
        with self._on_device():
            layer_hook = layer_hooks(step) if layer_hooks is not None else None
            layout = StepLayout.of(step)
            graphs = self.side_graphs if side else self.graphs
            self.last_argmax = None
            self.last_mapped = None
            self.last_drawn = None
            starts = scored = None
            if self.scoring:  # a request is scoring its prompt: only then its rows are looked for
                starts = layout.token_starts(step)
                scored = self._prompt_rows(step, starts)
            if layer_hook is None and graphs is not None and scored is None:
                shape = graphs.shape_for(layout)
                if shape is not None:
                    logits = graphs.replay(step, layout, shape, device_tokens,
                                           self._plan_replay if self.tp is not None and not side else None)
                    self.last_argmax = graphs.last_argmax
                    self.last_mapped = graphs.last_mapped
                    graphs.last_mapped = None  # held here (and by the sampling's result) only
                    self.last_drawn = graphs.last_drawn
                    graphs.last_drawn = None
                    return logits
            starts = starts if starts is not None else layout.token_starts(step)
            batch = self.prepare(step, layout, starts)
            layout.take_device_ids(step, starts, batch.input_ids, device_tokens)
            if self.tp is not None:
                # The plan to the other ranks, then the same forward here: each rank reads and
                # writes its own heads at the slots the plan names.
                self.tp.forward(batch, self.table.take_journal())
            if scored is None:
                return self.model.forward(batch, self.pool, layer_hook)
            batch.hidden_rows = tensor_on(scored.rows, torch.int64, self.device)
            logits = self.model.forward(batch, self.pool, layer_hook)
            assert batch.hidden_out is not None
            score_rows(batch.hidden_out, self.model.weights.lm_head, scored)
            self.scoring = {state for state in self.scoring if not state.complete}
            return logits

    def _prompt_rows(self, step: ScheduledStep, starts: list[int]) -> PromptRowsPlan | None:
        """The rows of this step whose logits score a prompt token of a request that asked
        (:mod:`pd_cluster.engine.prompt_logprobs`); such a step runs eagerly, not as a graph."""
        asking = [(req.prompt_logprobs, req.num_computed, q_len, starts[i])
                  for i, (req, q_len) in enumerate(zip(step.requests, step.q_lens))
                  if req.prompt_logprobs is not None and req.prompt_logprobs in self.scoring]
        return plan_rows(asking) if asking else None

    def _plan_replay(self, shape: GraphShape, inputs: np.ndarray, pending: bool) -> None:
        """A tensor-parallel step replayed as a graph: its plan to the other ranks, which replay the
        same graph (the last step's sampled ids follow on the device where it reads them)."""
        assert self.tp is not None and self.graphs is not None
        self.tp.forward_graph(shape.decode, shape.tokens, inputs, self.table.take_journal(),
                              self.graphs.prev_ids if pending else None)
