"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, plus health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from master import answers, completion_batch, responses_answer, responses_request
from master import openai_schemas as oa
from master.auth import ApiKeys
from master.context import MasterContext
from master.errors import APIError, bad_request
from master.metrics import CONTENT_TYPE, status_of_http
from master.prepare import Kind, model_not_found, prepare_counted
from master.rejections import KEY_NAME_STATE
from master.request_log import REQUEST_ID_HEADER, client_request_id

logger = logging.getLogger(__name__)

router = APIRouter()

#: Routes whose every request counts once in ``pdc_requests_total``.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def _ctx(request: Request) -> MasterContext:
    return request.app.state.ctx


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
        raise model_not_found(model_id)
    return _model_card(ctx, ctx.model_name)


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
        [(oa.ChatCompletionRequest, "validation"), (oa.CompletionRequest, "validation"),
         (responses_request.ResponsesRequest, "validation")],
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


@router.post("/v1/responses", openapi_extra=_json_body(responses_request.ResponsesRequest))
async def responses(request: Request) -> Response:
    return await _generate(request, "chat", _serve_responses)


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


def _client_key(request: Request) -> str | None:
    """The caller's API key (None when the master needs none); raises 401."""
    keys: ApiKeys = request.app.state.api_keys
    return keys.authenticate(request.headers.get("authorization"))


def generations_of(body: Any, kind: Kind) -> int:
    """The generations a body asks for, as its key's limit counts them: its prompts (chat: one)
    times max(n, best_of). Read before validation: a value it will refuse counts as one."""
    if not isinstance(body, dict):
        return 1
    prompts = completion_batch.split_prompts(body.get("prompt")) if kind == "completion" else None
    count = min(len(prompts), completion_batch.MAX_PROMPTS) if prompts else 1
    return count * max(_choice_count(body.get("n")), _choice_count(body.get("best_of")))


def _choice_count(value: Any) -> int:
    valid = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= oa.MAX_CHOICES
    return value if valid else 1


async def _generate(request: Request, kind: Kind,
                    serve: Callable[[Request, Kind], Awaitable[Response]] | None = None) -> Response:
    """Take the client's X-Request-Id (answered back from here on), authenticate it, read its body
    (what no route may see, too deep or not text, is refused first) and hold its generations
    under its key's limit, then serve."""
    ctx = _ctx(request)
    keys: ApiKeys = request.app.state.api_keys
    try:
        request.state.client_request_id = request.state.request_id = client_request_id(
            request.headers.get(REQUEST_ID_HEADER))
        key = _client_key(request)
        setattr(request.state, KEY_NAME_STATE, keys.name_of(key))
        body = await _read_json(request)
        slot = keys.acquire(key, generations_of(body, kind))
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    request.state.client_slot = slot
    try:
        return await (serve or _serve)(request, kind)
    finally:
        if not slot.handed:
            slot.release()


async def _serve(request: Request, kind: Kind) -> Response:
    ctx = _ctx(request)
    body = await _read_json(request)
    if kind == "completion" and (answer := await completion_batch.serve(request, ctx, body)) is not None:
        return answer  # several prompts, or echo
    arrival = time.monotonic()
    await _frames_first()
    prepared = await prepare_counted(ctx, body, kind)
    if isinstance(prepared, APIError):
        return prepared.response()
    await _frames_first()
    return await answers.serve(request, ctx, kind, [prepared], arrival)


async def _frames_first() -> None:
    """Let the node frames read meanwhile go first (one loop round). A request's way from its
    bytes to its job is one step of the loop otherwise (~1 ms: parsing, validation, the template,
    tokenization, routing): every stream's next token waited for all of it."""
    await asyncio.sleep(0)


async def _serve_responses(request: Request, _: Kind) -> Response:
    """A Responses API request, served as the chat completion it asks for (:mod:`master.responses_request`)."""
    ctx = _ctx(request)
    try:
        req = responses_request.parse(await _read_json(request))
    except APIError as exc:
        ctx.metrics.requests_total.labels(status=status_of_http(exc.status)).inc()
        return exc.response()
    arrival = time.monotonic()
    await _frames_first()
    prepared = await prepare_counted(ctx, req.chat_body(), "chat")
    if isinstance(prepared, APIError):
        return responses_answer.in_responses_terms(prepared).response()
    await _frames_first()
    return await responses_answer.serve(request, ctx, req, prepared, arrival)
