"""The beam search reference: transformers' ``generate(num_beams=...)`` in float32 on the CPU.

Results are written to a store folder (one file a prompt and setting) and read back from there, as
:class:`tests.reference.GreedyReference` does: a test run computes each once."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.reference import load_reference_model

#: Sixteen short chat messages (beam search over each is a few forwards of four rows).
BEAM_MESSAGES = [
    "Hi", "What is 2+2?", "Write a haiku about the sea.", "Name three primary colors.",
    "What is the capital of France?", "Tell me a joke.", "How do plants make food?", "Say hello in Spanish.",
    "What is a prime number?", "Give me a synonym for happy.", "Why is the sky blue?", "Count to five.",
    "What does a CPU do?", "Describe a cat in one sentence.", "What is water made of?", "Recommend a book.",
]


@dataclass
class ReferenceBeam:
    token_ids: list[int]
    score: float


class BeamReference:
    def __init__(self, model_dir: Path, store: Path | None = None) -> None:
        self.model_dir = model_dir
        self.store = store
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = load_reference_model(self.model_dir)
        return self._model

    def _path(self, key: dict) -> Path | None:
        if self.store is None:
            return None
        return self.store / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json")

    def beams(self, prompt: list[int], num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
              early_stopping: bool = True) -> list[ReferenceBeam]:
        """transformers' ``num_beams`` best beams, best first: generated ids (pad after an EOS cut)
        and ``sequences_scores``."""
        key = {"prompt": prompt, "beams": num_beams, "new": max_new_tokens, "lp": length_penalty,
               "early": early_stopping}
        path = self._path(key)
        if path is not None and path.exists():
            record = json.loads(path.read_text())
            if record["key"] == key:
                return [ReferenceBeam(**b) for b in record["beams"]]
        beams = self._compute(prompt, num_beams, max_new_tokens, length_penalty, early_stopping)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps({"key": key, "beams": [b.__dict__ for b in beams]}))
            os.replace(partial, path)
        return beams

    def _compute(self, prompt: list[int], num_beams: int, max_new_tokens: int, length_penalty: float,
                 early_stopping: bool) -> list[ReferenceBeam]:
        model = self.model
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=num_beams, num_return_sequences=num_beams, length_penalty=length_penalty,
                early_stopping=early_stopping, do_sample=False, max_new_tokens=max_new_tokens,
                output_scores=True, return_dict_in_generate=True,
            )
        beams = []
        for seq, score in zip(out.sequences, out.sequences_scores):
            generated = seq[len(prompt):].tolist()
            cut = next((i + 1 for i, t in enumerate(generated) if t in eos_ids), len(generated))
            beams.append(ReferenceBeam(generated[:cut], float(score)))
        return beams
