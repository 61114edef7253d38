"""Every machine resolves the same versions: constraints.txt pins each dependency pyproject.toml
names (runtime and every extra), within its range, and each `pip install` of README's commands and
.ci/run is made under it. A dependency added without refreshing the pins (`bash .ci/lock`) fails here.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
        found[canonicalize_name(name)] = Version(version)
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        listed.extend(extra)
    return [Requirement(text) for text in listed]


@pytest.mark.parametrize("requirement", declared(), ids=str)
def test_each_declared_dependency_is_pinned_within_its_range(requirement: Requirement) -> None:
    pinned = pins().get(canonicalize_name(requirement.name))
    assert pinned is not None, f"{requirement.name} has no pin in constraints.txt: run `bash .ci/lock`"
    assert requirement.specifier.contains(pinned, prereleases=True), (
        f"constraints.txt pins {requirement.name}=={pinned}, outside pyproject's {requirement.specifier}"
    )


def shell_text(path: Path) -> str:
    """A shell script as it is; of a markdown page, its ```bash / ```sh blocks."""
    text = path.read_text()
    if path.suffix != ".md":
        return text
    return "\n".join(re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.S | re.M))


def pip_installs(text: str) -> list[list[str]]:
    """The argument lists of every `pip install` in shell text (commands split at && ; and |)."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;|\|", line):
            words = shlex.split(part, comments=True) if part.strip() else []
            if words[:2] == ["pip", "install"]:
                commands.append(words)
    return commands


def test_readmes_test_command_is_the_whole_set_up_and_run() -> None:
    """README's second command is .ci/run: on a fresh machine without Chromium it installs the
    browser the status page's test drives, the pinned packages, then runs the tests."""
    blocks = re.findall(r"^```(?:bash|sh)\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)
    assert len(blocks) >= 2, "README's quick start has lost its two commands"
    assert blocks[1].strip() == "bash .ci/run"
    ci = (REPO / ".ci/run").read_text()
    for step in ("apt-get install", "chromium chromium-driver", "pip install -c constraints.txt", "python -m pytest"):
        assert step in ci, f".ci/run lost its step {step!r}"


@pytest.mark.parametrize("source", ["README.md", ".ci/run", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_every_pip_install_of_the_docs_and_ci_uses_the_constraints(source: str) -> None:
    commands = pip_installs(shell_text(REPO / source))
    if source in ("README.md", ".ci/run"):
        assert commands, f"{source} has no pip install"
    for words in commands:
        assert any(a == "-c" and b == "constraints.txt" for a, b in zip(words, words[1:])), (
            f"{source}: `{' '.join(words)}` resolves without constraints.txt"
        )
