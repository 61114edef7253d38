"""The transformers reference shared through a store: what one process computed, another reads."""

from __future__ import annotations

from pathlib import Path

from tests.reference import GreedyReference

PROMPT = [1, 9690, 198, 2683, 314, 216, 34, 31, 34, 47]


def test_a_stored_continuation_is_read_without_the_model_and_a_longer_one_is_computed(default_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    first = GreedyReference(default_model_dir, tmp_path)
    computed = first.greedy(PROMPT, 6)
    assert len(computed) == 6 and len(list(tmp_path.glob("*.json"))) == 1

    second = GreedyReference(default_model_dir, tmp_path)
    assert second.greedy(PROMPT, 4) == computed[:4]
    assert second._model is None  # read from the store: transformers was not even loaded

    longer = second.greedy(PROMPT, 9)
    assert second._model is not None and longer[:6] == computed
    third = GreedyReference(default_model_dir, tmp_path)
    assert third.greedy(PROMPT, 9) == longer and third._model is None  # the longer one replaced the shorter
