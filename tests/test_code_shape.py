"""The paths every request takes stay readable: the handover, the prefill node's job and the
master's request lifecycle are small functions, and the prefill service one lifecycle, so a new
path (a re-shard, a quantized KV) is one more sender rather than another copy of the job.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Where no function may grow past MAX_FUNCTION_LINES.
SMALL_FUNCTIONS = ("pd_cluster/handover/*.py", "prefill_node/*.py", "master/relay*.py")
MAX_FUNCTION_LINES = 60
MAX_SERVICE_LINES = 400


def functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(f"{path.relative_to(REPO)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("pattern", SMALL_FUNCTIONS)
def test_no_function_on_a_request_path_is_long(pattern: str) -> None:
    files = sorted(REPO.glob(pattern))
    assert files, f"{pattern} matches no file"
    long = [f"{name} ({lines} lines)" for path in files for name, lines in functions(path) if lines > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_prefill_service_stays_one_lifecycle_long() -> None:
    lines = len((REPO / "prefill_node" / "service.py").read_text().splitlines())
    assert lines < MAX_SERVICE_LINES, f"prefill_node/service.py has {lines} lines"
