"""The correctness reference: a plain greedy loop over transformers' model with its KV cache."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import torch

_LONG_CONTEXT = " ".join(
    f"Section {i}: the committee reviewed item {i * 7 % 13} and noted that the river level was {i * 3 % 11} meters."
    for i in range(40)
)

CHAT_MESSAGES = [
    "Hi",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three primary colors and explain how mixing them produces secondary colors.",
    "Explain, step by step and with an example, how a hash map handles collisions using chaining "
    "and what happens to lookup time as the load factor grows.",
    "Translate to French: The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Summarize the following notes in two sentences. " + _LONG_CONTEXT,
    "List the planets of the solar system in order from the sun, with one fact about each.",
]


def load_reference_model(model_dir: Path):
    """transformers' model of ``model_dir`` in float32 on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


class GreedyReference:
    """Greedy continuations, each computed by one loop per prompt that is extended, never rerun: a
    request for fewer tokens than already computed is answered with a prefix (the first ``n`` tokens
    of a greedy loop do not depend on how far it runs), one for more continues the same loop from the
    logits and KV cache it stopped at (the very forwards a fresh, longer loop would run).

    With a ``store`` folder, every continuation computed is also written there and one found there is
    read instead of computed: the processes of one test run (pytest-xdist's workers) share what any of
    them computed. transformers' model is loaded on the first continuation that is computed."""

    #: Prompts whose loop state (last logits, KV cache) is kept to be extended; others keep tokens only.
    KEEP_STATES = 24

    def __init__(self, model_dir: Path, store: Path | None = None) -> None:
        self.model_dir = model_dir
        self.store = store
        self._model = None
        self._tokens: dict[tuple[int, ...], list[int]] = {}
        self._states: OrderedDict[tuple[int, ...], tuple[torch.Tensor, object]] = OrderedDict()

    @property
    def model(self):
        if self._model is None:
            self._model = load_reference_model(self.model_dir)
        return self._model

    def _stored_path(self, prompt: tuple[int, ...]) -> Path | None:
        if self.store is None:
            return None
        return self.store / (hashlib.sha256(json.dumps(prompt).encode()).hexdigest() + ".json")

    def _read_stored(self, prompt: tuple[int, ...]) -> list[int]:
        path = self._stored_path(prompt)
        if path is None or not path.exists():
            return []
        record = json.loads(path.read_text())
        return record["tokens"] if tuple(record["prompt"]) == prompt else []

    def _write_stored(self, prompt: tuple[int, ...], tokens: list[int]) -> None:
        """Written whole under a private name, then renamed: a reader sees the old file or the new."""
        path = self._stored_path(prompt)
        if path is None or len(self._read_stored(prompt)) >= len(tokens):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"prompt": list(prompt), "tokens": tokens}))
        os.replace(partial, path)

    @torch.inference_mode()
    def _extend(self, prompt: tuple[int, ...], max_new_tokens: int) -> None:
        state = self._states.pop(prompt, None)
        tokens = self._tokens.get(prompt) if state is not None else None
        if tokens is None:  # a fresh loop (first ask, or its state was dropped)
            out = self.model(torch.tensor([prompt]), use_cache=True)
            logits, past, tokens = out.logits[0, -1].clone(), out.past_key_values, []
        else:
            logits, past = state
        while len(tokens) < max_new_tokens:
            token = int(logits.argmax())
            tokens.append(token)
            out = self.model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1].clone(), out.past_key_values
        self._tokens[prompt] = tokens
        self._states[prompt] = (logits, past)
        while len(self._states) > self.KEEP_STATES:
            self._states.popitem(last=False)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = tuple(prompt)
        if len(self._tokens.get(key, ())) < max_new_tokens and key not in self._states:
            stored = self._read_stored(key)
            if len(stored) > len(self._tokens.get(key, ())):
                self._tokens[key] = stored
        if len(self._tokens.get(key, ())) < max_new_tokens:
            self._extend(key, max_new_tokens)
            self._write_stored(key, self._tokens[key])
        elif key in self._states:
            self._states.move_to_end(key)
        return list(self._tokens[key][:max_new_tokens])


def prompt_logprobs(model, prompt: list[int], top: int = 0) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """transformers' log-softmax (float32) of each prompt token after the first given the ones
    before it, and the top ``top`` (ids, logprobs) at each of those positions."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()
    if not top:
        return chosen, [], []
    best = logprobs.topk(top, dim=-1)
    return chosen, best.indices.tolist(), best.values.tolist()
