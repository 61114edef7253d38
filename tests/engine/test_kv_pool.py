"""KV pool: slots are handed out once, returned once, and never conjured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.kv_spec import KVSpec

SPEC = KVSpec(model="tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")


@pytest.fixture
def pool() -> KVPool:
    return KVPool(SPEC, num_slots=16)


def test_alloc_gives_distinct_slots_and_free_returns_them(pool: KVPool) -> None:
    a = pool.alloc(5)
    b = pool.alloc(7)
    assert a is not None and b is not None
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    assert len(set(a.tolist()) | set(b.tolist())) == 12
    assert all(0 <= s < pool.capacity for s in a.tolist() + b.tolist())
    assert pool.num_free == 4
    pool.free(a)
    assert pool.num_free == 9
    pool.free(b)
    assert pool.num_free == pool.capacity
    again = pool.alloc(16)
    assert again is not None and sorted(again.tolist()) == list(range(16))


def test_alloc_beyond_free_returns_none_and_changes_nothing(pool: KVPool) -> None:
    assert pool.alloc(10) is not None
    assert pool.alloc(7) is None
    assert pool.num_free == 6
    assert pool.alloc(6) is not None
    assert pool.alloc(1) is None
    assert pool.alloc(0) is not None and pool.num_free == 0


def test_double_free_raises(pool: KVPool) -> None:
    slots = pool.alloc(3)
    assert slots is not None
    pool.free(slots)
    with pytest.raises(RuntimeError):
        pool.free(slots[:1])
    assert pool.num_free == pool.capacity


def test_slot_listed_twice_in_one_free_raises(pool: KVPool) -> None:
    slots = pool.alloc(2)
    assert slots is not None
    with pytest.raises(RuntimeError):
        pool.free(torch.stack([slots[0], slots[0]]))
    assert pool.num_free == pool.capacity - 2


def test_free_of_never_allocated_slot_raises(pool: KVPool) -> None:
    with pytest.raises(RuntimeError):
        pool.free(torch.tensor([3]))


def test_negative_alloc_and_empty_pool_rejected() -> None:
    with pytest.raises(ValueError):
        KVPool(SPEC, num_slots=0)
    with pytest.raises(ValueError):
        KVPool(SPEC, num_slots=4).alloc(-1)


def test_layer_views_have_slot_shape(pool: KVPool) -> None:
    k, v = pool.layer(1)
    assert k.shape == v.shape == (16, SPEC.num_kv_heads, SPEC.head_dim)
    k[3].fill_(1.0)
    assert float(pool.k_cache[1, 3].sum()) == SPEC.num_kv_heads * SPEC.head_dim


def test_reserved_slots_leave_the_capacity_and_are_never_handed_out():
    from pd_cluster.engine.kv_pool import KVPool
    from pd_cluster.kv_spec import KVSpec

    pool = KVPool(KVSpec(model="m", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32"), 8)
    reserved = pool.reserve(1)
    assert pool.capacity == 7 and pool.num_free == 7
    taken = pool.alloc(7)
    assert taken is not None and int(reserved[0]) not in set(taken.tolist())
    assert pool.alloc(1) is None
    pool.free(taken)
    assert pool.num_free == pool.capacity


def test_the_request_tables_host_mirror_holds_what_was_written_and_recorded() -> None:
    from pd_cluster.engine.req_table import ReqSlotTable

    table = ReqSlotTable(4, 64, torch.device("cpu"), host_mirror=True)
    assert ReqSlotTable(4, 16, torch.device("cpu"))._host is None  # on the CPU the table is read directly
    row = table.alloc_row()
    table.write(row, 0, torch.tensor([7, 8, 9]))
    # A captured step scatters its inputs into the device table; the host records the same writes.
    table.table[[row, row], [3, 4]] = torch.tensor([10, 11])
    table.record([row, row], [3, 4], [10, 11])
    assert table.read(row, 5).tolist() == [7, 8, 9, 10, 11] == table.table[row, :5].tolist()
    many = list(range(5, 15)) + list(range(15, 40))  # past the one-by-one count: indexed at once
    table.table[row, 5:40] = torch.tensor(many)
    table.record([row] * 35, list(range(5, 40)), many)
    assert table.read(row, 40).tolist() == [7, 8, 9, 10, 11] + many == table.table[row, :40].tolist()
    got = table.read(row, 5)
    got[0] = -1  # a copy: the mirror is not changed through it
    assert table.read(row, 1).tolist() == [7]


def test_take_hands_out_numpy_slots_from_the_same_free_list_as_alloc(pool: KVPool) -> None:
    """A step's slots come as numpy arrays (no torch op a step); both ways draw from one list."""
    taken = pool.take(5)
    allocated = pool.alloc(3)
    assert taken is not None and allocated is not None
    assert taken.dtype == np.int64 and isinstance(allocated, torch.Tensor)
    assert set(taken.tolist()).isdisjoint(allocated.tolist())
    assert pool.num_free == 16 - 8
    assert pool.take(9) is None and pool.num_free == 8
    pool.free(torch.from_numpy(taken))
    assert pool.num_free == 13


def test_a_scheduled_step_keeps_numpy_slots_and_lists_them_in_step_order() -> None:
    from pd_cluster.engine.scheduler import ScheduledStep

    step = ScheduledStep()
    assert step.slot_list() == []
    step.add(object(), 2, torch.tensor([7, 3]), sample=True)  # torch from callers outside the scheduler
    assert step.slot_list() == [7, 3]
    step.add(object(), 1, np.array([11], dtype=np.int64), sample=True)
    assert all(isinstance(s, np.ndarray) for s in step.new_slots)
    assert step.slot_list() == [7, 3, 11]


def test_a_pinned_ring_copies_what_was_staged_whatever_the_length_and_destination() -> None:
    """Its copies reuse views per (buffer, length, destination): every copy still carries the
    values just staged, to the destination named, and only its first ``n`` elements."""
    from pd_cluster.engine.device_copy import PinnedRing

    ring = PinnedRing(16, torch.int64, torch.device("cpu"))
    first, second = torch.full((16,), -1, dtype=torch.int64), torch.full((16,), -2, dtype=torch.int64)
    for step in range(3 * PinnedRing.DEPTH):
        n = 3 + step % 5
        dest = first if step % 2 else second
        before = dest.clone()
        ring.stage()[:n] = np.arange(n) + 100 * step
        ring.copy(dest, n)
        assert dest[:n].tolist() == (np.arange(n) + 100 * step).tolist()
        assert torch.equal(dest[n:], before[n:])
