"""A model directory's tokenizer, loaded the same way by the master (chat templates, prompts) and
the engine (detokenizing, EOS ids)."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load the Hugging Face tokenizer of a model directory: the fast one when the directory has a
    tokenizer.json, with the chat template it ships."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
