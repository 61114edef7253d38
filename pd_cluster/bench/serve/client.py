"""One request, streamed and timed: the request body, the SSE parse, and the record it fills.

SSE is parsed here (``data:`` lines of JSON, ``[DONE]`` at the end) rather than through the
``openai`` package, so the benchmark sees the raw chunk times. The streams go through aiohttp:
one Python process reads every stream of a run, and httpx's per-chunk cost there showed up as
client time in every TTFT (``pd-cluster bench master``: the part outside the master 5.8 to 8.0 ms
with httpx, 2.8 to 3.9 ms with aiohttp, on 2 cores; docs/benchmarks/README.md). A chunk
counts as a token arrival when it carries text; the first such chunk gives TTFT. Failures are
recorded, never raised: an HTTP status as ``HTTP <code>``, an error event inside the stream as
``stream:<type>``, and anything else by its exception class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.records import RequestRecord
from pd_cluster.bench.serve.workloads import Conversation

logger = logging.getLogger(__name__)

_ERROR_BODY_CHARS = 500

Message = dict[str, str]


def request_body(config: ServeBenchConfig, model: str, conversation: Conversation, turn: int,
                 answers: list[str]) -> tuple[str, dict[str, Any]]:
    """The (path, JSON body) of a conversation's turn; ``answers`` are the replies to earlier turns."""
    spec = conversation.turns[turn]
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = chat_messages(conversation, turn, answers)
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def chat_messages(conversation: Conversation, turn: int, answers: list[str]) -> list[Message]:
    """The history up to ``turn``: optional system prompt, then user/assistant pairs, then the user."""
    messages: list[Message] = []
    if conversation.system is not None:
        messages.append({"role": "system", "content": conversation.system})
    for k in range(turn):
        messages.append({"role": "user", "content": str(conversation.turns[k].prompt)})
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append({"role": "user", "content": str(conversation.turns[turn].prompt)})
    return messages


class StreamingClient:
    """Sends requests over one shared ``aiohttp.ClientSession`` and times their streamed chunks.

    ``clock`` returns seconds since the run started; ``count_tokens`` counts the streamed text
    when a server reports no usage.
    """

    def __init__(self, session: aiohttp.ClientSession, config: ServeBenchConfig, clock: Callable[[], float],
                 count_tokens: Callable[[str], int]) -> None:
        self.session = session
        self.config = config
        self.clock = clock
        self.count_tokens = count_tokens

    async def send(self, record: RequestRecord, path: str, body: dict[str, Any]) -> RequestRecord:
        """Send one request and fill ``record``; returns it, with ``error`` set on failure."""
        record.requested_output_tokens = int(body.get("max_tokens") or 0)
        record.start = self.clock()
        try:
            async with asyncio.timeout(self.config.request_timeout):
                await self._stream(record, path, body)
        except Exception as exc:  # a benchmark records failures; it does not stop on them
            record.error = record.error or type(exc).__name__
            record.error_message = record.error_message or str(exc)[:_ERROR_BODY_CHARS]
        record.end = self.clock()
        if record.output_tokens == 0 and record.text:
            record.output_tokens = self.count_tokens(record.text)
        if record.prompt_tokens == 0:
            record.prompt_tokens = record.requested_prompt_tokens
        return record

    async def _stream(self, record: RequestRecord, path: str, body: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        async with self.session.post(self.config.base_url + path, json=body, headers=headers) as response:
            record.request_id = response.headers.get("x-request-id")
            if response.status != 200:
                text = (await response.read()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status}"
                record.error_message = text[:_ERROR_BODY_CHARS]
                return
            pieces: list[str] = []
            async for raw in response.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                now = self.clock()
                text = self._apply_chunk(record, json.loads(data))
                if record.error:
                    break
                if text:
                    record.chunk_times.append(now)
                    pieces.append(text)
            record.text = "".join(pieces)

    @staticmethod
    def _apply_chunk(record: RequestRecord, chunk: dict[str, Any]) -> str:
        """Take usage, finish reason and errors from one chunk; return its text."""
        if "error" in chunk and chunk["error"]:
            error = chunk["error"]
            record.error = f"stream:{error.get('type') or 'error'}" if isinstance(error, dict) else "stream:error"
            record.error_message = str(error.get("message") if isinstance(error, dict) else error)[:_ERROR_BODY_CHARS]
            return ""
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.cached_tokens = int(details["cached_tokens"])
        text = ""
        for choice in chunk.get("choices") or []:
            if "delta" in choice:
                text += (choice.get("delta") or {}).get("content") or ""
            else:
                text += choice.get("text") or ""
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        return text


#: Longest line of a stream the client reads (an SSE event with logprobs can run long).
_MAX_LINE_BYTES = 1 << 20


def make_stream_session(config: ServeBenchConfig) -> aiohttp.ClientSession:
    """One pooled session for the run's streams; the per-request deadline is ``send``'s."""
    limit = config.max_concurrency or 0  # 0: no limit
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, config.request_timeout)),
        read_bufsize=_MAX_LINE_BYTES,
    )


def monotonic_clock() -> Callable[[], float]:
    """Seconds since this call, from a monotonic high-resolution timer."""
    origin = time.perf_counter()
    return lambda: time.perf_counter() - origin
