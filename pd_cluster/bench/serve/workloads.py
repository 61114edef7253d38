"""What a run sends: conversations of turns, built from the model's tokenizer and a seed.

Every workload is a list of :class:`Conversation`; single-request workloads are conversations
of one turn, so the runner has one shape to drive. Prompts are random token ids drawn from the
tokenizer's ordinary vocabulary (special and added tokens left out, so no prompt ends a turn
early), decoded to text and trimmed so they re-encode to the intended length; with
``prompt_format="token-ids"`` the ids themselves are sent; with ``prompt_vocab="words"`` they
are drawn from the whole-word tokens only (:mod:`pd_cluster.bench.words`), so the text is
words that encode back to exactly those ids, as real text does. One seed gives the same prompts.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.bench.serve.config import PromptVocab, ServeBenchConfig
from pd_cluster.bench.words import whole_word_ids

logger = logging.getLogger(__name__)

_TEXT_FIT_TRIES = 4
_GROUP_SEPARATOR = "\n\n"


@dataclass
class Turn:
    """One request: for completions ``prompt`` is the whole prompt; for chat it is the user message."""

    prompt: str | list[int]
    input_len: int
    max_tokens: int


@dataclass
class Conversation:
    """Turns sent one after another, each after the previous answer; ``system`` opens a chat."""

    index: int
    turns: list[Turn]
    system: str | None = None
    group: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class TokenSource:
    """Random prompts of a given token length from one tokenizer and one seeded stream."""

    def __init__(self, tokenizer: Any, rng: random.Random, vocab: PromptVocab = "any") -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        if vocab == "words":
            self.vocab = whole_word_ids(tokenizer)
            return
        excluded = set(getattr(tokenizer, "all_special_ids", []) or [])
        excluded |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        size = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
        self.vocab = [i for i in range(size) if i not in excluded]
        if not self.vocab:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")

    def ids(self, n: int) -> list[int]:
        return self.rng.choices(self.vocab, k=n)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n: int) -> str:
        """Text that re-encodes to ``n`` tokens where the tokenizer allows (close to it otherwise).

        Decoding random ids and encoding the text again rarely gives the same ids (merges
        change at the seams), so the text is cut to ``n`` re-encoded tokens and topped up.
        """
        text = self.tokenizer.decode(self.ids(n))
        for _ in range(_TEXT_FIT_TRIES):
            ids = self.encode(text)
            if len(ids) == n:
                return text
            if len(ids) > n:
                text = self.tokenizer.decode(ids[:n])
            else:
                text = text + self.tokenizer.decode(self.ids(n - len(ids)))
        return text

    def prompt(self, n: int, as_ids: bool) -> str | list[int]:
        return self.ids(n) if as_ids else self.text(n)


def sample_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length drawn uniformly from [mean * (1 - r), mean * (1 + r)], at least 1."""
    low = max(1, round(mean * (1.0 - range_ratio)))
    high = max(low, round(mean * (1.0 + range_ratio)))
    return rng.randint(low, high)


def build_workload(config: ServeBenchConfig, tokenizer: Any, seed: int) -> list[Conversation]:
    """The conversations of one run; the same (config, tokenizer, seed) gives the same ones."""
    rng = random.Random(seed)
    source = TokenSource(tokenizer, rng, config.prompt_vocab)
    builder = _BUILDERS[config.workload]
    conversations = builder(config, source, rng)
    logger.info("workload %s: %d conversations, %d requests", config.workload, len(conversations),
                sum(len(c.turns) for c in conversations))
    return conversations


def _as_ids(config: ServeBenchConfig) -> bool:
    return config.prompt_format == "token-ids" and config.endpoint == "completions"


def _random(config: ServeBenchConfig, source: TokenSource, rng: random.Random) -> list[Conversation]:
    out = []
    for i in range(config.num_requests):
        n = sample_length(rng, config.input_len, config.range_ratio)
        m = sample_length(rng, config.output_len, config.range_ratio)
        out.append(Conversation(i, [Turn(source.prompt(n, _as_ids(config)), n, m)]))
    return out


def _mixed(config: ServeBenchConfig, source: TokenSource, rng: random.Random) -> list[Conversation]:
    out = []
    for i in range(config.num_requests):
        long = rng.random() < config.long_fraction
        n = sample_length(rng, config.long_input_len if long else config.input_len, config.range_ratio)
        m = sample_length(rng, config.long_output_len if long else config.output_len, config.range_ratio)
        out.append(Conversation(i, [Turn(source.prompt(n, _as_ids(config)), n, m)], meta={"long": long}))
    return out


def _shared_prefix(config: ServeBenchConfig, source: TokenSource, rng: random.Random) -> list[Conversation]:
    as_ids = _as_ids(config)
    prefixes = [source.prompt(config.prefix_len, as_ids) for _ in range(config.num_groups)]
    out = []
    for i in range(config.num_requests):
        group = i % config.num_groups
        n = sample_length(rng, config.input_len, config.range_ratio)
        m = sample_length(rng, config.output_len, config.range_ratio)
        prefix, suffix = prefixes[group], source.prompt(n, as_ids)
        if config.endpoint == "chat":
            out.append(Conversation(i, [Turn(suffix, n, m)], system=str(prefix), group=group))
        elif as_ids:
            out.append(Conversation(i, [Turn(list(prefix) + list(suffix), config.prefix_len + n, m)], group=group))
        else:
            prompt = f"{prefix}{_GROUP_SEPARATOR}{suffix}"
            out.append(Conversation(i, [Turn(prompt, source.count(prompt), m)], group=group))
    return out


def _multi_turn(config: ServeBenchConfig, source: TokenSource, rng: random.Random) -> list[Conversation]:
    out = []
    for c in range(config.num_conversations):
        turns = []
        for t in range(config.turns):
            first = config.first_turn_len if t == 0 and config.first_turn_len else config.input_len
            n = sample_length(rng, first, config.range_ratio)
            m = sample_length(rng, config.output_len, config.range_ratio)
            turns.append(Turn(source.text(n), n, m))
        out.append(Conversation(c, turns))
    return out


_BUILDERS = {"random": _random, "mixed": _mixed, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn}
