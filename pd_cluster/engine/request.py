"""One request's state inside an engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pd_cluster.engine.grammar import GrammarState
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.prompt_logprobs import PromptLogprobsState
from pd_cluster.engine.radix_cache import RadixNode
from pd_cluster.engine.sampler import SamplingState
from pd_cluster.protocol import TokenLogprob


#: In ``output_token_ids``: a token sampled on the device and not yet read back (pipelined steps).
PENDING = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids, sampling state and KV bookkeeping of one request.

    ``num_computed`` tokens of ``all_token_ids`` have their KV in the pool, at the slots the
    engine's request-to-slot table holds in row ``row``. The next step computes the rest; the
    last of them yields the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingState
    output: OutputProcessor
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    row: int = -1
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    prefix_node: RadixNode | None = None  # pinned prefix-cache node
    num_preemptions: int = 0
    admitted_once: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: The prompt's logprobs as its chunks compute them (None: not asked for).
    prompt_logprobs: PromptLogprobsState | None = None
    finish_reason: str | None = None
    #: When the scheduler first took it into a step (``time.monotonic()``).
    admitted_time: float | None = None
    first_token_time: float | None = None
    #: Keep the KV after the request finishes (a prefill node still has to send it).
    hold_kv: bool = False
    #: Stop after the first sampled token (a prefill node's job ends there).
    prefill_only: bool = False
    #: Prefill it in as few steps as the step budget allows, past the scheduler's
    #: ``prefill_chunk_tokens``: a prompt whose KV a prefill node streams layer by layer while
    #: computing it (the stream rides on the step that completes the prompt).
    whole_prefill: bool = False
    #: The matcher of the grammar the output must follow (``params.structured``); None: free text.
    grammar: GrammarState | None = None
    #: Pipelined steps: the row of this request's newest token in the batch still on the device
    #: (its place in the output holds :data:`PENDING` until the token is read back).
    pending_index: int | None = None
    #: Pipelined steps: the token on the device is the last this request can produce (its length
    #: limit): the scheduler does not run it again.
    last_token_pending: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.sampling.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Slice of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        out = self.sampling.output_token_ids
        if start >= n_prompt:
            return out[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + out[: end - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.sampling.output_token_ids

    @property
    def remaining_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def max_tokens_left(self) -> int:
        return max(self.sampling.params.max_tokens - len(self.sampling.output_token_ids), 0)

    @property
    def waits_for_token(self) -> bool:
        """Its newest token is still on the device (it cannot be prefilled from the host)."""
        out = self.sampling.output_token_ids
        return bool(out) and out[-1] == PENDING

    def advance_grammar(self) -> bool:
        """Take the newest output tokens into the grammar's matcher; True when the grammar is
        complete (never without one)."""
        return self.grammar is not None and self.grammar.advance(self.sampling.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
