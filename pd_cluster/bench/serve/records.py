"""One request's measured facts: the vocabulary shared by the client, the metrics and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What happened to one request, in seconds relative to the run's start.

    ``chunk_times`` are the arrival times of streamed chunks that carried content (text), so
    TTFT is the first of them minus ``start`` and ITL the gaps between them. ``output_tokens``
    is the server's ``usage.completion_tokens`` when it reports usage, else the tokenizer's count
    of the streamed text; ``requested_output_tokens`` is what ``max_tokens`` asked for.
    """

    index: int
    conversation: int = 0
    turn: int = 0
    scheduled: float = 0.0
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    requested_prompt_tokens: int = 0
    output_tokens: int = 0
    requested_output_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_message: str | None = None
    text: str = ""
    #: The master's id for it (its ``X-Request-Id`` answer), to find it in the master's request log.
    request_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM): (e2e - ttft) / (output_tokens - 1)."""
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    def to_json(self, include_text: bool = False) -> dict[str, Any]:
        doc = asdict(self)
        if not include_text:
            doc.pop("text")
        doc.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, itl=self.itl)
        return doc
