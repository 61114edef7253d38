"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, plus health and metrics."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from master import openai_schemas as oa
from master.auth import ApiKeys
from master.context import MasterContext
from master.errors import APIError, bad_request, internal_error, unavailable
from master.metrics import CONTENT_TYPE, status_of_http
from master.relay import ClientDisconnected, RelayRequest, StreamFailed
from master.request_log import REQUEST_ID_HEADER
from master.tokenization import ChatTemplateError

logger = logging.getLogger(__name__)

router = APIRouter()

Kind = Literal["chat", "completion"]
#: Routes whose every request counts once in ``pdc_requests_total``.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Status for a client that left before its answer (nginx's convention; nobody reads it).
_CLIENT_CLOSED = 499


def _ctx(request: Request) -> MasterContext:
    return request.app.state.ctx


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ---- small routes ---------------------------------------------------------------------------


@router.get("/livez")
async def livez() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Ready (200) once a prefill and a decode node are active and at least one such pair has a
    warm data-plane channel, so the first request pays no channel setup; 503 before."""
    registry = _ctx(request).registry
    prefill, decode = len(registry.active("prefill")), len(registry.active("decode"))
    warm_pairs = registry.warm_pairs()
    ok = prefill > 0 and decode > 0 and warm_pairs > 0
    body = {"status": "ok" if ok else "unavailable", "prefill_nodes": prefill, "decode_nodes": decode,
            "warm_pairs": warm_pairs}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_ctx(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(ctx: MasterContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pd-cluster", "max_model_len": ctx.context_limit()}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    _client_key(request)
    name = ctx.model_name
    return {"object": "list", "data": [_model_card(ctx, name)] if name else []}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx = _ctx(request)
    _client_key(request)
    if ctx.model_name is None or not ctx.knows_model(model_id):
        raise _model_not_found(model_id)
    return _model_card(ctx, ctx.model_name)


def _model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


# ---- generation -----------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


#: Deepest nesting of arrays and objects a request body may have (OpenAI's bodies need < 10).
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


async def _read_json(request: Request) -> Any:
    body = await request.body()
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        doc = json.loads(body)
    except RecursionError:
        raise bad_request(f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError:
        raise bad_request("We could not parse the JSON body of your request.") from None
    _check_json(doc)
    return doc


def _check_json(doc: Any) -> None:
    """Refuse what no tokenizer can read before any model sees it: nesting deeper than
    ``MAX_JSON_DEPTH`` and strings holding lone UTF-16 surrogates (``"\\ud800"`` is valid JSON
    but not Unicode text). Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise bad_request("The body holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid text.")
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.")
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for key, item in items:
                if key is not None:
                    stack.append((key, depth))
                stack.append((item, depth + 1))


async def _prepare(ctx: MasterContext, request: Request, kind: Kind) -> tuple[Any, list[int], Any]:
    """Validate and tokenize; returns (request model, prompt token ids, sampling params)."""
    body = await _read_json(request)
    req = oa.parse_request(oa.ChatCompletionRequest if kind == "chat" else oa.CompletionRequest, body)
    req.check_supported()
    if ctx.model_name is None:
        raise unavailable("No node has joined the cluster yet.", ctx.settings.retry_after_s)
    if not ctx.knows_model(req.model):
        raise _model_not_found(req.model)

    param = "messages" if kind == "chat" else "prompt"
    if kind == "chat":
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        try:
            token_ids = await ctx.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        requested, logprobs = req.requested_max_tokens, req.logprobs_count
    else:
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            token_ids = await ctx.tokenizer.encode_prompt(prompt)
        else:
            vocab = ctx.tokenizer.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise bad_request(f"Token ids must be in [0, {vocab}).", "prompt")
            token_ids = list(prompt)
        requested, logprobs = req.max_tokens, req.logprobs
    if not token_ids:
        raise bad_request(f"The {param} must not be empty.", param)

    n = len(token_ids)
    limit = ctx.context_limit()
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
        max_tokens = requested
    elif kind == "chat":
        max_tokens = limit - n if limit is not None else oa.COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        max_tokens = oa.COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else min(oa.COMPLETIONS_DEFAULT_MAX_TOKENS, limit - n)
    sampling = req.sampling_params(max_tokens, logprobs)
    return req, token_ids, sampling


@dataclass(frozen=True)
class _Shape:
    """What differs between a chat and a completion answer: where the text goes and how its
    logprobs read. Both routes share everything else."""

    id_prefix: str
    object: str
    chunk_object: str
    #: The choice's text field for the whole answer (non-streaming).
    content: Callable[[str], dict[str, Any]]
    #: The choice's text field for one streamed piece.
    delta: Callable[[str], dict[str, Any]]
    #: A first streamed choice, sent before any token (chat announces the role); None: none.
    opening: dict[str, Any] | None
    wants_logprobs: Callable[[Any], bool]
    #: (entries, token id -> text, offset in the answer's text they start at) -> OpenAI's logprobs.
    logprobs: Callable[[list[Any], Callable[[int], str], int], Any]


