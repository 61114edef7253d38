"""Fixtures the handover tests share."""

from __future__ import annotations

import pytest

from pd_cluster.transfer import ipc


@pytest.fixture
def shm_offered():
    """CPU pools in the host's shared memory offered: how a D rank's pool, in its own process,
    reaches P here (CUDA IPC on a GPU)."""
    ipc.offer_kind("shm")
    yield
    ipc.offer_kind("shm", False)
