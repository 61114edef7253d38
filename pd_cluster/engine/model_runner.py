"""Turns a scheduled step into model inputs, runs the model and returns the logits to sample."""

from __future__ import annotations

import torch

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LayerHook, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, table: ReqSlotTable, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.table = table
        self.device = device

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
        rows = torch.tensor([r.row for r in step.requests], dtype=torch.int64, device=self.device)
        max_ctx = max(ctx_lens)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.cat(positions).to(dev, non_blocking=True),
            out_slots=torch.cat(step.new_slots).to(dev, non_blocking=True),
            slot_table=self.table.table.index_select(0, rows)[:, :max_ctx],
            ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64).to(dev, non_blocking=True),
            q_lens=q_lens.to(dev, non_blocking=True),
            q_start_loc=(torch.cumsum(q_lens, 0) - q_lens).to(dev, non_blocking=True),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(dev, non_blocking=True),
            is_decode=all(q == 1 for q in step.q_lens),
        )

    def run(self, step: ScheduledStep, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Logits ``[K, vocab]`` for the requests of the step that sample (in step order)."""
        batch = self.prepare(step)
        return self.model.forward(batch, self.pool, layer_hook)
