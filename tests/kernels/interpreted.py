"""A test file's Triton cases run again in Triton's interpreter, in a child process: Triton reads
``TRITON_INTERPRET`` when it is first imported, so the flag must be set before anything imports
it, and the parent process has imported it long before."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

#: Whether this process runs the kernels interpreted (the child of :func:`run_in_interpreter`).
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]


#: Runs started ahead by :func:`start_interpreted`, by test file.
_STARTED: dict[Path, tuple[subprocess.Popen, IO[str]]] = {}


def _command(test_file: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]


def _environment() -> dict[str, str]:
    # One compute thread: a run started ahead shares the cores with the rest of the session.
    return {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def start_interpreted(test_files: Iterable[Path]) -> None:
    """Start each file's interpreted run now, at the lowest CPU priority: the interpreter needs
    minutes of CPU, and it takes them from what the session's other tests leave idle (they wait
    on sockets and child processes) instead of adding them to the session's time. Its test then
    only waits for the result (:func:`run_in_interpreter`)."""
    for test_file in test_files:
        path = Path(test_file).resolve()
        if path in _STARTED:
            continue
        output = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(_command(path), cwd=REPO_ROOT, env=_environment(), stdout=output,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(19))
        _STARTED[path] = (proc, output)


def stop_interpreted() -> None:
    """End the runs started ahead that no test waited for (a session stopped early)."""
    while _STARTED:
        proc, output = _STARTED.popitem()[1]
        proc.kill()
        proc.wait()
        output.close()


def run_in_interpreter(test_file: str | Path, min_passed: int = 20) -> None:
    """Run ``test_file`` under ``TRITON_INTERPRET=1`` (or wait for the run started ahead); fail
    unless it passed at least ``min_passed`` tests and skipped none."""
    import triton  # noqa: F401  # a test dependency: its absence must fail, not skip

    path = Path(test_file).resolve()
    started = _STARTED.pop(path, None)
    if started is None:
        proc = subprocess.run(_command(path), cwd=REPO_ROOT, env=_environment(), capture_output=True, text=True,
                              timeout=600)
        returncode, stdout = proc.returncode, proc.stdout + proc.stderr
    else:
        running, output = started
        try:
            returncode = running.wait(timeout=600)
        finally:
            running.kill()
        output.seek(0)
        stdout = output.read()
        output.close()
    report = stdout[-8000:]
    assert returncode == 0, report
    summary = next((line for line in reversed(stdout.strip().splitlines()) if " in " in line and "passed" in line), "")
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed and "skipped" not in summary, report
