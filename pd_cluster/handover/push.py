"""The whole push: after the first token, the missing blocks' KV in one tensor, then D commits.

P gathers blocks [hit_blocks, n_blocks) out of its pool as ``[2, L, blocks*block, H, D]``
(the partial last block zero-padded) and sends ``PushKV`` with it over the tensor channel; D
scatters it into its reserved slots and joins the request to its batch. Every KV head goes,
whatever P's TP (a tensor-parallel P gathers its ranks' heads first, :class:`NodeKV`).
"""

from __future__ import annotations

import math
import time

import torch

import kernels
from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.messages import PushKV
from pd_cluster.handover.sender import Deadline, Handed, KVSender, WithHeldSlots
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer import PeerChannel


class PushSender(KVSender):
    """Blocks [hit_blocks, n_blocks) of a prompt of ``n_tokens`` tokens, in one push after the
    prefill; ``target``: the KV as D stores it (another KV dtype: converted after the gather, so
    the bytes moved are D's)."""

    def __init__(self, channel: PeerChannel, lease: DecodeLease, n_tokens: int, kv: NodeKV,
                 target: KVSpec | None = None) -> None:
        super().__init__(channel, lease)
        self.kv = kv
        self.target = target or kv.spec
        self.n_tokens = n_tokens
        block_size = kv.spec.block_size
        self.start = lease.hit_blocks * block_size
        self.send_blocks = math.ceil(n_tokens / block_size) - lease.hit_blocks

    @property
    def nbytes(self) -> int:
        return self.send_blocks * self.target.bytes_per_block

    async def commit(self, first_token: int, with_held_slots: WithHeldSlots, left: Deadline) -> Handed:
        started = time.monotonic()
        buffer, ready = await with_held_slots(self._gather)
        if ready is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(ready)
        ack = await self.channel.request(
            PushKV(lease_id=self.lease.lease_id, shape=list(buffer.shape), dtype=str(buffer.dtype).removeprefix("torch."),
                   first_token=first_token),
            left(),
            tensors=buffer,
        )
        seconds = time.monotonic() - started
        self.check_taken(ack)
        self.settled = True
        # What moved, counted from the tensor sent (D's rows, whatever P's pool holds).
        return Handed(bytes_sent=buffer.numel() * buffer.element_size(), seconds=seconds)

    def _gather(self, held_slots: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Engine thread: the blocks' KV as ``[2, L, send_blocks*block, H, D]``, zero-padded, and
        on a GPU the event after which it is complete."""
        slots = held_slots[self.start : self.n_tokens].to(self.kv.device)
        buffer = self.kv.gather(slots)
        spec = self.kv.spec
        buffer = kernels.convert_kv(buffer, spec.kv_dtype, self.target.kv_dtype, spec.head_dim)
        pad = self.send_blocks * self.kv.spec.block_size - slots.numel()
        if pad:
            shape = list(buffer.shape)
            shape[2] = pad
            buffer = torch.cat((buffer, buffer.new_zeros(shape)), dim=2)
        buffer = buffer.contiguous()
        ready = None
        if buffer.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return buffer, ready
