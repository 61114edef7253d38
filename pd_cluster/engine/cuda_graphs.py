"""CUDA graphs for pure-decode steps: one captured forward per batch size, replayed with padding.

A decode step launches the same few hundred small kernels every time; at small batches their
launch cost is most of the step. :class:`DecodeGraphs` captures ``LlamaModel.forward`` once per
batch size over static input buffers and replays the smallest graph that holds a step. Padding
rows write their KV to a slot reserved for them (no request owns it), read one token of
context, and their logits are dropped. The slot table is as wide as the request table (the
model's context length), so one capture serves every context length.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LlamaModel

logger = logging.getLogger(__name__)

# Rows of the packed per-step inputs (one host-to-device copy per step).
_IDS, _POS, _SLOTS, _CTX, _ROWS = range(5)


class DecodeGraphs:
    """Captured decode forwards for a fixed set of batch sizes on one CUDA device."""

    def __init__(
        self, model: LlamaModel, pool: KVPool, table: ReqSlotTable, batch_sizes: Sequence[int], pad_slot: int
    ) -> None:
        self.model = model
        self.pool = pool
        self.table = table
        self.device = pool.device
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.pad_slot = pad_slot
        n, width, dev = self.max_batch, table.table.shape[1], self.device
        self._inputs = torch.zeros((5, n), dtype=torch.int64, device=dev)
        self._slot_table = torch.full((n, width), pad_slot, dtype=torch.int64, device=dev)
        self._ones = torch.ones(n, dtype=torch.int64, device=dev)
        self._arange = torch.arange(n, dtype=torch.int64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _batch(self, size: int) -> ForwardBatch:
        rows = self._inputs[:, :size]
        return ForwardBatch(
            input_ids=rows[_IDS],
            positions=rows[_POS],
            out_slots=rows[_SLOTS],
            slot_table=self._slot_table[:size],
            ctx_lens=rows[_CTX],
            q_lens=self._ones[:size],
            q_start_loc=self._arange[:size],
            logits_indices=self._arange[:size],
            is_decode=True,
        )

    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every size, largest first, in one memory pool."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        started = time.monotonic()
        self._write_inputs([], [], [], [], [], self.max_batch)  # all padding
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            batch = self._batch(size)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self.model.forward(batch, self.pool)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=side, capture_error_mode="thread_local"):
                self._logits[size] = self.model.forward(batch, self.pool)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.batch_sizes,
                    time.monotonic() - started)

    def graph_size(self, batch: int) -> int | None:
        """The captured size a batch of ``batch`` rows pads to (None: larger than any)."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def _write_inputs(
        self, ids: list[int], positions: list[int], slots: list[int], ctx_lens: list[int], rows: list[int], size: int
    ) -> None:
        pad = size - len(ids)
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad, ctx_lens + [1] * pad,
             rows + [0] * pad],
            dtype=torch.int64,
        )
        self._inputs[:, :size].copy_(to_device(host, self.device))

    def replay(self, ids: list[int], positions: list[int], slots: list[int], rows: list[int],
               device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode one token for each row: ``ids[b]`` at ``positions[b]`` of table row ``rows[b]``,
        its KV going to ``slots[b]``; ``device_ids`` (batch rows, ids on the device) replace the
        ids of rows whose token is still on the device. Returns float32 logits ``[B, vocab]``: a
        view valid until the next replay."""
        batch = len(ids)
        size = self.graph_size(batch)
        if size is None or batch == 0:
            raise ValueError(f"no captured graph for a batch of {batch}")
        ctx_lens = [p + 1 for p in positions]
        max_ctx = max(ctx_lens)
        self._write_inputs(ids, positions, slots, ctx_lens, rows, size)
        if device_ids is not None:
            self._inputs[_IDS].index_copy_(0, *device_ids)
        real = self._inputs[:, :batch]
        table = self.table.table
        # The new tokens' slots enter the request table, then the rows' live columns are copied
        # into the static slot table (columns past a row's context are never read).
        table.index_put_((real[_ROWS], real[_POS]), real[_SLOTS])
        self._slot_table[:batch, :max_ctx] = table[:, :max_ctx].index_select(0, real[_ROWS])
        return self.run_graph(size)[:batch]

    def run_graph(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` on the inputs written last; its logits ``[size, vocab]``."""
        self._graphs[size].replay()
        return self._logits[size]
