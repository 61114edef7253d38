"""/v1/completions with a list of prompts, or with ``echo``: one request per prompt through the
ordinary path (routing, relay, request log), answered as one, as vLLM and OpenAI answer them.

Choice ``index`` is ``prompt_index * n + choice_index``; usage adds up every prompt's. ``echo``
puts each prompt's text before its choices' text (streamed: as each choice's first piece).
Prompt logprobs are not computed, so ``echo`` with ``logprobs`` is refused. The answer's id (and
``X-Request-Id``) is the first prompt's request id; each prompt has its own line in the request
log. An error on any prompt before its answer starts is the answer to the whole request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from master.auth import ClientSlot
from master.errors import APIError, bad_request
from master.metrics import status_of_http

#: Prompts one request may carry; each becomes a request of its own.
MAX_PROMPTS = 64

Serve = Callable[[Request, str], Awaitable[Response]]


def _refused(request: Request, error: APIError) -> Response:
    """The whole batch refused: counted once, as one request."""
    request.app.state.ctx.metrics.requests_total.labels(status=status_of_http(error.status)).inc()
    return error.response()


def split_prompts(prompt: Any) -> list[str | list[int]] | None:
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


async def serve(request: Request, serve_one: Serve) -> Response | None:
    """Answer a batch or an echo request; None for an ordinary one (one prompt, no echo)."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    prompts = split_prompts(body.get("prompt"))
    echo = body.get("echo") is True
    if prompts is None or (len(prompts) == 1 and not echo):
        return None
    if len(prompts) > MAX_PROMPTS:
        return _refused(request, bad_request(f"At most {MAX_PROMPTS} prompts per request.", "prompt"))
    if echo and body.get("logprobs") is not None:
        return _refused(request, bad_request("echo with logprobs is not supported (prompt logprobs are not "
                                             "computed).", "echo"))
    ctx = request.app.state.ctx
    vocab = ctx.tokenizer.vocab_size
    for p in prompts:  # decoded below for echo: only token ids of the vocabulary
        if not isinstance(p, str) and not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p):
            return _refused(request, bad_request(f"Token ids must be integers in [0, {vocab}).", "prompt"))
    texts = [p if isinstance(p, str) else await ctx.tokenizer.run(ctx.tokenizer.decode, p) for p in prompts]
    slot: ClientSlot = request.state.client_slot
    slot.handed = True  # released when the whole answer is done
    subs = [_sub_request(request, {**body, "prompt": p, "echo": False}, slot) for p in prompts]
    try:
        responses = await asyncio.gather(*(serve_one(sub, "completion") for sub in subs))
    except BaseException:
        slot.release()
        raise
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        await asyncio.gather(*(_close(r) for r in responses))
        slot.release()
        return failed
    request.state.request_id = subs[0].state.request_id
    prefixes = texts if echo else None
    if isinstance(responses[0], StreamingResponse):
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        stream = _merged_stream(responses, prefixes, n, subs[0].state.request_id, slot)  # type: ignore[arg-type]
        return StreamingResponse(stream, media_type="text/event-stream", headers=_stream_headers(responses[0]))
    try:
        return JSONResponse(_merged_body([json.loads(r.body) for r in responses], prefixes))
    finally:
        slot.release()


def _sub_request(request: Request, body: dict[str, Any], slot: ClientSlot) -> Request:
    """A request for one prompt: the client's connection (disconnects reach it), its own state."""
    payload = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        return await request.receive()

    sub = Request({**request.scope, "state": {}}, receive)
    # The batch holds the client's place under its key's limit; a prompt's request holds none.
    sub.state.client_slot = ClientSlot(slot.keys, slot.key, released=True)
    return sub


async def _close(response: Response) -> None:
    """Give up a prompt's streamed answer before it is read (its relay request is released)."""
    iterator = getattr(response, "body_iterator", None)
    if iterator is not None and hasattr(iterator, "aclose"):
        await iterator.aclose()


def _stream_headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() in ("cache-control", "x-accel-buffering")}


def _usage_sum(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    given = [u for u in usages if u]
    if not given:
        return None
    total: dict[str, Any] = {key: sum(u.get(key, 0) for u in given)
                             for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = [u["prompt_tokens_details"].get("cached_tokens", 0) for u in given if u.get("prompt_tokens_details")]
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return total


def _merged_body(docs: list[dict[str, Any]], prefixes: list[str] | None) -> dict[str, Any]:
    choices = []
    for i, doc in enumerate(docs):
        per_prompt = len(doc["choices"])
        for choice in doc["choices"]:
            text = (prefixes[i] if prefixes else "") + choice["text"]
            choices.append({**choice, "index": i * per_prompt + choice["index"], "text": text})
    return {**docs[0], "choices": choices, "usage": _usage_sum([d.get("usage") for d in docs])}


async def _merged_stream(
    responses: list[StreamingResponse], prefixes: list[str] | None, n: int, answer_id: str, slot: ClientSlot
) -> AsyncIterator[str]:
    """Every prompt's chunks as they come, re-indexed under one id; one usage chunk at the end."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
    echoed: set[tuple[int, int]] = set()
    usages: list[dict[str, Any] | None] = [None] * len(responses)
    template: dict[str, Any] | None = None

    async def pump(i: int, response: StreamingResponse) -> None:
        try:
            async for part in response.body_iterator:
                text = part.decode() if isinstance(part, bytes) else str(part)
                for event in text.split("\n\n"):
                    if event.startswith("data: "):
                        queue.put_nowait((i, event[len("data: "):]))
        finally:
            queue.put_nowait((i, None))

    pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(responses)]
    try:
        open_streams = len(responses)
        while open_streams:
            i, data = await queue.get()
            if data is None:
                open_streams -= 1
                continue
            if data == "[DONE]":
                continue
            doc = json.loads(data)
            if "choices" not in doc:  # an error event: passed on as it is
                yield f"data: {data}\n\n"
                continue
            if not doc["choices"]:  # a prompt's usage chunk: added up at the end
                usages[i] = doc.get("usage")
                template = template or doc
                continue
            template = template or doc
            for choice in doc["choices"]:
                index = choice["index"]
                out = {**doc, "id": answer_id, "choices": [{**choice, "index": i * n + index}]}
                if prefixes and (i, index) not in echoed:
                    echoed.add((i, index))
                    out["choices"][0] = {**out["choices"][0], "text": prefixes[i] + choice["text"]}
                yield f"data: {json.dumps(out, separators=(',', ':'), ensure_ascii=False)}\n\n"
        total = _usage_sum(usages)
        if total is not None and template is not None:
            yield f"data: {json.dumps({**template, 'id': answer_id, 'choices': [], 'usage': total})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*(_close(r) for r in responses), return_exceptions=True)
        slot.release()

