"""The correctness reference: a plain greedy loop over transformers' model with its KV cache."""

from __future__ import annotations

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


class GreedyReference:
    """Greedy continuations, each computed by one loop per prompt that is extended, never rerun: a
    request for fewer tokens than already computed is answered with a prefix (the first ``n`` tokens
    of a greedy loop do not depend on how far it runs), one for more continues the same loop from the
    logits and KV cache it stopped at (the very forwards a fresh, longer loop would run)."""

    #: Prompts whose loop state (last logits, KV cache) is kept to be extended; others keep tokens only.
    KEEP_STATES = 24

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self._tokens: dict[tuple[int, ...], list[int]] = {}
        self._states: OrderedDict[tuple[int, ...], tuple[torch.Tensor, object]] = OrderedDict()

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
        if len(self._tokens.get(key, ())) < max_new_tokens:
            self._extend(key, max_new_tokens)
        elif key in self._states:
            self._states.move_to_end(key)
        return list(self._tokens[key][:max_new_tokens])
