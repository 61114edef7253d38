"""Grammar specs checked without a model: what the master asks before any node sees a request.

Kept apart from :mod:`pd_cluster.engine.grammar` (the engine's masks, which need torch) so the
master, which only validates, does not import torch.
"""

from __future__ import annotations

import json
from typing import Any

from pd_cluster.sampling_params import StructuredOutput

#: JSON as the model writes it: no free whitespace (a small model under a grammar that allows it
#: can pad forever), and the separators of ``json.dumps``, the form most training text has.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled (the message says why)."""


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec``; raises :class:`GrammarError`."""
    import llguidance

    schema: Any = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.json_schema or "null")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def check_spec(spec: StructuredOutput) -> None:
    """Raise :class:`GrammarError` naming what is wrong when ``spec`` does not compile (the master
    asks before any node sees the request; no tokenizer is needed)."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(spec), None)
    if is_error:
        raise GrammarError(f"invalid JSON schema: {messages[0] if messages else 'rejected by the grammar compiler'}")
