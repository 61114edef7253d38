"""A rank other than 0 of a tensor-parallel node: its shard of the model, its KV heads, and a
loop that runs each step rank 0 plans, eagerly or by replaying the same CUDA graph.

Started by rank 0 (:class:`pd_cluster.engine.tp_leader.TPLeader`) as
``python -m pd_cluster.engine.tp_rank SPEC_JSON``. It schedules nothing: the slots in each plan
are rank 0's, and its pool has as many, so the same slot holds the same token's KV on every rank;
with CUDA graphs it keeps a request table that follows rank 0's (the plans carry its writes).
It stops, non-zero, when rank 0 is gone (its parent changed, or a collective failed) so that a
node never keeps half its ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from pd_cluster.engine.cuda_graphs import GraphShape, StepGraphs
from pd_cluster.engine.kv_pool import KVPool, torch_dtype
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.tp_group import TPGroup, make_store
from pd_cluster.engine.tp_kv import KVHeads, rank_kv_spec
from pd_cluster.engine.tp_plan import Op, read_graph_settings, split_journal, unpack
from pd_cluster.engine.tp_pools import answer_export
from pd_cluster.engine.tp_rank_spec import RankSpec
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.llama import LlamaModel
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import load_weights

logger = logging.getLogger(__name__)

#: Exit status of a rank that lost rank 0.
LOST_LEADER_EXIT = 3
PARENT_POLL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    """Rank 0 gone (killed, even with -9) leaves this rank with a new parent: stop at once."""
    while True:
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) is gone: stopping", parent_pid)
            os._exit(LOST_LEADER_EXIT)
        time.sleep(PARENT_POLL_S)


class RankLoop:
    """One rank's model and pool, and the steps it runs."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        store = make_store(spec.store_host, spec.store_port, spec.size, leader=False)
        self.group = TPGroup(store, spec.rank, spec.size, self.device, spec.step_timeout_s, spec.all_reduce_mode)
        config = ModelConfig.from_path(spec.model_path)
        shard = Shard(spec.rank, spec.size)
        weights = load_weights(spec.model_path, config, torch_dtype(spec.dtype), self.device, shard,
                               spec.load_format, quantization=spec.quantization)
        self.model = LlamaModel(config, weights, self.device, fused_rows=spec.fused_rows, shard=shard,
                                all_reduce=self.group.all_reduce)
        num_slots = int(store.get("num_slots"))
        self.pool = KVPool(rank_kv_spec(config, shard, spec.dtype, kv_dtype=spec.kv_dtype), num_slots, self.device)
        self.heads = KVHeads(self.group, config, self.pool)
        self.config = config
        #: With CUDA graphs (:attr:`Op.CAPTURE`): rank 0's request table, followed write by write.
        self.table: ReqSlotTable | None = None
        self.graphs: StepGraphs | None = None
        self.group.barrier()
        logger.info("tensor parallel rank %d of %d ready on %s: %d KV heads, %d slots", spec.rank, spec.size,
                    self.device, self.pool.spec.num_kv_heads, num_slots)

    def _leader_alive(self) -> bool:
        return os.getppid() == self.spec.parent_pid

    def run(self) -> None:
        """Run rank 0's messages until its stop (on this rank's device throughout)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else _no_device():
            while True:
                head, payload = self.group.plans.receive(self.spec.idle_timeout_s, self._leader_alive)
                op = Op(head[0])
                if op is Op.STOP:
                    return
                if op is Op.KEEP_ALIVE:
                    continue
                if op is Op.PUT_KV:
                    self._put_kv(payload.to(self.device))
                elif op is Op.GATHER_KV:
                    self.heads.gather(payload.to(self.device))
                elif op is Op.CAPTURE:
                    self._capture(payload.tolist())
                elif op is Op.EXPORT_POOLS:
                    answer_export(self.group.store, head[1], self.spec.rank, self.pool, self.heads.mine.start)
                else:
                    self._forward(head, op, payload)

    def _forward(self, head: list[int], op: Op, payload: torch.Tensor) -> None:
        inputs, journal = split_journal(head, payload)
        if self.table is not None:
            self.table.apply_journal(journal)
        if op is Op.FORWARD:
            self.model.forward(unpack(head, inputs, self.device), self.pool)
            return
        assert self.graphs is not None, "a replayed step before the graphs were captured"
        decode, tokens, _, prev_ids = head[1:5]
        if prev_ids:
            self.group.broadcast_model(self.graphs.prev_ids)
        self.graphs.replay_packed(GraphShape(decode, tokens), inputs)

    def _capture(self, settings: list[int]) -> None:
        """Capture the graphs rank 0 captures now: the same shapes in the same order."""
        batch_sizes, prefill_tokens, max_prefills, pad_slot, draws, (rows, width) = read_graph_settings(settings)
        self.table = ReqSlotTable(rows, width, self.device, host_mirror=False)
        self.graphs = StepGraphs(self.model, self.pool, self.table, batch_sizes, pad_slot, prefill_tokens,
                                 max_prefills, draws=draws)
        self.graphs.capture()

    def _put_kv(self, slots: torch.Tensor) -> None:
        # Every head's rows as a handover moves them (a quantized pool's: packed codes and scales).
        n = slots.numel()
        cfg = self.config
        kv = torch.empty((2, cfg.num_layers, n, cfg.num_kv_heads, self.pool.spec.row_width),
                         dtype=self.pool.k_cache.dtype, device=self.device)
        self.group.broadcast_model(kv)
        self.heads.take(kv, slots)


class _no_device:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = RankSpec.model_validate_json(argv[0])
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), name="parent-watch", daemon=True).start()
    try:
        loop = RankLoop(spec)
        loop.run()
        loop.group.close()
    except Exception:
        logger.exception("tensor parallel rank %d failed: stopping", spec.rank)
        return LOST_LEADER_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
