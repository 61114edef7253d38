"""The settings of one ``bench serve`` run: plain data, written into the JSON results as they are."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Workload = Literal["random", "shared-prefix", "multi-turn", "mixed"]
Endpoint = Literal["completions", "chat"]
ArrivalMode = Literal["poisson", "bursts"]
PromptFormat = Literal["text", "token-ids"]
PromptVocab = Literal["any", "words"]

WORKLOADS: tuple[str, ...] = ("random", "shared-prefix", "multi-turn", "mixed")


@dataclass
class ServeBenchConfig:
    """Everything that decides what is sent, when, and how it is judged.

    ``rates`` holds one request rate (req/s; ``inf``: all at once) per result; a sweep is several.
    ``model`` names the model (a served name, an HF directory, or "default"; ``None``: the first
    one ``/v1/models`` lists); ``served_model_name`` overrides the name put in requests;
    ``tokenizer`` is the directory or hub name used to build prompts and count tokens.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    endpoint: Endpoint = "completions"
    workload: Workload = "random"
    num_requests: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    # shared-prefix: groups of requests whose prompts begin with the same long system prompt
    num_groups: int = 4
    prefix_len: int = 1024
    # multi-turn: conversations whose history grows; each turn waits for the last answer
    num_conversations: int = 8
    turns: int = 4
    #: multi-turn: tokens of the first turn's message (None: input_len, like every later turn)
    first_turn_len: int | None = None
    # mixed: a fraction of long requests among short ones (short ones use input_len/output_len)
    long_fraction: float = 0.2
    long_input_len: int = 4096
    long_output_len: int = 128
    prompt_format: PromptFormat = "text"
    #: "any": prompts from every ordinary token; "words": from whole-word tokens only, text that
    #: encodes back to the same ids (pd_cluster.bench.words)
    prompt_vocab: PromptVocab = "any"
    ignore_eos: bool = True
    temperature: float = 0.0
    rates: list[float] = field(default_factory=lambda: [math.inf])
    arrival: ArrivalMode = "poisson"
    burstiness: float = 1.0
    burst_size: int = 8
    max_concurrency: int | None = None
    seed: int = 0
    slo_ttft: float = 1.0
    slo_tpot: float = 0.05
    request_timeout: float = 600.0
    save_requests: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        if self.workload == "multi-turn" and self.endpoint != "chat":
            self.endpoint = "chat"  # a conversation's history is a list of chat messages
        if self.prompt_vocab not in ("any", "words"):
            raise ValueError(f"prompt_vocab: {self.prompt_vocab!r}; expected 'any' or 'words'")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError("range_ratio must lie in [0, 1]")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must lie in [0, 1]")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("every rate must be > 0 (inf: all at once)")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        for name in ("num_requests", "input_len", "output_len", "num_groups", "num_conversations", "turns",
                     "long_input_len", "long_output_len", "burst_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def total_requests(self) -> int:
        if self.workload == "multi-turn":
            return self.num_conversations * self.turns
        return self.num_requests

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["api_key"] = "***" if self.api_key else None
        doc["rates"] = [_rate_json(r) for r in self.rates]
        return doc


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_label(rate: float | str) -> str:
    """A rate as people write it: ``4``, ``0.5``, ``inf``."""
    return rate if isinstance(rate, str) else ("inf" if math.isinf(rate) else f"{rate:g}")
