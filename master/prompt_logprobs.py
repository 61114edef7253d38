"""The prompt's logprobs in the shapes clients read them: OpenAI's legacy ``echo`` + ``logprobs``
on /v1/completions (the prompt's tokens before the completion's, the first with ``None``: it has
no context), and vLLM's ``prompt_logprobs`` extra on both APIs (a list over the prompt's tokens,
``None`` first, each a map token id -> logprob, rank, decoded token for the token itself and the
top k). Evaluation harnesses (lm-eval's ``local-completions``) score choices and perplexity with
the echo shape, ``max_tokens: 0`` asking for the prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd_cluster.protocol import PromptLogprobs

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Echo:
    """A completions request's ``echo``: each prompt's text goes before its choices' text;
    ``logprobs``: the prompt's logprobs go before theirs; ``prompt_only``: ``max_tokens: 0``, the
    answer is the prompt alone (one token is generated and dropped)."""

    texts: list[str]
    logprobs: bool = False
    prompt_only: bool = False


def legacy(prompt_ids: list[int], scored: PromptLogprobs, token_text: TokenText, top: int) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` of a prompt: tokens, token_logprobs (None first), top_logprobs
    (None first; the token itself and the top ``top``), text_offset from 0."""
    tokens, offsets = [], []
    offset = 0
    for token_id in prompt_ids:
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        alternatives = {token_text(t): lp for t, lp in zip(scored.top_ids[i][:top], scored.top_logprobs[i][:top])} \
            if top and scored.top_ids else {}
        tops.append({token_text(token_id): scored.logprobs[i], **alternatives})
    return {"tokens": tokens, "token_logprobs": [None, *scored.logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def joined(prompt: dict[str, Any], completion: dict[str, Any] | None) -> dict[str, Any]:
    """A prompt's legacy logprobs followed by its completion's (whose offsets already count the
    prompt's text)."""
    if completion is None:
        return prompt
    return {key: prompt[key] + completion[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def vllm(prompt_ids: list[int], scored: PromptLogprobs, token_text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None, then for each later token a map of token id (as a string)
    -> logprob, rank and decoded token, for the token and its position's top k."""
    out: list[dict[str, Any] | None] = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        entry: dict[str, Any] = {}
        if scored.top_ids:
            for rank, (t, lp) in enumerate(zip(scored.top_ids[i], scored.top_logprobs[i]), 1):
                entry[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
        rank = scored.ranks[i] if i < len(scored.ranks) else None
        entry[str(token_id)] = {"logprob": scored.logprobs[i], "rank": rank, "decoded_token": token_text(token_id)}
        out.append(entry)
    return out
