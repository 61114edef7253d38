"""What the engine reports about requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.protocol import PromptLogprobs, TokenLogprob


@dataclass
class TokenUpdate:
    """One new token of a request, as produced by one engine step."""

    request_id: str
    token_id: int
    text_delta: str
    logprob: TokenLogprob | None
    finish_reason: str | None
    #: Set on the step that ran the request's last prefill chunk.
    first_token: bool = False
    #: With the first token of a request that asked: its prompt's logprobs.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class RequestOutput:
    """The finished result of one prompt (what ``LLM.generate`` returns)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class EngineStats:
    """Counters since the engine started."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0  # tokens that went through the model (prefill and decode)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished_requests: int = 0
    #: Tokens drawn for a request a stop string had already ended (overlap scheduling).
    dropped_tokens: int = 0
    #: Requests asked to prefill at once (``prefill_now``), and those that did, on the side stream.
    prefill_now_requests: int = 0
    side_prefills: int = 0
    #: Launches that waited for the step in flight to near its end (late launch), and how long.
    late_launches: int = 0
    late_launch_wait_s: float = 0.0
    #: Steps launched while the step before might still run (overlap scheduling, on a GPU), and
    #: those of them that found it already ended: the device had waited on the host.
    pipelined_launches: int = 0
    launches_after_idle: int = 0
    extra: dict = field(default_factory=dict)
