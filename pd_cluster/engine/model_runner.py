"""Turns a scheduled step into model inputs, runs the model and returns the logits to sample."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.cuda_graphs import DecodeGraphs
from pd_cluster.engine.device_copy import tensor_on, to_device
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import PENDING
from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LayerHook, LlamaModel

logger = logging.getLogger(__name__)

#: Given a step before its inputs are written, the layer hook for its forward (None: no hook).
StepHook = Callable[[ScheduledStep], LayerHook | None]


class ModelRunner:
    def __init__(
        self, model: LlamaModel, pool: KVPool, table: ReqSlotTable, device: torch.device,
        config: EngineConfig | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.table = table
        self.device = device
        self.graphs: DecodeGraphs | None = None
        if config is not None and config.cuda_graphs and device.type == "cuda":
            self.graphs = self._capture(config)

    def _capture(self, config: EngineConfig) -> DecodeGraphs:
        # One slot no request owns takes the padding rows' KV writes.
        pad_slot = self.pool.reserve(1)
        graphs = DecodeGraphs(self.model, self.pool, self.table, config.graph_batch_sizes(), int(pad_slot[0]))
        with self._on_device():
            graphs.capture()
        return graphs

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Kernels launch on the current device, which a node's thread may not have set."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def prepare(self, step: ScheduledStep) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        ctx_lens: list[int] = []
        logits_indices: list[int] = []
        offset = 0
        for req, q_len, slots, sample in zip(step.requests, step.q_lens, step.new_slots, step.samples):
            start = req.num_computed
            input_ids.extend(req.token_ids(start, start + q_len))
            positions.append(torch.arange(start, start + q_len, dtype=torch.int64))
            self.table.write(req.row, start, slots)
            ctx_lens.append(start + q_len)
            offset += q_len
            if sample:
                logits_indices.append(offset - 1)
        q_lens = torch.tensor(step.q_lens, dtype=torch.int64)
        rows = tensor_on([r.row for r in step.requests], torch.int64, self.device)
        max_ctx = max(ctx_lens)
        dev = self.device
        return ForwardBatch(
            input_ids=tensor_on(input_ids, torch.int64, dev),
            positions=to_device(torch.cat(positions), dev),
            out_slots=to_device(torch.cat(step.new_slots), dev),
            # Only the live columns are gathered: the table is as wide as the context length.
            slot_table=self.table.table[:, :max_ctx].index_select(0, rows),
            ctx_lens=tensor_on(ctx_lens, torch.int64, dev),
            q_lens=to_device(q_lens, dev),
            q_start_loc=to_device(torch.cumsum(q_lens, 0) - q_lens, dev),
            logits_indices=tensor_on(logits_indices, torch.int64, dev),
            is_decode=all(q == 1 for q in step.q_lens),
        )

    def _graph_fits(self, step: ScheduledStep) -> bool:
        return (
            self.graphs is not None
            and all(q == 1 for q in step.q_lens)
            and all(step.samples)
            and self.graphs.graph_size(len(step.requests)) is not None
        )

    def run(self, step: ScheduledStep, layer_hooks: StepHook | None = None,
            device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[K, vocab]`` for the requests of the step that sample (in step order).

        ``layer_hooks(step)`` may give a hook for this step's layers. Pure-decode steps without a
        layer hook replay a CUDA graph when one was captured. ``device_tokens``: the previous
        step's sampled ids, still on the device; a request whose input is :data:`PENDING` reads
        its id there (row ``request.pending_index``)."""
        with self._on_device():
            layer_hook = layer_hooks(step) if layer_hooks is not None else None
            patch = self._device_ids(step, device_tokens)
            if layer_hook is None and self._graph_fits(step):
                return self._replay(step, patch)
            batch = self.prepare(step)
            if patch is not None:
                batch.input_ids.index_copy_(0, *patch)
            return self.model.forward(batch, self.pool, layer_hook)

    def _device_ids(self, step: ScheduledStep, device_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat input positions, ids) for the step's inputs that are still on the device."""
        if device_tokens is None:
            return None
        where, rows = [], []
        offset = 0
        for req, q_len in zip(step.requests, step.q_lens):
            last = req.num_computed + q_len - 1
            if req.token_ids(last, last + 1)[0] == PENDING:
                if req.pending_index is None:
                    raise RuntimeError(f"request {req.request_id}: its input is on the device but not in the last step")
                where.append(offset + q_len - 1)
                rows.append(req.pending_index)
            offset += q_len
        if not where:
            return None
        index = tensor_on([where, rows], torch.int64, self.device)
        return index[0], device_tokens.index_select(0, index[1])

    def _replay(self, step: ScheduledStep, patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        assert self.graphs is not None
        reqs = step.requests
        positions = [r.num_computed for r in reqs]
        ids = [r.token_ids(p, p + 1)[0] for r, p in zip(reqs, positions)]
        slots = torch.cat(step.new_slots).tolist()
        return self.graphs.replay(ids, positions, slots, [r.row for r in reqs], patch)
