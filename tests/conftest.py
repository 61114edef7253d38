"""Shared fixtures: the real default model (converted once per session) and its reference."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pd_cluster.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def served_cluster(default_model_dir, tmp_path_factory):
    """A real cluster on CPU (master logging JSON lines, prefill node p0, decode node d0), shared by
    the test files that leave it as they found it: one start instead of one per file."""
    from tests.cluster_harness import Cluster, wait_until

    c = Cluster(default_model_dir, tmp_path_factory.mktemp("served-cluster"))
    try:
        c._spawn("master", ["master", "--host", "127.0.0.1", "--port", str(c.port), "--model", str(default_model_dir),
                            "--log-format", "json"])
        wait_until(lambda: c._get("/livez") == 200, 60, "the master to serve")
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        wait_until(lambda: c.health()[0] == 200, 60, "a warm pair")
        yield c
    finally:
        c.stop()


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
