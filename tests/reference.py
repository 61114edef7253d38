"""The correctness reference: a plain greedy loop over transformers' model with its KV cache."""

from __future__ import annotations

from functools import lru_cache
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
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def _run(self, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = self.model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        return tokens

    @lru_cache(maxsize=256)
    def _cached(self, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        return tuple(self._run(prompt, max_new_tokens))

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return list(self._cached(tuple(prompt), max_new_tokens))
