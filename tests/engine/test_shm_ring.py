"""The shared-memory ring that carries a tensor-parallel node's plans: one writer and two reader
processes, payloads larger than a slot over the control group, deadlines, the name's lifetime."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import signal
import time
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch.distributed as dist

from pd_cluster.engine.shm_ring import RingClosed, ShmRing
from pd_cluster.engine.tp_channel import PlanChannel
from pd_cluster.engine.tp_group import make_store

STOP = 0
TIMEOUT = dt.timedelta(seconds=60)
#: A slot of 1 KiB (128 words) and four slots: the messages below overflow some slots, and the
#: writer laps the ring many times (it waits for the readers).
SLOT_BYTES, SLOTS = 1024, 4


def _messages() -> list[tuple[list[int], list[int]]]:
    """(header, payload) pairs of sizes around a slot's: empty, inline, exactly full, too large."""
    sizes = [0, 1, 5, 120, 124, 125, 126, 300, 2, 1000, 7] + [(37 * i) % 200 for i in range(40)]
    return [([1, i, size, 4], list(range(i, i + size))) for i, size in enumerate(sizes)]


def _control(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, TIMEOUT)


def _reader(port: int, rank: int, size: int, out: mp.Queue) -> None:
    store = make_store("127.0.0.1", port, size, leader=False)
    channel = PlanChannel.open(store, _control(store, rank, size), rank, size)
    got = []
    while True:
        head, payload = channel.receive(60.0)
        if head[0] == STOP:
            break
        got.append((head, payload.tolist()))
    channel.close()
    out.put((rank, got))


def test_two_reader_processes_get_every_message_in_order_and_large_payloads_over_the_control_group():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = make_store("127.0.0.1", 0, 3, leader=True)
    readers = [ctx.Process(target=_reader, args=(store.port, rank, 3, out), daemon=True) for rank in (1, 2)]
    for proc in readers:
        proc.start()
    try:
        channel = PlanChannel.open(store, _control(store, 0, 3), 0, 3, slots=SLOTS, slot_bytes=SLOT_BYTES)
        messages = _messages()
        over = 0
        for head, payload in messages:
            # Two parts, joined in the slot as one payload.
            half = len(payload) // 2
            channel.send(head, [np.array(payload[:half], dtype=np.int64), np.array(payload[half:], dtype=np.int64)])
            over += 2 + len(head) + len(payload) > channel.ring.capacity
        channel.send([STOP])
        got = dict(out.get(timeout=120) for _ in readers)
        for proc in readers:
            proc.join(30)
        assert over >= 3  # some went over the control group, in their place in the order
        assert got[1] == got[2] == messages
        # The readers have exited: the name is the writer's until it closes.
        assert os.path.exists(f"/dev/shm/{channel.ring.name}")
        channel.close()
    finally:
        for proc in readers:
            if proc.is_alive():
                proc.kill()


def _writer(out: mp.Queue, attached: mp.Event) -> None:
    ring = ShmRing.create(1, slots=2, slot_bytes=64)
    out.put(ring.name)
    attached.wait(60)
    ring.write([np.array([42])], 5.0)
    time.sleep(600)  # killed here by the test


def test_a_reader_waits_up_to_its_deadline_and_no_longer_when_the_writer_is_gone():
    ctx = mp.get_context("spawn")
    out, attached = ctx.Queue(), ctx.Event()
    writer = ctx.Process(target=_writer, args=(out, attached), daemon=True)
    writer.start()
    name = out.get(timeout=60)
    ring = ShmRing.attach(name, 0)
    try:
        attached.set()
        assert ring.read(30.0).tolist() == [42]
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="nothing within 0.3 s"):
            ring.read(0.3)
        assert 0.3 <= time.monotonic() - start < 5
        # Told how to see the writer, it stops at once, well before its deadline.
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            ring.read(60.0, alive=writer.is_alive)
        assert time.monotonic() - start < 5
    finally:
        ring.close()
        shared_memory.SharedMemory(name=name).unlink()  # the killed writer could not


def test_close_unlinks_and_readers_finish_what_was_written_then_see_it_closed():
    writer = ShmRing.create(2, slots=4, slot_bytes=256)
    readers = [ShmRing.attach(writer.name, i) for i in range(2)]
    name = writer.name
    for i in range(3):
        assert writer.write([np.arange(i + 1)], 1.0)
    assert not writer.write([np.arange(33)], 1.0)  # over 32 words: not sent
    # A full ring: the writer waits for its slowest reader up to its deadline.
    assert writer.write([np.array([3])], 1.0)
    with pytest.raises(TimeoutError):
        writer.write([np.array([4])], 0.2)
    writer.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(name, 0)
    for reader in readers:
        assert [reader.read(1.0).tolist() for _ in range(4)] == [[0], [0, 1], [0, 1, 2], [3]]
        with pytest.raises(RingClosed):
            reader.read(1.0)
        reader.close()
