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
    assert make_one_shot("auto", None, None, 0, 2, device, timeout) is None
    assert make_one_shot("nccl", None, None, 0, 2, device, timeout) is None
    with pytest.raises(RuntimeError, match="oneshot needs GPUs"):
        make_one_shot("oneshot", None, None, 1, 2, device, timeout)
