"""Shared fixtures: the real default model (converted once per session) and its reference."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread a process under pytest-xdist: two workers (and the clusters they start) share
    # the runner's cores, and torch's default (a thread per core in each process) oversubscribes them
    # into spinning. Set before torch loads, so every child started from here inherits it too.
    os.environ["OMP_NUM_THREADS"] = "1"

#: Fixtures whose users are kept on one pytest-xdist worker: Ray (one local Ray at a time, each
#: sized for the whole machine) and the session's shared cluster (started once, not once a worker).
SHARED_BY_FILES = ("ray_address", "served_cluster")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``-n N --dist loadgroup`` a worker runs a whole file, so module-scoped clusters start once;
    the files using a fixture of :data:`SHARED_BY_FILES` go to one worker together. Runs before
    pytest-xdist reads the groups; without xdist the marks change nothing."""
    files: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        files[item.nodeid.split("::", 1)[0]].append(item)
    for path, file_items in files.items():
        shared = [name for name in SHARED_BY_FILES if any(name in item.fixturenames for item in file_items)]
        group = shared[0] if shared else path
        for item in file_items:
            item.add_marker(pytest.mark.xdist_group(group))


#: The tests that run a file's cases in Triton's interpreter end so (tests/kernels/interpreted.py).
INTERPRETED_SUFFIX = "_in_the_interpreter"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the interpreted runs of the selected files now, in the background at the lowest
    priority (:func:`tests.kernels.interpreted.start_interpreted`). Not under pytest-xdist, whose
    workers each collect every test, nor inside an interpreted run."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    files = sorted({Path(str(item.path)) for item in session.items if item.name.endswith(INTERPRETED_SUFFIX)})
    if files:
        from tests.kernels.interpreted import start_interpreted

        start_interpreted(files)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.kernels.interpreted import stop_interpreted

    stop_interpreted()


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
def hf_reference(default_model_dir, tmp_path_factory):
    """Greedy continuation by transformers (float32, CPU) with EOS neither stopping nor masked,
    computed once a test run: pytest-xdist's workers share their results through the run's
    temporary folder (the parent of each worker's own)."""
    from tests.reference import GreedyReference

    return GreedyReference(default_model_dir, _run_temp(tmp_path_factory) / "greedy-reference" / default_model_dir.name)


@pytest.fixture(scope="session")
def beam_reference(default_model_dir, tmp_path_factory):
    """transformers' beam search (float32, CPU) on the default model, computed once a test run and
    shared as :func:`hf_reference` is."""
    from tests.beam_reference import BeamReference

    return BeamReference(default_model_dir, _run_temp(tmp_path_factory) / "beam-reference" / default_model_dir.name)


def _run_temp(tmp_path_factory) -> Path:
    """The run's temporary folder: pytest-xdist's workers share the parent of their own."""
    run_temp = tmp_path_factory.getbasetemp()
    return run_temp.parent if os.environ.get("PYTEST_XDIST_WORKER") else run_temp


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """Eight chat prompts of very different lengths, as token ids."""
    from tests.reference import CHAT_MESSAGES

    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for m in CHAT_MESSAGES
    ]
