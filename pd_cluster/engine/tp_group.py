"""The collectives of one tensor-parallel node: a private store, two process groups and the
plans' channel.

Each node makes its own ``TCPStore`` (rank 0 listens on a free port) and its groups from it,
without ``torch.distributed.init_process_group``, so several nodes share a host (and a process
never joins a group that is not its node's). Two groups, so that their operations never
interleave: ``control`` (gloo, host tensors) carries the start's agreements and a plan too large
for the channel; ``model`` (NCCL on CUDA devices, gloo on CPU) carries the forward's all-reduces.
Each step's plan and the keep-alives from rank 0 go through :attr:`TPGroup.plans`, a ring in
shared memory. Every operation has a deadline: a rank that died makes the others' next
operation fail, never hang.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from pd_cluster.engine.tp_allreduce import AllReduceMode, make_one_shot
from pd_cluster.engine.tp_channel import PlanChannel

logger = logging.getLogger(__name__)

#: How long the ranks wait for one another to start (a rank loads its weights meanwhile).
STARTUP_TIMEOUT_S = 600.0
#: How long one collective of a step waits for the other ranks.
STEP_TIMEOUT_S = 60.0
#: How long closing waits for the groups' teardown before it leaves it to the process's exit.
CLOSE_TIMEOUT_S = 10.0

#: Closed groups, held until the process exits: a group destroyed later (by the collector, at
#: an arbitrary point of another part's work) would wait out its abort there.
_closed: list[object] = []


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_store(host: str, port: int, size: int, leader: bool) -> dist.TCPStore:
    """The node's store: rank 0 listens (``port`` 0: any free port, then ``store.port``)."""
    return dist.TCPStore(host, port, size, leader, timeout=_delta(STARTUP_TIMEOUT_S), wait_for_workers=False)


class TPGroup:
    """Rank ``rank`` of ``size``: the control and model groups over the node's store."""

    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device,
                 step_timeout_s: float = STEP_TIMEOUT_S, all_reduce_mode: AllReduceMode = "auto") -> None:
        """``all_reduce_mode``: whether small sums take the one-shot (:mod:`pd_cluster.engine.tp_allreduce`)."""
        self.rank = rank
        self.size = size
        self.device = device
        self.store = store
        self.step_timeout = _delta(step_timeout_s)
        startup = _delta(STARTUP_TIMEOUT_S)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, startup)
        self.plans = PlanChannel.open(store, self.control, rank, size)
        model_store = dist.PrefixStore("model", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.step_timeout
            self.model: dist.ProcessGroup = dist.ProcessGroupNCCL(model_store, rank, size, options)
        else:
            self.model = dist.ProcessGroupGloo(model_store, rank, size, self.step_timeout)
        self._reduce_options = dist.AllreduceOptions()
        self._reduce_options.timeout = self.step_timeout
        self.one_shot = make_one_shot(all_reduce_mode, store, self.control, rank, size, device, startup, self.model)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the row-parallel projections' outputs): the
        one-shot for a small message where the node has it, else the model group's."""
        if self.one_shot is not None and self.one_shot.takes(tensor):
            self.one_shot(tensor)
            return
        self.group_all_reduce(tensor)

    def group_all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place through the model group (NCCL, or gloo on CPU)."""
        work = self.model.allreduce([tensor], self._reduce_options)
        if tensor.device.type == "cuda":
            work.wait()  # orders the current stream after the NCCL kernel; no host wait
        else:
            work.wait(self.step_timeout)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``outputs[rank]`` on every rank (the model group)."""
        options = AllgatherOptions()
        options.timeout = self.step_timeout
        work = self.model.allgather([outputs], [tensor], options)
        if tensor.device.type == "cuda":
            work.wait()
        else:
            work.wait(self.step_timeout)

    def broadcast_model(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (on the device) into every rank's, over the model group (KV a
        handover brought, too large for the host's control group)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.step_timeout
        work = self.model.broadcast([tensor], options)
        if tensor.device.type == "cuda":
            work.wait()
        else:
            work.wait(self.step_timeout)

    def barrier(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until every rank is here (e.g. has loaded its weights)."""
        flag = torch.ones(1)
        options = dist.AllreduceOptions()
        options.timeout = _delta(timeout_s)
        self.control.allreduce([flag], options).wait(_delta(timeout_s))
        if int(flag.item()) != self.size:
            raise RuntimeError(f"tensor parallel barrier saw {int(flag.item())} of {self.size} ranks")

    def close(self) -> None:
        """Release the groups now that no rank will use them: the plans' ring (rank 0 unlinks
        it), the one-shot's name, then the model and control groups, aborted (no collective: the
        other ranks may be gone). The teardown runs with a deadline, so a node's close never
        hangs on a peer's state."""
        groups: list[dist.ProcessGroup] = [self.model, self.control]
        self.plans.close()
        if self.one_shot is not None:
            self.one_shot.close()
        _closed.append((self, groups))
        done = threading.Event()

        def teardown() -> None:
            for group in groups:
                try:
                    group.abort()
                except Exception as e:  # already torn down, or a backend without abort
                    logger.debug("tensor parallel group teardown: %s", e)
            done.set()

        threading.Thread(target=teardown, name="tp-group-close", daemon=True).start()
        if not done.wait(CLOSE_TIMEOUT_S):
            logger.warning("tensor parallel groups did not tear down within %.0f s; the process's exit will",
                           CLOSE_TIMEOUT_S)
