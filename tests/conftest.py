"""Shared fixtures: the real default model (converted once per session) and its reference."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pd_cluster.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def hf_reference(default_model_dir):
    """Greedy continuation by transformers (float32, CPU) with EOS neither stopping nor masked."""
    from tests.reference import GreedyReference

    return GreedyReference(default_model_dir)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """Eight chat prompts of very different lengths, as token ids."""
    from tests.reference import CHAT_MESSAGES

    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for m in CHAT_MESSAGES
    ]
