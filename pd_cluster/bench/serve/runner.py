"""The run: resolve model and tokenizer, then for each rate build the workload, send it on its
arrival schedule under the concurrency cap, and summarize.

Each rate gets prompts from its own seed (``seed + rate index``) so a later rate is not served
from the prefix cache an earlier one filled; the whole sweep is still repeatable from one seed.
A conversation's turn is sent only when the previous turn's answer has arrived; the rate is the
arrival rate of conversations (of requests, for single-turn workloads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pd_cluster.bench.serve.arrivals import arrival_times
from pd_cluster.bench.serve.client import StreamingClient, make_stream_session, monotonic_clock, request_body
from pd_cluster.bench.serve.config import ServeBenchConfig, rate_label
from pd_cluster.bench.serve.metrics import RunMetrics, summarize
from pd_cluster.bench.serve.records import RequestRecord
from pd_cluster.bench.serve.server_metrics import KV_TRANSFER_BYTES, scrape_counter
from pd_cluster.bench.serve.workloads import Conversation, build_workload

logger = logging.getLogger(__name__)

#: Sends one request and fills its record: ``StreamingClient.send`` or a stand-in in tests.
Sender = Callable[[RequestRecord, str, dict[str, Any]], Awaitable[RequestRecord]]

#: Error kind of the turns of a conversation left unsent because an earlier turn failed.
CONVERSATION_ABORTED = "conversation_aborted"


class BenchSetupError(RuntimeError):
    """The run cannot start: the endpoint is unreachable, or no model or tokenizer can be found."""


@dataclass
class RateResult:
    metrics: RunMetrics
    records: list[RequestRecord]


@dataclass
class SweepResult:
    config: ServeBenchConfig
    model: str
    tokenizer: str
    results: list[RateResult] = field(default_factory=list)


async def run_conversations(conversations: Sequence[Conversation], offsets: Sequence[float],
                            config: ServeBenchConfig, model: str, send: Sender, clock: Callable[[], float],
                            on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Send every turn: conversation i starts at ``offsets[i]``; its turns go one after another."""
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    first_index = [0]
    for conv in conversations:
        first_index.append(first_index[-1] + len(conv.turns))
    records: list[RequestRecord] = []

    async def drive(i: int, conv: Conversation, offset: float) -> None:
        delay = offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        answers: list[str] = []
        failed = False
        for t, turn in enumerate(conv.turns):
            record = RequestRecord(index=first_index[i] + t, conversation=conv.index, turn=t,
                                   scheduled=offset if t == 0 else clock(), requested_prompt_tokens=turn.input_len)
            if failed:
                record.error = CONVERSATION_ABORTED
                record.requested_output_tokens = turn.max_tokens
                record.start = record.end = record.scheduled
            else:
                path, body = request_body(config, model, conv, t, answers)
                async with limit or nullcontext():
                    await send(record, path, body)
                failed = not record.ok
                answers.append(record.text)
            records.append(record)
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(drive(i, c, o) for i, (c, o) in enumerate(zip(conversations, offsets))))
    records.sort(key=lambda r: r.index)
    return records


async def run_rate(config: ServeBenchConfig, http: httpx.AsyncClient, session: aiohttp.ClientSession, tokenizer: Any,
                   model: str, rate: float, rate_index: int) -> RateResult:
    """One rate: a fresh workload, its arrivals, the requests, and the KV bytes moved meanwhile."""
    seed = config.seed + rate_index
    conversations = build_workload(config, tokenizer, seed)
    offsets = arrival_times(len(conversations), rate, seed=seed, mode=config.arrival,
                            burstiness=config.burstiness, burst_size=config.burst_size)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    kv_before = await scrape_counter(http, config.base_url, KV_TRANSFER_BYTES, headers)
    clock = monotonic_clock()
    client = StreamingClient(session, config, clock, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    with _progress(config, rate) as bar:
        records = await run_conversations(conversations, offsets, config, model, client.send, clock,
                                          on_done=lambda _: bar.update(1))
    duration = clock()
    kv_after = await scrape_counter(http, config.base_url, KV_TRANSFER_BYTES, headers)
    kv_moved = kv_after - kv_before if kv_before is not None and kv_after is not None else None
    metrics = summarize(records, duration, rate=rate, slo_ttft=config.slo_ttft, slo_tpot=config.slo_tpot,
                        kv_transfer_bytes=kv_moved, max_concurrency=config.max_concurrency)
    logger.info("rate %s: %d/%d completed in %.2f s", rate_label(metrics.rate), metrics.completed,
                metrics.num_requests, duration)
    return RateResult(metrics, records)


def make_http_client(config: ServeBenchConfig) -> httpx.AsyncClient:
    """The client of the calls around the streams (the model list, the metrics)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=min(30.0, config.request_timeout)))


async def run_sweep(config: ServeBenchConfig) -> SweepResult:
    """Every rate of ``config.rates`` in order, on one stream session and one tokenizer (and an
    httpx client for the model list and the metrics)."""
    async with make_http_client(config) as http, make_stream_session(config) as session:
        model = await resolve_model_name(http, config)
        source = tokenizer_source(config, model)
        tokenizer = load_tokenizer(source)
        result = SweepResult(config, model, source)
        for i, rate in enumerate(config.rates):
            result.results.append(await run_rate(config, http, session, tokenizer, model, rate, i))
    return result


def run_serve_bench(config: ServeBenchConfig) -> SweepResult:
    return asyncio.run(run_sweep(config))


# ---- model and tokenizer ----------------------------------------------------------------------


async def list_models(http: httpx.AsyncClient, config: ServeBenchConfig) -> list[str]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        response = await http.get(config.base_url + "/v1/models", headers=headers, timeout=30.0)
    except httpx.TransportError as exc:
        raise BenchSetupError(f"cannot reach {config.base_url}: {type(exc).__name__}: {exc}") from None
    try:
        response.raise_for_status()
        return [m["id"] for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logger.warning("could not list models at %s: %s", config.base_url, exc)
        return []


async def resolve_model_name(http: httpx.AsyncClient, config: ServeBenchConfig) -> str:
    """The name to put in requests: given, or the server's own when ``--model`` is a path or "default"."""
    if config.served_model_name:
        return config.served_model_name
    listed = await list_models(http, config)
    return choose_model_name(config.model, listed)


def choose_model_name(model: str | None, listed: list[str]) -> str:
    from pd_cluster.default_model import DEFAULT_MODEL_NAME

    if model is None or model == "default":
        if listed:
            return listed[0]
        if model is None:
            raise BenchSetupError("no --model given and the server lists no models at /v1/models")
        return DEFAULT_MODEL_NAME
    if model in listed or not listed:
        return model
    if Path(model).expanduser().is_dir() and len(listed) == 1:
        return listed[0]  # our master serves a directory under the model's own name
    return model


def tokenizer_source(config: ServeBenchConfig, served: str) -> str:
    """``--tokenizer``, else the ``--model`` directory, else our default model for its name, else the name."""
    from pd_cluster.default_model import DEFAULT_MODEL_NAME, default_model_path

    if config.tokenizer:
        return config.tokenizer
    model = config.model
    if model and Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if model in ("default", DEFAULT_MODEL_NAME) or (model is None and served == DEFAULT_MODEL_NAME):
        return str(default_model_path())
    return model or served


def load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise BenchSetupError(f"cannot load the tokenizer {source!r} ({exc}); pass --tokenizer PATH") from None


def _progress(config: ServeBenchConfig, rate: float):
    from tqdm import tqdm

    return tqdm(total=config.total_requests, desc=f"rate {rate_label(rate)} req/s", unit="req",
                disable=not config.progress)
