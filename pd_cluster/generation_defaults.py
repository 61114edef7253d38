"""The sampling defaults a model ships in its generation_config.json.

Qwen3 and Llama-3 instruct checkpoints name the temperature, top_p and top_k they were tuned to
sample with; as vLLM's server does, these replace SamplingParams' defaults for every request
that leaves them unset (a request's own values win). ``do_sample`` is not read: greedy is asked
for with ``temperature: 0``, as with any OpenAI server.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from pd_cluster.sampling_params import SamplingParams

#: generation_config.json keys that are SamplingParams fields of the same name and meaning.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """The sampling fields ``model_dir/generation_config.json`` sets (empty without the file);
    ValueError naming the field for a value SamplingParams refuses."""
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    defaults = {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValidationError as exc:
        fields = ", ".join(str(e["loc"][0]) for e in exc.errors() if e["loc"])
        raise ValueError(f"{file.name}: {fields} out of range: {exc.errors()[0]['msg']}") from None
    return defaults
