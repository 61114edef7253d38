"""A test file's Triton cases run again in Triton's interpreter, in a child process: Triton reads
``TRITON_INTERPRET`` when it is first imported, so the flag must be set before anything imports
it, and the parent process has imported it long before."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: Whether this process runs the kernels interpreted (the child of :func:`run_in_interpreter`).
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_in_interpreter(test_file: str | Path, min_passed: int = 20) -> None:
    """Run ``test_file`` under ``TRITON_INTERPRET=1``; fail unless it passed at least
    ``min_passed`` tests and skipped none."""
    import triton  # noqa: F401  # a test dependency: its absence must fail, not skip

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed and "skipped" not in summary, report
