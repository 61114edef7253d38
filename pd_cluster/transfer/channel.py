"""A pairwise tensor channel: a private 2-rank process group between one P and one D.

No ``init_process_group`` and no global world: D hosts a private ``TCPStore`` for the pair, and
both ends build the backend object directly (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL``
between GPUs), D as rank 0, P as rank 1. Nodes come and go without touching anyone else.

Every blocking call (store, group construction, send, recv) runs on the channel's own worker
thread, in order, and waits with a deadline. A timeout or a dead peer raises
:class:`ChannelError` and tears the channel down (the group is aborted); nothing is retried
on a channel that failed once, because the peers may disagree on how far it got.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pd_cluster.transfer.errors import ChannelError
from pd_cluster.transfer.handshake import Backend

logger = logging.getLogger(__name__)

#: Rank of the decode node (it hosts the store); the prefill node is rank 1.
HOST_RANK = 0
#: Extra seconds the event loop waits for the worker thread past an operation's own deadline.
_GRACE_S = 2.0
#: How often a waiting op checks whether the peer hung up its control connection; NCCL never
#: notices a dead peer by itself, so this is what makes a dead peer fail fast there.
_POLL_S = 0.05
_SPIN_S = 50e-6
_TAG = 0

_T = TypeVar("_T")
TensorSpec = tuple[Sequence[int], torch.dtype | str]


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept ``torch.bfloat16`` or its name ``"bfloat16"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ChannelCounters:
    """Backend and byte counters of the tensor channel, as either end of a pair shows them."""

    channel: "TensorChannel"

    @property
    def backend(self) -> str:
        return self.channel.backend

    @property
    def bytes_sent(self) -> int:
        return self.channel.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.channel.bytes_received


class TensorChannel:
    """Send and receive tensors to one peer through a 2-rank process group.

    Lifecycle: the host (rank 0) calls :meth:`host_store` and tells the peer the port; the
    peer calls :meth:`join_store`; then both call :meth:`form_group`. Ops issued from the event
    loop run in issue order on one worker thread, so several sends (one per layer) arrive in
    the order they were made.
    """

    def __init__(self, device: torch.device | str, backend: Backend, rank: int, group_timeout: float) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self.rank = rank
        self.peer_rank = 1 - rank
        self.group_timeout = group_timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        # Gloo moves host memory: a GPU node sharing its GPU with the peer stages through it.
        self._wire_device = self.device if backend == "nccl" else torch.device("cpu")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pd-channel-r{rank}")
        self._store: dist.Store | None = None
        self._group: Any = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._aborter: threading.Thread | None = None
        #: Set by the owner: True once the peer's control connection is gone.
        self.peer_gone: Callable[[], bool] | None = None

    # ---- setup --------------------------------------------------------------------------

    async def host_store(self, host: str, timeout: float) -> int:
        """Rank 0: start the pair's private store on a free port; returns the port."""

        def _start() -> int:
            store = dist.TCPStore(
                host, 0, world_size=2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.group_timeout)
            )
            self._store = store
            return store.port

        return await self._run(_start, timeout, "starting the pair store")

    async def join_store(self, host: str, port: int, timeout: float) -> None:
        """Rank 1: connect to the store the host announced."""

        def _join() -> None:
            self._store = dist.TCPStore(
                host, port, world_size=2, is_master=False, timeout=timedelta(seconds=min(timeout, self.group_timeout))
            )

        await self._run(_join, timeout, f"joining the pair store at {host}:{port}")

    async def form_group(self, local_host: str, timeout: float) -> None:
        """Both ranks: build the process group and prove it with one tiny exchange, so a
        broken pair fails at dial time rather than on the first KV push."""

        def _form() -> None:
            assert self._store is not None, "store first"
            group = _make_group(self._store, self.rank, self.backend, self.device, local_host, self.group_timeout)
            with self._close_lock:
                if self._closed:  # closed while the group was being built
                    _abort(group)
                    raise ChannelError("channel closed while forming the group")
                self._group = group
            deadline = time.monotonic() + timeout
            probe = torch.zeros(1, dtype=torch.int32, device=self._wire_device)
            if self.rank == HOST_RANK:
                self._wait(self._group.recv([probe], self.peer_rank, _TAG), deadline)
            else:
                self._wait(self._group.send([probe], self.peer_rank, _TAG), deadline)

        await self._run(_form, timeout, f"forming the {self.backend} pair group")
        logger.debug("%s pair group formed (rank %d, device %s)", self.backend, self.rank, self.device)

    # ---- tensors --------------------------------------------------------------------------

    async def send(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float, *, count: bool = True) -> int:
        """Send tensors to the peer, in order; returns the bytes sent. On a GPU the send is
        ordered after the work already queued on the caller's current stream. ``count=False``
        leaves :attr:`bytes_sent` alone (a warm-up is not KV)."""
        batch = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)

        def _send() -> int:
            deadline = time.monotonic() + timeout
            wire = [t.to(self._wire_device).contiguous() for t in batch]
            works = [self._group.send([t], self.peer_rank, _TAG) for t in wire]
            sent = 0
            for work, t in zip(works, wire):
                self._wait(work, deadline)
                sent += _nbytes(t)
                if count:
                    self.bytes_sent += _nbytes(t)
            return sent

        return await self._run(_send, timeout, f"sending {len(batch)} tensor(s)")

    async def recv_into(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float, *, count: bool = True) -> None:
        """Receive into existing tensors (for example staging buffers), in order; ``count=False``
        leaves :attr:`bytes_received` alone."""
        batch = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)

        def _recv() -> None:
            deadline = time.monotonic() + timeout
            wire = [
                t if t.device == self._wire_device and t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=self._wire_device)
                for t in batch
            ]
            works = [self._group.recv([w], self.peer_rank, _TAG) for w in wire]
            for work, w, t in zip(works, wire, batch):
                self._wait(work, deadline)
                if w is not t:
                    t.copy_(w)
                if count:
                    self.bytes_received += _nbytes(w)

        await self._run(_recv, timeout, f"receiving {len(batch)} tensor(s)")

    async def recv(self, specs: Sequence[TensorSpec], timeout: float, *, count: bool = True) -> list[torch.Tensor]:
        """Receive tensors of the given (shape, dtype), in order, on the channel's device."""
        out = [torch.empty(tuple(shape), dtype=as_dtype(dtype), device=self.device) for shape, dtype in specs]
        await self.recv_into(out, timeout, count=count)
        return out

    # ---- teardown ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Abort the group; safe to call twice and from any thread.

        The abort runs on a side thread: a backend may take a moment, and a worker still
        blocked on a dead peer returns by its own deadline."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            group = self._group
        # The group object stays referenced until the channel is dropped: a worker may still
        # be waiting on one of its operations, and freeing it under that wait is unsafe.
        # Queued ops still run, and fail at once on the closed flag (cancelling them would
        # look like a cancellation of the caller's task).
        self._executor.shutdown(wait=False)
        if group is not None:
            self._aborter = threading.Thread(target=_abort, args=(group,), name="pd-channel-abort", daemon=True)
            self._aborter.start()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Close and wait (bounded) until the group is aborted, so its resources are freed
        before, for example, the process exits."""
        self.close()
        if self._aborter is not None and self._aborter.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._aborter.join, timeout)

    # ---- internals -----------------------------------------------------------------------

    async def _run(self, fn: Callable[[], _T], timeout: float, what: str) -> _T:
        if self._closed:
            raise ChannelError(f"channel closed; cannot do: {what}")
        loop = asyncio.get_running_loop()
        # CUDA's current stream is per thread: the worker adopts the caller's.
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            future = loop.run_in_executor(self._executor, self._in_worker(fn, stream))
        except RuntimeError as e:  # executor shut down by a concurrent close
            raise ChannelError(f"channel closed; cannot do: {what}") from e
        give_up = loop.time() + timeout + _GRACE_S
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=min(_POLL_S, max(0.0, give_up - loop.time())))
                if done:
                    return future.result()
                if self.peer_gone is not None and self.peer_gone():
                    raise ChannelError(f"peer hung up during: {what}; channel torn down")
                if loop.time() >= give_up:
                    raise ChannelError(f"{what} did not finish within {timeout:.1f}s; channel torn down")
        except asyncio.CancelledError:
            # The peers may now disagree on how far the transfer got: never reuse.
            self._abandon(future)
            raise
        except ChannelError:
            self._abandon(future)
            raise
        except Exception as e:
            self._abandon(future)
            raise ChannelError(f"{what} failed: {_backend_message(e)}; channel torn down") from e

    def _abandon(self, future: asyncio.Future) -> None:
        """Tear down; a worker still blocked returns by its own deadline, its result unread."""
        self.close()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _wait(self, work: Any, deadline: float) -> None:
        (_wait_polling if self.backend == "nccl" else _wait_blocking)(work, deadline)

    def _in_worker(self, fn: Callable[[], _T], stream: Any) -> Callable[[], _T]:
        def call() -> _T:
            if self._closed:
                raise ChannelError("channel closed")
            if stream is None:
                return fn()
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(stream):
                return fn()

        return call


def _wait_blocking(work: Any, deadline: float) -> None:
    """Block until a backend op completes or the deadline passes (both raise on failure)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ChannelError("deadline passed before the operation could be waited on")
    try:
        ok = work.wait(timedelta(seconds=remaining))
    except RuntimeError as e:
        raise ChannelError(_backend_message(e)) from e
    if ok is False:
        raise ChannelError("operation reported failure")


