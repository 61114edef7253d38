"""A one-shot all-reduce over the peers' memory for the small messages of decode steps.

A decode step sums each row-parallel projection's output over the ranks twice a layer: a
hidden row (8 KiB on an 8B shape) per request. NCCL's ring takes tens of microseconds for that
whatever the size, 160 times a step on an 8B shape. On one host whose GPUs reach each other's
memory, one kernel does it in a few: every rank copies its part into a buffer the others can
read (torch's symmetric memory), then sums every rank's buffer into its output
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``, as vLLM's and SGLang's custom all-reduce).
The buffer is made and exchanged once, before any step, so a call allocates nothing and is
captured in CUDA graphs like any kernel. Messages above :func:`one_shot_limit` (prefill chunks)
stay on NCCL, whose bandwidth wins there. NVLink multicast is not used (nor needed by one-shot).

Every rank decides the same way: each says whether it can (CUDA, the op in this torch, peer access
to every other rank's GPU), and the node uses the one-shot only if all can.
"""

from __future__ import annotations

import datetime
import logging
from typing import Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

AllReduceMode = Literal["auto", "nccl", "oneshot"]
#: The kernel moves 16-byte vectors: a message is a whole number of them.
ALIGN_BYTES = 16


def one_shot_limit(size: int) -> int:
    """Bytes up to which the one-shot beats NCCL with ``size`` ranks: each rank reads every other
    rank's whole message, so the limit halves as ranks double (vLLM's crossovers on NVLink)."""
    if size <= 2:
        return 1 << 20
    if size <= 4:
        return 512 << 10
    return 256 << 10


def fits(tensor: torch.Tensor, limit: int) -> bool:
    """Whether the one-shot takes ``tensor``: contiguous, whole 16-byte vectors, within ``limit``."""
    nbytes = tensor.numel() * tensor.element_size()
    return tensor.is_contiguous() and 0 < nbytes <= limit and nbytes % ALIGN_BYTES == 0


def one_shot_available() -> bool:
    """Whether this torch has the symmetric-memory one-shot op (CUDA builds)."""
    try:
        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018 (resolving the op is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


#: Whether this process set up a one-shot already: a second rendezvous of torch's symmetric
#: memory in one process was seen to wait forever, so a later node of the process (tests and
#: benches make several) keeps to NCCL; a serving node's process makes one.
_set_up_in_process = False


def local_reason(device: torch.device, rank: int, size: int) -> str | None:
    """Why this rank cannot take part in a one-shot all-reduce (None: it can). Rank ``r`` of a
    node runs on the ``r``-th GPU after rank 0's."""
    if device.type != "cuda":
        return f"device {device} is not a GPU"
    if _set_up_in_process:
        return "this process set up a one-shot for an earlier node"
    if not one_shot_available():
        return "this torch has no symmetric-memory all-reduce"
    index = device.index or 0
    others = [index - rank + r for r in range(size) if r != rank]
    if any(not torch.cuda.can_device_access_peer(device, other) for other in others):
        return f"{device} has no peer access to every other rank's GPU ({others})"
    return None


class OneShotAllReduce:
    """This rank's symmetric buffer and the one-shot sum over it (see the module's docstring)."""

    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device, limit: int,
                 backend: dist.Backend) -> None:
        from torch._C._distributed_c10d import _SymmetricMemory
        from torch.distributed import _symmetric_memory as symm_mem

        self.limit = limit
        self.device = device
        # The node's store is one per node, so its port names the node's ranks alike.
        self.group_name = f"pd-cluster-tp-{store.port}"
        self.process_group = register_group(self.group_name, store, rank, size, device, backend)
        _SymmetricMemory.set_group_info(self.group_name, rank, size, dist.PrefixStore("symm-mem", store))
        if symm_mem.get_backend(device) is None:
            # Peer memory through CUDA's own IPC (NVSHMEM's bootstrap needs a world of its own).
            symm_mem.set_backend("CUDA")
        self.buffer = symm_mem.empty(limit, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank exchanges its handle
        global _set_up_in_process
        _set_up_in_process = True

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device and fits(tensor, self.limit)

    def close(self) -> None:
        """Take the node's name out of torch's registry (a later node of this process may reuse
        the store's port, so the name)."""
        from torch._C._distributed_c10d import _unregister_process_group

        try:
            _unregister_process_group(self.group_name)
        except Exception as e:  # already gone
            logger.debug("one-shot group %s: %s", self.group_name, e)

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place (every rank calls it with the same shape)."""
        staging = self.buffer[: tensor.numel() * tensor.element_size()].view(tensor.dtype)
        # Each thread copies its elements in, waits for the peers, then writes the sums of the
        # same elements: ``tensor`` may be the output as well as the input.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, tensor.view(-1), "sum", self.group_name,
                                                        tensor.view(-1))


def register_group(name: str, store: dist.Store, rank: int, size: int, device: torch.device,
                   backend: dist.Backend) -> dist.ProcessGroup:
    """Register the node's model group under ``name`` in torch's process-group registry, where
    symmetric memory looks a group up by name; the node's groups are made without
    ``init_process_group``, so nothing else registers them. The registry holds it weakly: keep
    the returned group alive as long as the name is used."""
    from torch._C._distributed_c10d import _register_process_group

    group = dist.ProcessGroup(dist.PrefixStore(f"{name}/", store), rank, size)
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    group._register_backend(torch.device(device.type), kind, backend)
    group._set_default_backend(kind)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group


def agree(control: dist.ProcessGroup, ok: bool, timeout: datetime.timedelta) -> bool:
    """Whether every rank of the node said ``ok`` (over the host-side control group)."""
    flag = torch.tensor([1 if ok else 0])
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    options.timeout = timeout
    control.allreduce([flag], options).wait(timeout)
    return bool(int(flag.item()))


def make_one_shot(mode: AllReduceMode, store: dist.TCPStore, control: dist.ProcessGroup, rank: int, size: int,
                  device: torch.device, timeout: datetime.timedelta, model: dist.Backend) -> OneShotAllReduce | None:
    """The node's one-shot all-reduce, or None where it uses only its group's (NCCL, or gloo on
    CPU): with ``mode`` "nccl", or "auto" where some rank cannot. "oneshot" raises instead."""
    if mode == "nccl" or size < 2:
        return None
    if device.type != "cuda":  # every rank of the node is on the CPU: no need to ask the others
        if mode == "oneshot":
            raise RuntimeError(f"tp all-reduce oneshot needs GPUs (this node runs on {device})")
        return None
    reason = local_reason(device, rank, size)
    if not agree(control, reason is None, timeout):
        if mode == "oneshot":
            raise RuntimeError(f"tp all-reduce oneshot cannot run on this node: {reason or 'another rank cannot'}")
        if device.type == "cuda":
            logger.info("tp all-reduce: NCCL only (%s)", reason or "another rank cannot use the one-shot")
        return None
    try:
        one_shot: OneShotAllReduce | None = OneShotAllReduce(store, rank, size, device, one_shot_limit(size), model)
    except RuntimeError as e:
        if mode == "oneshot":
            raise
        logger.warning("tp all-reduce: the one-shot could not be set up (%s); NCCL only", e)
        one_shot = None
    if not agree(control, one_shot is not None, timeout):
        return None  # every rank uses the same all-reduce, or they would never meet
    logger.info("tp all-reduce: one-shot over peer memory up to %d KiB, NCCL above", one_shot.limit >> 10)
    return one_shot
