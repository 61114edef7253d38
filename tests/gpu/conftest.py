"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory) -> Path:
    """A Llama-3-8B-shaped model with random weights: ``PD_GPU_MODEL_8B`` when it names one
    already written, else written now (~30 s; nothing is downloaded)."""
    given = os.environ.get("PD_GPU_MODEL_8B")
    if given:
        return Path(given)
    from pd_cluster.bench.random_model import write_random_model

    return write_random_model("llama3-8b", tmp_path_factory.mktemp("models") / "llama3-8b-random")
