"""Rank 0 of a tensor-parallel node: starts the other ranks, sends them each step's plan, keeps
them waiting with keep-alives while idle, and notices one dying.

A node is one registration with the master whatever its TP; its scheduler, sampler and prefix
cache live here only. A rank that dies leaves the node unable to run a step, so the node is
lost as a whole (:attr:`TPLeader.on_lost`; by default the process exits non-zero and its
launcher restarts it, while the master moves its requests as for any lost node).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from pd_cluster.engine.tp_group import STEP_TIMEOUT_S, TPGroup, make_store
from pd_cluster.engine.tp_plan import Op, graph_header, header, pack, slots_header, with_journal
from pd_cluster.engine.tp_pools import RankPools, kinds_key, rank_key
from pd_cluster.engine.tp_rank_spec import RankSpec
from pd_cluster.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

#: Exit status of a node process whose rank died.
RANK_LOST_EXIT = 3
KEEP_ALIVE_S = 5.0
STOP_WAIT_S = 10.0
#: Longest wait for the ranks' KV pool handles (an export takes milliseconds).
EXPORT_WAIT_S = 30.0


def rank_device(device: torch.device, rank: int) -> str:
    """Rank ``rank``'s device: the ``rank``-th after rank 0's (``cuda:i`` -> ``cuda:i+rank``)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


def exit_node(reason: str) -> None:
    logger.critical("%s: this node cannot run a step; exiting for its launcher to restart it", reason)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT)


def _host(slots: torch.Tensor) -> np.ndarray:
    """A KV op's slots as host int64 words."""
    return slots.to(device="cpu", dtype=torch.int64).numpy()


class TPLeader:
    def __init__(self, size: int, model_path: str, dtype: str, device: torch.device, fused_rows: int | None,
                 on_lost: Callable[[str], None] = exit_node, step_timeout_s: float = STEP_TIMEOUT_S,
                 keep_alive_s: float = KEEP_ALIVE_S, load_format: str = "safetensors",
                 all_reduce_mode: str = "auto", quantization: str = "none", kv_dtype: str = "") -> None:
        self.size = size
        self.on_lost = on_lost
        self._keep_alive_s = keep_alive_s
        self._step_timeout_s = step_timeout_s
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._last_sent = time.monotonic()
        self._exports = 0
        store = make_store("127.0.0.1", 0, size, leader=True)
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = RankSpec(model_path=str(model_path), dtype=dtype, device=rank_device(device, rank),
                            fused_rows=fused_rows, rank=rank, size=size, store_host="127.0.0.1",
                            store_port=store.port, parent_pid=os.getpid(), step_timeout_s=step_timeout_s,
                            idle_timeout_s=6 * keep_alive_s, load_format=load_format,
                            all_reduce_mode=all_reduce_mode, quantization=quantization, kv_dtype=kv_dtype)
            self._procs.append(subprocess.Popen([sys.executable, "-m", "pd_cluster.engine.tp_rank",
                                                 spec.model_dump_json()]))
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True).start()
        self.group = TPGroup(store, 0, size, device, step_timeout_s, all_reduce_mode)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1 .. size-1."""
        return [p.pid for p in self._procs]

    def start(self, num_slots: int) -> None:
        """Give the ranks the pool size and wait until all have loaded their weights."""
        self.group.store.set("num_slots", str(num_slots))
        self.group.barrier()
        threading.Thread(target=self._keep_alive, name="tp-keep-alive", daemon=True).start()

    def forward(self, batch: ForwardBatch, journal: torch.Tensor) -> None:
        """Send the step's plan (with ``journal``, the request table's writes since the last);
        the caller then runs the same forward here."""
        self._send(with_journal(header(Op.FORWARD, batch), journal), pack(batch).numpy(), journal.numpy())

    def forward_graph(self, decode: int, tokens: int, inputs: np.ndarray, journal: torch.Tensor,
                      prev_ids: torch.Tensor | None) -> None:
        """Send a replayed step's plan: its graph's shape and packed static ``inputs`` (host int64,
        copied before this returns), the table's writes, and ``prev_ids`` (the graphs' buffer of
        the last step's sampled ids on the device, broadcast in stream order: no wait for them
        here) where the step reads them; the caller then replays the same graph here."""
        head = graph_header(decode, tokens, inputs.size, prev_ids is not None, journal.shape[1])
        self._send(head, inputs, journal.numpy(), model=prev_ids)

    def capture(self, settings: torch.Tensor) -> None:
        """Have the ranks capture the CUDA graphs rank 0 captures next (the same shapes, in the
        same order: their all-reduces meet); ``settings`` from :func:`~pd_cluster.engine.tp_plan.graph_settings`."""
        head = header(Op.CAPTURE)
        head[1] = settings.numel()
        self._send(head, settings.numpy())

    def put_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Send every head's KV at ``slots`` (``[2, layers, n, heads, head_dim]`` on the device,
        contiguous); each rank keeps its own. The caller then writes its own heads here."""
        self._send(slots_header(Op.PUT_KV, slots.numel()), _host(slots), model=kv)

    def gather_kv(self, slots: torch.Tensor) -> None:
        """Ask the ranks for their heads at ``slots``; the caller then joins their all-gather
        (:meth:`pd_cluster.engine.tp_kv.KVHeads.gather`)."""
        self._send(slots_header(Op.GATHER_KV, slots.numel()), _host(slots))

    def export_pools(self, kinds: list[str], timeout_s: float = EXPORT_WAIT_S) -> list[RankPools]:
        """Ranks 1 .. N-1 export their KV pools in ``kinds`` (each those it can); their answers.
        Raises TimeoutError when a rank does not answer within ``timeout_s``."""
        seq = self._exports
        self._exports += 1
        store = self.group.store
        store.set(kinds_key(seq), ",".join(kinds))
        head = header(Op.EXPORT_POOLS)
        head[1] = seq
        self._send(head)
        keys = [rank_key(seq, rank) for rank in range(1, self.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # the store raises its own error on a timeout
            raise TimeoutError(f"the ranks did not export their KV pools within {timeout_s:.0f} s: {e}") from e
        return [RankPools.model_validate_json(store.get(key)) for key in keys]

    def _ranks_alive(self) -> bool:
        return all(proc.poll() is None for proc in self._procs)

    def _send(self, head: list[int], *payload: np.ndarray, model: torch.Tensor | None = None) -> None:
        """The plan (``head`` and the concatenation of ``payload``, one message of the node's
        channel), then ``model`` broadcast over the model group if given."""
        try:
            with self._lock:
                self.group.plans.send(head, payload, self._step_timeout_s, self._ranks_alive)
                self._last_sent = time.monotonic()
            if model is not None:
                self.group.broadcast_model(model)
        except Exception as e:
            if not self._closing.is_set():
                self.on_lost(f"tensor parallel group failed: {e}")
            raise

    def _keep_alive(self) -> None:
        while not self._closing.wait(self._keep_alive_s / 2):
            if time.monotonic() - self._last_sent >= self._keep_alive_s:
                try:
                    self._send(header(Op.KEEP_ALIVE))
                except Exception:
                    return

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing.is_set():
            self.on_lost(f"tensor parallel rank {rank} (pid {proc.pid}) exited with status {code}")

    def close(self) -> None:
        """Stop the ranks (they exit 0), killing any that does not within a few seconds, then
        release this rank's groups."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            with self._lock:
                self.group.plans.send(header(Op.STOP), (), STOP_WAIT_S, self._ranks_alive)
        except Exception:
            logger.warning("tensor parallel ranks did not take the stop; killing them")
        for proc in self._procs:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_WAIT_S)
        self.group.close()
