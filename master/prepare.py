"""A generation request validated and tokenized, ready for the relay: its parsed body, prompt
ids, sampling parameters and (when routing looks up prefixes) the prompt's block hashes."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from master import openai_schemas as oa
from master.context import MasterContext
from master.errors import APIError, bad_request, internal_error, unavailable
from master.metrics import status_of_http
from master.relay_request import RelayRequest
from master.tokenization import ChatTemplateError, Encoded
from pd_cluster.grammar_spec import GrammarError, check_spec

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


@dataclass(frozen=True)
class Prepared:
    """A request validated and tokenized: its model, prompt ids, sampling, and (when routing
    looks up prefixes) the prompt's block hashes."""

    req: Any
    token_ids: list[int]
    sampling: Any
    block_size: int | None
    block_hashes: list[int] | None

    def route(self, r: RelayRequest) -> None:
        """Hand the block hashes to the relay request's routing."""
        if self.block_size is not None and self.block_hashes is not None:
            r.route.remember_hashes(self.block_size, self.block_hashes)


async def prepare(ctx: MasterContext, body: Any, kind: Kind, prompt_logprobs: int | None = None) -> Prepared:
    """Validate and tokenize (hashing the prompt's blocks in the same trip to the tokenizer
    thread when routing will look them up). ``prompt_logprobs``: score the prompt with at least
    this many alternatives (an echo with logprobs), whatever the body asks."""
    req = oa.parse_request(oa.ChatCompletionRequest if kind == "chat" else oa.CompletionRequest, body)
    req.check_supported()
    if ctx.model_name is None:
        raise unavailable("No node has joined the cluster yet.", ctx.settings.retry_after_s)
    if not ctx.knows_model(req.model):
        raise model_not_found(req.model)

    param = "messages" if kind == "chat" else "prompt"
    block_size = prefix_block_size(ctx)
    structured = req.structured()
    if structured is not None:
        grammar_param = "tools" if kind == "chat" and req.forced_functions is not None else "response_format"
        try:
            await ctx.tokenizer.run(check_spec, structured)
        except GrammarError as exc:
            raise bad_request(f"{grammar_param}: {exc}", grammar_param) from None
    encoded = await _encode(ctx, req, kind, block_size)
    token_ids = encoded.ids
    if not token_ids:
        raise bad_request(f"The {param} must not be empty.", param)
    if kind == "chat":
        requested, logprobs = req.requested_max_tokens, req.logprobs_count
    else:
        requested, logprobs = req.max_tokens, req.logprobs
    max_tokens = _max_tokens(kind, param, len(token_ids), requested, ctx.context_limit())
    defaults = ctx.model.sampling_defaults if ctx.model is not None else None
    sampling = req.sampling_params(max_tokens, logprobs, structured, defaults)
    if sampling.logit_bias:
        vocab = ctx.tokenizer.vocab_size
        if any(t >= vocab for t in sampling.logit_bias):
            raise bad_request(f"logit_bias: token ids must be in [0, {vocab}).", "logit_bias")
    if prompt_logprobs is not None:
        sampling = sampling.model_copy(update={"prompt_logprobs": max(prompt_logprobs, sampling.prompt_logprobs or 0)})
    if sampling.seed is None and not sampling.use_beam_search:
        # Chosen once here, so a retry on another node draws the same stream.
        sampling = sampling.model_copy(update={"seed": secrets.randbits(63)})
    return Prepared(req, token_ids, sampling, block_size, encoded.block_hashes)


async def _encode(ctx: MasterContext, req: Any, kind: Kind, block_size: int | None) -> Encoded:
    """The prompt's token ids: the chat template applied to the messages, or the prompt's text
    tokenized, or its ids checked against the vocabulary."""
    if kind == "chat":
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        try:
            return await ctx.tokenizer.encode_chat(messages, req.template_tools(), block_size)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        return await ctx.tokenizer.encode_prompt(prompt, block_size)
    vocab = ctx.tokenizer.vocab_size
    if any(t < 0 or t >= vocab for t in prompt):
        raise bad_request(f"Token ids must be in [0, {vocab}).", "prompt")
    if block_size is None:
        return Encoded(list(prompt))
    return await ctx.tokenizer.hash_blocks(list(prompt), block_size)


def _max_tokens(kind: Kind, param: str, n: int, requested: int | None, limit: int | None) -> int:
    """The output budget of a prompt of ``n`` tokens: what the client asked for, refused past
    the context ``limit``; by default the rest of the context (chat) or a short completion."""
    if limit is not None:
        if n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your {param} resulted in "
                f"{n} tokens.", param, "context_length_exceeded",
            )
        if requested is not None and n + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested {n + requested} "
                f"tokens ({n} in the {param}, {requested} in the completion). Please reduce the length of the "
                f"{param} or completion.", param, "context_length_exceeded",
            )
    if requested is not None:
        return requested
    if kind == "chat":
        return limit - n if limit is not None else oa.COMPLETIONS_DEFAULT_MAX_TOKENS
    return oa.COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else min(oa.COMPLETIONS_DEFAULT_MAX_TOKENS, limit - n)


def prefix_block_size(ctx: MasterContext) -> int | None:
    """The block size to hash prompts by when routing will look them up in decode nodes'
    prefix indexes; None when it will not."""
    spec = ctx.registry.cluster_spec
    if ctx.settings.policy == "cache_aware" and spec is not None and any(
        len(d.prefix) for d in ctx.registry.active("decode") + ctx.registry.active("mixed")
    ):
        return spec.block_size
    return None


async def prepare_counted(ctx: MasterContext, body: Any, kind: Kind,
                          prompt_logprobs: int | None = None) -> Prepared | APIError:
    """:func:`prepare`, or the error that answers the request, counted in ``pdc_requests_total``.
    An unexpected one is logged and answered as a 500 here, not by the app's handler: the
    connection stays usable and the error is counted."""
    try:
        return await prepare(ctx, body, kind, prompt_logprobs)
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc
    except Exception:
        logger.exception("preparing a %s request failed", kind)
        ctx.metrics.requests_total.labels(status="error").inc()
        return internal_error()
