"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, plus health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from master import completion_batch
from master import openai_schemas as oa
from master import tool_calls
from master.auth import ApiKeys
from master.context import MasterContext
from master.errors import APIError, bad_request, internal_error, unavailable
from master.metrics import CONTENT_TYPE, status_of_http
from master.relay import ClientDisconnected, RelayRequest, StreamFailed
from master.request_log import REQUEST_ID_HEADER
from master.tokenization import ChatTemplateError, Encoded
from pd_cluster.grammar_spec import GrammarError, check_spec

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


#: Stands for a piece's text in a chunk template (no client text holds a NUL).
_PIECE = "\x00piece\x00"


def _text_template(event: str) -> tuple[str, str]:
    """An SSE event built around ``_PIECE``, split where the piece's JSON string goes: a token's
    event is then ``head + json.dumps(text) + tail``, the same bytes as serialising it whole."""
    head, _, tail = event.rpartition(json.dumps(_PIECE, ensure_ascii=False))  # the choices come last
    return head, tail


# ---- small routes ---------------------------------------------------------------------------


@router.get("/livez")
async def livez() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Ready (200) once a node can serve a request without forming anything on its path: a mixed
    node; or a decode node and, when prefill nodes are active, a pair of them with a warm
    data-plane channel (so the first request pays no channel setup); 503 before."""
    registry = _ctx(request).registry
    prefill, decode = len(registry.active("prefill")), len(registry.active("decode"))
    mixed = len(registry.active("mixed"))
    warm_pairs = registry.warm_pairs()
    ok = mixed > 0 or (decode > 0 and (prefill == 0 or warm_pairs > 0))
    body = {"status": "ok" if ok else "unavailable", "prefill_nodes": prefill, "decode_nodes": decode,
            "mixed_nodes": mixed, "warm_pairs": warm_pairs}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_ctx(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(ctx: MasterContext, name: str) -> dict[str, Any]:
    """A model as vLLM lists it: root (the model served under ``name``), parent, max_model_len, permission."""
    created = oa.now()
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
    }
    return {"id": name, "object": "model", "created": created, "owned_by": "pd-cluster",
            "root": ctx.registry.model_name or name, "parent": None, "max_model_len": ctx.context_limit(),
            "permission": [permission]}


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


def _json_body(model: type) -> dict[str, Any]:
    """An OpenAPI request body naming ``model`` (its schema goes in the document's components)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_document(app: Any) -> dict[str, Any]:
    """The app's OpenAPI document, with the request bodies the generation routes validate by hand
    (strict types: the schema says what the routes accept)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, schemas = models_json_schema(
        [(oa.ChatCompletionRequest, "validation"), (oa.CompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas.get("$defs", {}))
    app.openapi_schema = doc
    return doc


@router.post("/v1/chat/completions", openapi_extra=_json_body(oa.ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


@router.post("/v1/completions", openapi_extra=_json_body(oa.CompletionRequest))
async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


#: Deepest nesting of arrays and objects a request body may have (OpenAI's bodies need < 10).
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


async def _read_json(request: Request) -> Any:
    """The request's JSON body, checked; parsed once a request (the route reads it again)."""
    parsed = getattr(request.state, "json_body", None)
    if parsed is not None:
        return parsed[0]
    doc = await _parse_json(request)
    request.state.json_body = (doc,)
    return doc


async def _parse_json(request: Request) -> Any:
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


@dataclass(frozen=True)
class _Prepared:
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


async def _prepare(ctx: MasterContext, request: Request, kind: Kind) -> _Prepared:
    """Validate and tokenize (hashing the prompt's blocks in the same trip to the tokenizer
    thread when routing will look them up)."""
    body = await _read_json(request)
    req = oa.parse_request(oa.ChatCompletionRequest if kind == "chat" else oa.CompletionRequest, body)
    req.check_supported()
    if ctx.model_name is None:
        raise unavailable("No node has joined the cluster yet.", ctx.settings.retry_after_s)
    if not ctx.knows_model(req.model):
        raise _model_not_found(req.model)

    param = "messages" if kind == "chat" else "prompt"
    block_size = _prefix_block_size(ctx)
    structured = req.structured()
    if structured is not None:
        grammar_param = "tools" if kind == "chat" and req.forced_functions is not None else "response_format"
        try:
            await ctx.tokenizer.run(check_spec, structured)
        except GrammarError as exc:
            raise bad_request(f"{grammar_param}: {exc}", grammar_param) from None
    if kind == "chat":
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        try:
            encoded = await ctx.tokenizer.encode_chat(messages, req.template_tools(), block_size)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        requested, logprobs = req.requested_max_tokens, req.logprobs_count
    else:
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            encoded = await ctx.tokenizer.encode_prompt(prompt, block_size)
        else:
            vocab = ctx.tokenizer.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise bad_request(f"Token ids must be in [0, {vocab}).", "prompt")
            encoded = (await ctx.tokenizer.hash_blocks(list(prompt), block_size) if block_size is not None
                       else Encoded(list(prompt)))
        requested, logprobs = req.max_tokens, req.logprobs
    token_ids = encoded.ids
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
    sampling = req.sampling_params(max_tokens, logprobs, structured)
    if sampling.logit_bias:
        vocab = ctx.tokenizer.vocab_size
        if any(t >= vocab for t in sampling.logit_bias):
            raise bad_request(f"logit_bias: token ids must be in [0, {vocab}).", "logit_bias")
    if sampling.seed is None:
        # Chosen once here, so a retry on another node draws the same stream.
        sampling = sampling.model_copy(update={"seed": secrets.randbits(63)})
    return _Prepared(req, token_ids, sampling, block_size, encoded.block_hashes)


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


def _answer(shape: _Shape, req: Any, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's choice body and finish reason: a chat answer that is a complete tool call
    becomes ``tool_calls`` (content null, finish reason "tool_calls")."""
    if shape.object == "chat.completion" and req.parses_tool_calls and finish_reason == "stop":
        calls = tool_calls.parse_tool_calls(text, req.tool_names)
        if calls is not None:
            message = {"role": "assistant", "content": None,
                       "tool_calls": [c.openai(tool_calls.new_call_id()) for c in calls]}
            return {"message": message}, "tool_calls"
    return shape.content(text), finish_reason


def _prefix_block_size(ctx: MasterContext) -> int | None:
    """The block size to hash prompts by when routing will look them up in decode nodes'
    prefix indexes; None when it will not."""
    spec = ctx.registry.cluster_spec
    if ctx.settings.policy == "cache_aware" and spec is not None and any(
        len(d.prefix) for d in ctx.registry.active("decode") + ctx.registry.active("mixed")
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
        await _read_json(request)  # what no route may see (too deep, not text) is refused first
    except APIError as exc:
        slot.release()
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    try:
        return await _serve(request, kind)
    finally:
        if not slot.handed:
            slot.release()


async def _serve(request: Request, kind: Kind) -> Response:
    ctx = _ctx(request)
    if kind == "completion" and (answer := await completion_batch.serve(request, _serve)) is not None:
        return answer  # several prompts, or echo: one request per prompt, answered as one
    arrival = time.monotonic()
    try:
        prepared = await _prepare(ctx, request, kind)
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    except Exception:
        # Answered here, not by the app's handler: the connection stays usable and the 500 is counted.
        logger.exception("preparing a %s request failed", kind)
        ctx.metrics.requests_total.labels(status="error").inc()
        return internal_error().response()
    shape = _SHAPES[kind]
    req, token_ids, sampling = prepared.req, prepared.token_ids, prepared.sampling
    if req.choice_count > 1:
        return await _serve_choices(request, ctx, kind, prepared, arrival)
    r = ctx.relay.create(ctx.relay.new_request_id(shape.id_prefix), token_ids, sampling, req.stream, arrival)
    prepared.route(r)
    r.client_slot = request.state.client_slot
    r.client_slot.handed = True
    r.client_request_id = request.headers.get(REQUEST_ID_HEADER)
    request.state.request_id = r.request_id  # answered in the X-Request-Id header (RequestIdMiddleware)
    try:
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
    choice = _choice(*_answer(shape, req, r.text, r.finish_reason), logprobs)
    return JSONResponse(
        {"id": r.request_id, "object": shape.object, "created": created, "model": model, "choices": [choice], "usage": usage}
    )


async def _stream(
    ctx: MasterContext, r: RelayRequest, req: Any, shape: _Shape, created: int, model: str
) -> AsyncIterator[str]:
    include_usage = req.include_usage
    wants_logprobs = shape.wants_logprobs(req)
    offset = 0  # of the next piece in the answer's text
    calls = tool_calls.ToolCallStream(req.tool_names) if shape.object == "chat.completion" and req.parses_tool_calls else None

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        doc = {"id": r.request_id, "object": shape.chunk_object, "created": created, "model": model, "choices": choices}
        if include_usage:
            doc["usage"] = None
        doc.update(extra)
        return doc

    # Most events are a piece of text alone (no logprobs, not the last): from a template.
    head, tail = _text_template(_sse(chunk([_choice(shape.delta(_PIECE))])))
    try:
        if shape.opening is not None:
            yield _sse(chunk([_choice(shape.opening)]))
        try:
            async for piece in ctx.relay.events(r):
                logprobs = None
                if wants_logprobs and piece.logprobs:
                    logprobs = shape.logprobs(piece.logprobs, ctx.tokenizer.token_text, offset)
                if calls is not None:
                    for body in _tool_call_deltas(calls, piece, logprobs):
                        yield _sse(chunk([body]))
                    continue
                text = piece.text
                if logprobs is None and piece.finish_reason is None:
                    if text:
                        offset += len(text)
                        yield head + json.dumps(text, ensure_ascii=False) + tail
                    continue
                offset += len(text)
                yield _sse(chunk([_choice(shape.delta(text), piece.finish_reason, logprobs)]))
        except StreamFailed as exc:
            yield _sse(chunk([_choice(shape.delta(""), "error")]))
            yield _sse(oa.error_event(exc.error))
        if include_usage:
            yield _sse(chunk([], usage=oa.usage(len(r.token_ids), r.completion_tokens, r.cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        ctx.relay.release(r)


def _tool_call_deltas(calls: tool_calls.ToolCallStream, piece: Any, logprobs: Any) -> list[dict[str, Any]]:
    """The streamed choices of one piece of an answer that may be a tool call; the last piece's
    finish reason is "tool_calls" when the answer was one."""
    deltas = calls.feed(piece.text)
    finish = piece.finish_reason
    if finish is not None:
        deltas += calls.finish()
        if calls.state == "call" and finish == "stop":
            finish = "tool_calls"
    bodies = [_choice({"delta": d}, None, logprobs if i == 0 else None) for i, d in enumerate(deltas)]
    if finish is not None:
        bodies.append(_choice({"delta": {}}, finish, None))
    elif not bodies and logprobs is not None:
        bodies.append(_choice({"delta": {}}, None, logprobs))
    return bodies


# ---- several choices: n > 1, best_of ------------------------------------------------------------

#: How often a request with several choices checks whether choice 0 has reached its decode node.
_FOLLOW_POLL_S = 0.01


def choice_sampling(sampling: Any, index: int, for_ranking: bool) -> Any:
    """Choice ``index`` samples with seed ``(seed + index) mod 2**63`` and so returns exactly what
    the same request with n=1 and that seed returns. Ranking by best_of needs each token's logprob."""
    update: dict[str, Any] = {"seed": (sampling.seed + index) % oa.SEED_MODULUS}
    if for_ranking and sampling.logprobs is None:
        update["logprobs"] = 0
    return sampling.model_copy(update=update)


def _mean_logprob(r: RelayRequest) -> float:
    return sum(entry.logprob for entry in r.logprobs) / len(r.logprobs) if r.logprobs else float("-inf")


def _release_all(ctx: MasterContext, relays: list[RelayRequest]) -> None:
    for r in reversed(relays):  # choice 0 last: it holds the client's slot
        ctx.relay.release(r)


async def _admit_followers(
    ctx: MasterContext, first: RelayRequest, followers: list[RelayRequest], is_disconnected: Callable[..., Any]
) -> None:
    """Admit choices 1.. once choice 0 streams from its decode node (its prompt then sits in that
    D's prefix cache and in its P's), preferring that D: their prompt is neither recomputed beyond
    its last partial block nor moved again."""
    try:
        while not first.terminal and len(first.output_ids) < 2 and time.monotonic() < first.deadline:
            await asyncio.sleep(_FOLLOW_POLL_S)
        if first.state == "failed":
            for r in followers:
                ctx.relay.fail(r, first.failure or internal_error(), "error")
            return

        async def admit(r: RelayRequest) -> None:
            r.preferred_decode = first.decode_id
            try:
                await ctx.relay.admit(r, is_disconnected)
            except (APIError, ClientDisconnected):
                pass  # the relay holds the failure; the answer reports it

        await asyncio.gather(*(admit(r) for r in followers))
    except Exception:
        logger.exception("admitting the choices of %s failed", first.request_id)
        for r in followers:
            ctx.relay.fail(r, internal_error(), "error")


async def _serve_choices(
    request: Request, ctx: MasterContext, kind: Kind, prepared: _Prepared, arrival: float
) -> Response:
    """A request with several choices: one relay request per choice, admitted after choice 0 (see
    :func:`_admit_followers`); the answer lists them by ``index`` (the best ``n`` by mean token
    logprob when best_of > n), and its usage counts the prompt once."""
    shape = _SHAPES[kind]
    req, token_ids, sampling = prepared.req, prepared.token_ids, prepared.sampling
    count, returned = req.choice_count, req.choices_returned
    base_id = ctx.relay.new_request_id(shape.id_prefix)
    relays: list[RelayRequest] = []
    for index in range(count):
        choice = choice_sampling(sampling, index, for_ranking=count > returned)
        r = ctx.relay.create(base_id if index == 0 else f"{base_id}-c{index}", token_ids, choice, req.stream, arrival)
        r.choice_index = index
        r.client_request_id = request.headers.get(REQUEST_ID_HEADER)
        prepared.route(r)
        relays.append(r)
    first = relays[0]
    first.client_slot = request.state.client_slot
    first.client_slot.handed = True
    request.state.request_id = base_id
    try:
        await ctx.relay.admit(first, request.is_disconnected)
    except ClientDisconnected:
        _release_all(ctx, relays)
        return Response(status_code=_CLIENT_CLOSED)
    except APIError as exc:
        ctx.relay.fail(first, exc, status_of_http(exc.status))
        _release_all(ctx, relays)
        return exc.response()
    except Exception:
        logger.exception("admitting request %s failed", base_id)
        ctx.relay.fail(first, internal_error(), "error")
        _release_all(ctx, relays)
        return internal_error().response()
    except BaseException:
        _release_all(ctx, relays)
        raise
    follow = asyncio.create_task(_admit_followers(ctx, first, relays[1:], request.is_disconnected))
    created = oa.now()
    model = ctx.model_name or req.model
    if req.stream:
        body = _stream_choices(ctx, relays, follow, req, shape, created, model)
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
    try:
        for r in relays:
            await ctx.relay.wait(r, request.is_disconnected)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    finally:
        follow.cancel()
        _release_all(ctx, relays)
    ranked = sorted(relays, key=_mean_logprob, reverse=True)[:returned] if count > returned else relays
    choices = []
    for index, r in enumerate(ranked):
        logprobs = shape.logprobs(r.logprobs, ctx.tokenizer.token_text, 0) if shape.wants_logprobs(req) else None
        choices.append({**_choice(*_answer(shape, req, r.text, r.finish_reason), logprobs), "index": index})
    usage = oa.usage(len(token_ids), sum(r.completion_tokens for r in relays), first.cached_tokens)
    return JSONResponse(
        {"id": base_id, "object": shape.object, "created": created, "model": model, "choices": choices, "usage": usage}
    )


async def _stream_choices(
    ctx: MasterContext, relays: list[RelayRequest], follow: asyncio.Task, req: Any, shape: _Shape, created: int,
    model: str,
) -> AsyncIterator[str]:
    """The choices' chunks interleaved as their tokens arrive, each naming its ``index``; every
    relay event stream ends by its request's deadline, so this does too."""
    include_usage = req.include_usage
    wants_logprobs = shape.wants_logprobs(req)
    base_id = relays[0].request_id
    offsets = [0] * len(relays)
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, r: RelayRequest) -> None:
        try:
            async for piece in ctx.relay.events(r):
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except StreamFailed as exc:
            queue.put_nowait((index, exc))

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        doc = {"id": base_id, "object": shape.chunk_object, "created": created, "model": model, "choices": choices}
        if include_usage:
            doc["usage"] = None
        doc.update(extra)
        return doc

    def indexed(index: int, body: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict:
        return {**_choice(body, finish_reason, logprobs), "index": index}

    pumps = [asyncio.create_task(pump(index, r)) for index, r in enumerate(relays)]
    try:
        if shape.opening is not None:
            for index in range(len(relays)):
                yield _sse(chunk([indexed(index, shape.opening)]))
        open_choices = len(relays)
        while open_choices:
            index, item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, StreamFailed):
                open_choices -= 1
                yield _sse(chunk([indexed(index, shape.delta(""), "error")]))
                yield _sse(oa.error_event(item.error))
            else:
                logprobs = None
                if wants_logprobs and item.logprobs:
                    logprobs = shape.logprobs(item.logprobs, ctx.tokenizer.token_text, offsets[index])
                if not item.text and logprobs is None and item.finish_reason is None:
                    continue
                offsets[index] += len(item.text)
                yield _sse(chunk([indexed(index, shape.delta(item.text), item.finish_reason, logprobs)]))
        if include_usage:
            completion = sum(r.completion_tokens for r in relays)
            yield _sse(chunk([], usage=oa.usage(len(relays[0].token_ids), completion, relays[0].cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        follow.cancel()
        for task in pumps:
            task.cancel()
        _release_all(ctx, relays)
