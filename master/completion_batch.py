"""/v1/completions with a list of prompts, or with ``echo``: one relay request per prompt and
choice through the ordinary path (validation, routing, relay, request log), answered as one, as
vLLM and OpenAI answer them (:mod:`master.answers`).

Choice ``index`` is ``prompt_index * n + choice_index``; usage adds up every prompt's. ``echo``
puts each prompt's text before its choices' text (streamed: as each choice's first piece).
``echo`` with ``logprobs`` puts each prompt's logprobs before its choices' (the prompt is scored
where it is prefilled), and ``max_tokens: 0`` with ``echo`` answers the prompt alone
(:mod:`master.prompt_logprobs`). The answer's id (and
``X-Request-Id``) is the first prompt's request id; each prompt has its own line in the request
log and counts as a request of its own. An error on any prompt before its answer starts is the
answer to the whole request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from master import answers
from master.context import MasterContext
from master.errors import APIError, bad_request
from master.metrics import status_of_http
from master.prepare import Prepared, prepare_counted
from master.prompt_logprobs import Echo

#: Prompts one request may carry; each becomes a request of its own.
MAX_PROMPTS = 64

Prompt = str | list[int]


def split_prompts(prompt: Any) -> list[Prompt] | None:
    """The prompts of a ``prompt`` field (None: not a shape this module handles; the ordinary
    path answers it, with its validation errors)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None


def prompts_of(body: Any, vocab_size: int) -> list[Prompt] | None:
    """The prompts of a body this module answers (several, or one with echo); None for an
    ordinary one. Raises APIError (400) for a list that cannot be served."""
    if not isinstance(body, dict):
        return None
    prompts = split_prompts(body.get("prompt"))
    echo = body.get("echo") is True
    if prompts is None or (len(prompts) == 1 and not echo):
        return None
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", "prompt")
    if body.get("max_tokens") == 0 and not echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone).", "max_tokens")
    for p in prompts:  # decoded for echo: only token ids of the vocabulary
        if not isinstance(p, str) and not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p
        ):
            raise bad_request(f"Token ids must be integers in [0, {vocab_size}).", "prompt")
    return prompts


async def serve(request: Request, ctx: MasterContext, body: Any) -> Response | None:
    """Answer a list of prompts or an echo request; None for an ordinary one (one prompt, no echo)."""
    try:
        prompts = prompts_of(body, ctx.tokenizer.vocab_size)
    except APIError as exc:  # the whole list refused: counted once, as one request
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    if prompts is None:
        return None
    echo = None
    one: dict[str, Any] = {"echo": False}
    prompt_logprobs = None
    if body.get("echo") is True:
        texts = [p if isinstance(p, str) else await ctx.tokenizer.run(ctx.tokenizer.decode, p) for p in prompts]
        logprobs = body.get("logprobs")
        scored = isinstance(logprobs, int) and not isinstance(logprobs, bool)
        echo = Echo(texts, logprobs=scored, prompt_only=body.get("max_tokens") == 0)
        if echo.prompt_only:
            one["max_tokens"] = 1  # one token drawn and dropped: the answer is the prompt
        if scored:
            prompt_logprobs = logprobs
    arrival = time.monotonic()
    # Each prompt is validated as a request of its own (and counted so when it is refused).
    prepared = await asyncio.gather(*(prepare_counted(ctx, {**body, "prompt": p, **one}, "completion", prompt_logprobs)
                                      for p in prompts))
    refused = next((p for p in prepared if isinstance(p, APIError)), None)
    if refused is not None:
        return refused.response()
    ready: list[Prepared] = prepared  # type: ignore[assignment]
    return await answers.serve(request, ctx, "completion", ready, arrival, echo)
