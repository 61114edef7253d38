"""A model directory's tokenizer, loaded the same way by the master (chat templates, prompts) and
the engine (detokenizing, EOS ids).

``AutoTokenizer`` imports the whole model registry of transformers (generation utilities, torch's
compiler, scikit-learn): about 4 s of every master's and node's start on a small machine. A
directory that names the generic fast tokenizer (``TokenizersBackend``, as the default model's
does) for a model type that AutoTokenizer does not remap is loaded through that class directly;
it is the class AutoTokenizer itself would return there. Anything else goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Declared tokenizer classes that AutoTokenizer loads as ``TokenizersBackend`` (the second is its alias).
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: Model types whose declared tokenizer class AutoTokenizer takes as it is (none of them is on its
#: list of model types with a wrong declared class).
DIRECT_MODEL_TYPES = ("llama",)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load the Hugging Face tokenizer of a model directory: the fast one when the directory has a
    tokenizer.json, with the chat template it ships."""
    if _loads_as_generic_fast(Path(path)):
        from transformers import TokenizersBackend  # what AutoTokenizer returns for these directories

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _loads_as_generic_fast(path: Path) -> bool:
    """Whether a local directory declares a generic fast class where AutoTokenizer would load
    ``TokenizersBackend``: a tokenizer.json, no custom code, a model type it does not remap."""
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (tok_config.get("tokenizer_class") in GENERIC_FAST_CLASSES and "auto_map" not in tok_config
            and "auto_map" not in model_config and model_config.get("model_type") in DIRECT_MODEL_TYPES
            and (path / "tokenizer.json").is_file())
