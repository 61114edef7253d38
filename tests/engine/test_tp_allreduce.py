"""Which messages the one-shot all-reduce takes, and where it refuses to run (CPU; its sums are
checked on two GPUs in tests/gpu/test_tp_allreduce_gpu.py)."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

from pd_cluster.engine.tp_allreduce import fits, local_reason, make_one_shot, one_shot_limit


def test_a_decode_row_fits_and_prefill_sized_or_odd_messages_do_not():
    limit = one_shot_limit(2)
    assert fits(torch.empty(1, 4096, dtype=torch.bfloat16), limit)
    assert fits(torch.empty(64, 8192, dtype=torch.bfloat16), limit)  # a 70B decode batch of 64: 1 MiB
    assert not fits(torch.empty(65, 8192, dtype=torch.bfloat16), limit)
    assert not fits(torch.empty(3, dtype=torch.bfloat16), limit)  # not whole 16-byte vectors
    assert not fits(torch.empty(8, 16, dtype=torch.bfloat16)[:, ::2], limit)  # not contiguous
    assert one_shot_limit(2) > one_shot_limit(4) > one_shot_limit(8)


def test_on_cpu_oneshot_is_refused_and_auto_keeps_the_groups_own():
    timeout = dt.timedelta(seconds=5)
    device = torch.device("cpu")
    assert local_reason(device, 0, 2) == "device cpu is not a GPU"
    # On the CPU no rank asks the others: no store or group is touched.
    assert make_one_shot("auto", None, None, 0, 2, device, timeout, None) is None
    assert make_one_shot("nccl", None, None, 0, 2, device, timeout, None) is None
    with pytest.raises(RuntimeError, match="oneshot needs GPUs"):
        make_one_shot("oneshot", None, None, 1, 2, device, timeout, None)


def test_a_nodes_model_group_is_found_by_name_as_symmetric_memory_looks_it_up():
    """The node makes its groups without ``init_process_group``; symmetric memory resolves a group
    by name, so the node registers its model group (here a one-rank gloo group on the CPU)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group

    from pd_cluster.engine.tp_allreduce import register_group
    from pd_cluster.engine.tp_group import make_store

    store = make_store("127.0.0.1", 0, 1, leader=True)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("model", store), 0, 1, dt.timedelta(seconds=30))
    name = f"pd-cluster-tp-{store.port}"
    kept = register_group(name, store, 0, 1, torch.device("cpu"), backend)
    group = _resolve_process_group(name)
    assert group is kept
    assert (group.rank(), group.size(), group.group_name) == (0, 1, name)
    tensor = torch.arange(4.0)
    group.allreduce([tensor]).wait()
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