_SHAPES: dict[Kind, _Shape] = {
    "chat": _Shape(
        id_prefix="chatcmpl",
        object="chat.completion",
        chunk_object="chat.completion.chunk",
        content=lambda text: {"message": {"role": "assistant", "content": text}},
        delta=lambda text: {"delta": {"content": text} if text else {}},
        opening={"delta": {"role": "assistant", "content": ""}},
        wants_logprobs=lambda req: bool(req.logprobs),
        logprobs=lambda entries, token_text, _offset: oa.chat_logprobs(entries, token_text),
    ),
    "completion": _Shape(
        id_prefix="cmpl",
        object="text_completion",
        chunk_object="text_completion",
        content=lambda text: {"text": text},
        delta=lambda text: {"text": text},
        opening=None,
        wants_logprobs=lambda req: req.logprobs is not None,
        logprobs=oa.completion_logprobs,
    ),
}


def _choice(body: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}


def _prefix_block_size(ctx: MasterContext) -> int | None:
    """The block size to hash prompts by when routing will look them up in decode nodes'
    prefix indexes; None when it will not."""
    spec = ctx.registry.cluster_spec
    if ctx.settings.policy == "cache_aware" and spec is not None and any(
        len(d.prefix) for d in ctx.registry.active("decode")
    ):
        return spec.block_size
    return None


def _client_key(request: Request) -> str | None:
    """The caller's API key (None when the master needs none); raises 401."""
    keys: ApiKeys = request.app.state.api_keys
    return keys.authenticate(request.headers.get("authorization"))


async def _generate(request: Request, kind: Kind) -> Response:
    """Authenticate the client and hold its place under its key's limit, then serve."""
    ctx = _ctx(request)
    keys: ApiKeys = request.app.state.api_keys
    try:
        slot = keys.acquire(_client_key(request))
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    request.state.client_slot = slot
    try:
        return await _serve(request, kind)
    finally:
        if not slot.handed:
            slot.release()


async def _serve(request: Request, kind: Kind) -> Response:
    ctx = _ctx(request)
    arrival = time.monotonic()
    try:
        req, token_ids, sampling = await _prepare(ctx, request, kind)
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    except Exception:
        # Answered here, not by the app's handler: the connection stays usable and the 500 is counted.
        logger.exception("preparing a %s request failed", kind)
        ctx.metrics.requests_total.labels(status="error").inc()
        return internal_error().response()
    shape = _SHAPES[kind]
    block_size = _prefix_block_size(ctx)
    r = ctx.relay.create(f"{shape.id_prefix}-{uuid.uuid4().hex}", token_ids, sampling, req.stream, arrival)
    r.client_slot = request.state.client_slot
    r.client_slot.handed = True
    r.client_request_id = request.headers.get(REQUEST_ID_HEADER)
    request.state.request_id = r.request_id  # answered in the X-Request-Id header (RequestIdMiddleware)
    try:
        if block_size is not None:
            # Hash the prompt's blocks off the event loop; routing then finds them computed.
            await ctx.tokenizer.run(r.route.block_hashes, block_size)
        await ctx.relay.admit(r, request.is_disconnected)
    except ClientDisconnected:
        ctx.relay.release(r)
        return Response(status_code=_CLIENT_CLOSED)
    except APIError as exc:
        ctx.relay.fail(r, exc, status_of_http(exc.status))  # no-op when the relay already failed it
        ctx.relay.release(r)
        return exc.response()
    except Exception:
        logger.exception("admitting request %s failed", r.request_id)
        ctx.relay.fail(r, internal_error(), "error")
        ctx.relay.release(r)
        return internal_error().response()
    except BaseException:
        ctx.relay.release(r)
        raise
    created = oa.now()
    model = ctx.model_name or req.model
    if req.stream:
        body = _stream(ctx, r, req, shape, created, model)
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
    try:
        await ctx.relay.wait(r, request.is_disconnected)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    finally:
        ctx.relay.release(r)
    usage = oa.usage(len(r.token_ids), r.completion_tokens, r.cached_tokens)
    logprobs = shape.logprobs(r.logprobs, ctx.tokenizer.token_text, 0) if shape.wants_logprobs(req) else None
    choice = _choice(shape.content(r.text), r.finish_reason, logprobs)
    return JSONResponse(
        {"id": r.request_id, "object": shape.object, "created": created, "model": model, "choices": [choice], "usage": usage}
    )


async def _stream(
    ctx: MasterContext, r: RelayRequest, req: Any, shape: _Shape, created: int, model: str
) -> AsyncIterator[str]:
    include_usage = req.include_usage
    wants_logprobs = shape.wants_logprobs(req)
    offset = 0  # of the next piece in the answer's text

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        doc = {"id": r.request_id, "object": shape.chunk_object, "created": created, "model": model, "choices": choices}
        if include_usage:
            doc["usage"] = None
        doc.update(extra)
        return doc

    try:
        if shape.opening is not None:
            yield _sse(chunk([_choice(shape.opening)]))
        try:
            async for piece in ctx.relay.events(r):
                logprobs = None
                if wants_logprobs and piece.logprobs:
                    logprobs = shape.logprobs(piece.logprobs, ctx.tokenizer.token_text, offset)
                if not piece.text and logprobs is None and piece.finish_reason is None:
                    continue
                offset += len(piece.text)
                yield _sse(chunk([_choice(shape.delta(piece.text), piece.finish_reason, logprobs)]))
        except StreamFailed as exc:
            yield _sse(chunk([_choice(shape.delta(""), "error")]))
            yield _sse(oa.error_event(exc.error))
        if include_usage:
            yield _sse(chunk([], usage=oa.usage(len(r.token_ids), r.completion_tokens, r.cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        ctx.relay.release(r)