def _wait_polling(work: Any, deadline: float) -> None:
    """Like :func:`_wait_blocking` for NCCL, whose timed wait polls at a millisecond: a
    finer poll keeps many small per-layer sends from paying that each."""
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise ChannelError("operation did not finish before its deadline")
        time.sleep(_SPIN_S)
    try:
        work.wait()  # raises the op's error, if any; orders the current stream after it
    except RuntimeError as e:
        raise ChannelError(_backend_message(e)) from e


def _backend_message(error: BaseException) -> str:
    """First line of a backend error, without the "[source/file.cc:123] " prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(error).__name__


def _make_group(store: dist.Store, rank: int, backend: Backend, device: torch.device, local_host: str, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    # A private store per pair, but prefixed anyway so the keys say what they are.
    prefixed = dist.PrefixStore("pd-pair", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Bind gloo to the interface the control connection uses: it reaches the peer.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._threads = 2
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ChannelError("this torch build has no NCCL")
        # The default (3) makes NCCL's watchdog kill the whole process when a peer dies; a
        # serving node must only lose that one channel. The debug dump on timeout holds the
        # abort of a timed-out send for a minute, with its kernel spinning on the GPU meanwhile.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # KV sends run beside a prefill's kernels: at normal priority they wait for its end.
        options.is_high_priority_stream = True
        group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        return group
    raise ChannelError(f"unknown backend {backend!r}")


def _abort(group: Any) -> None:
    for method in ("abort", "shutdown"):
        fn = getattr(group, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as e:  # best effort: the group is being thrown away
            logger.debug("process group %s failed: %s", method, e)
