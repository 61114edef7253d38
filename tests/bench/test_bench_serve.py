"""`pd-cluster bench serve` in parts: metrics on a hand-checked trace, workloads, arrivals, the
turn order of conversations, the SSE client, Prometheus parsing, report and plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import replace

import numpy as np
import pytest
from aiohttp import web

from pd_cluster.bench.serve.arrivals import arrival_times
from pd_cluster.bench.serve.client import StreamingClient, make_stream_session, request_body
from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.metrics import meets_slo, percentile, summarize
from pd_cluster.bench.serve.options import add_arguments, config_from_args
from pd_cluster.bench.serve.plots import MISSING_MATPLOTLIB, PLOT_FILES, require_matplotlib, write_plots
from pd_cluster.bench.serve.records import RequestRecord
from pd_cluster.bench.serve.report import format_table, results_document
from pd_cluster.bench.serve.runner import (
    CONVERSATION_ABORTED, BenchSetupError, RateResult, SweepResult, choose_model_name, run_conversations, run_sweep,
    tokenizer_source,
)
from pd_cluster.bench.serve.server_metrics import KV_TRANSFER_BYTES, parse_counter
from pd_cluster.bench.serve.workloads import Conversation, Turn, build_workload
from tests.cluster_harness import free_port

EXACT = {"abs": 1e-12}


# ---- metrics on a recorded trace ---------------------------------------------------------------


def trace() -> list[RequestRecord]:
    """Six requests over 4 s; every number below was worked out by hand from these times."""
    return [
        # ttft .25, e2e 1, tpot .75/3 = .25 (misses the TPOT SLO), itl .25 x3
        RequestRecord(0, start=0.0, chunk_times=[0.25, 0.5, 0.75, 1.0], end=1.0, output_tokens=4,
                      prompt_tokens=10, cached_tokens=0, requested_output_tokens=4),
        # ttft .125, e2e .25, tpot .125/2 = .0625 (misses a 50 ms TPOT SLO, meets 100 ms), itl .0625 x2
        RequestRecord(1, start=0.5, chunk_times=[0.625, 0.6875, 0.75], end=0.75, output_tokens=3,
                      prompt_tokens=20, cached_tokens=8, requested_output_tokens=4),
        # ttft 2 (misses TTFT), e2e 2, one token: no TPOT, no ITL
        RequestRecord(2, start=1.0, chunk_times=[3.0], end=3.0, output_tokens=1, prompt_tokens=30,
                      cached_tokens=None, requested_output_tokens=4),
        RequestRecord(3, start=1.0, end=1.25, error="HTTP 503", requested_output_tokens=4),
        # ttft .5, e2e .625, tpot .125/3 = .041666 (meets both), itl .03125 x3
        RequestRecord(4, start=2.0, chunk_times=[2.5, 2.53125, 2.5625, 2.59375], end=2.625, output_tokens=4,
                      prompt_tokens=40, cached_tokens=16, requested_output_tokens=4),
        RequestRecord(5, start=2.0, end=4.0, error="ReadTimeout", requested_output_tokens=4),
    ]


def test_record_ttft_tpot_itl_follow_vllm_definitions():
    a, b, c, _, e, _ = trace()
    assert (a.ttft, a.e2e, a.tpot, a.itl) == (0.25, 1.0, 0.25, [0.25, 0.25, 0.25])
    assert (b.ttft, b.e2e, b.tpot, b.itl) == (0.125, 0.25, 0.0625, [0.0625, 0.0625])
    assert (c.ttft, c.e2e, c.tpot, c.itl) == (2.0, 2.0, None, [])
    assert e.ttft == 0.5 and e.e2e == 0.625 and e.tpot == pytest.approx(0.125 / 3, **EXACT)
    assert e.itl == [0.03125, 0.03125, 0.03125]


def test_percentile_interpolates_like_numpy():
    assert percentile([0.125, 0.25, 0.5, 2.0], 50) == 0.375
    assert percentile([0.125, 0.25, 0.5, 2.0], 90) == pytest.approx(1.55, **EXACT)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    values = np.random.default_rng(3).exponential(size=101).tolist()
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), **EXACT)


def test_summary_of_the_trace_matches_hand_computation():
    m = summarize(trace(), 4.0, rate=2.0, slo_ttft=1.0, slo_tpot=0.05, kv_transfer_bytes=4600.0)
    assert (m.num_requests, m.completed, m.failed) == (6, 4, 2)
    assert m.errors == {"HTTP 503": 1, "ReadTimeout": 1}
    assert m.request_throughput == 1.0
    assert m.output_tokens == 12 and m.output_throughput == 3.0
    assert m.requested_output_tokens == 24
    assert m.prompt_tokens == 100 and m.total_token_throughput == 28.0
    assert m.cached_prompt_tokens == 24 and m.cached_fraction == 0.24
    # Only request 4 meets TTFT <= 1 s and TPOT <= 50 ms: 1 good request in 4 s, 1 of 6 sent.
    assert m.goodput == 0.25
    assert m.slo_attainment == pytest.approx(1 / 6, **EXACT)
    assert m.ttft == pytest.approx({"mean": 0.71875, "p50": 0.375, "p90": 1.55, "p99": 1.955}, **EXACT)
    tpots = sorted([0.25, 0.0625, 0.125 / 3])
    assert m.tpot == pytest.approx({"mean": sum(tpots) / 3, "p50": 0.0625, "p90": 0.0625 + 0.8 * 0.1875,
                                    "p99": 0.0625 + 0.98 * 0.1875}, **EXACT)
    assert m.itl == pytest.approx({"mean": 0.96875 / 8, "p50": 0.0625, "p90": 0.25, "p99": 0.25}, **EXACT)
    assert m.e2e == pytest.approx({"mean": 0.96875, "p50": 0.8125, "p90": 1.7, "p99": 1.97}, **EXACT)
    assert m.kv_transfer_bytes == 4600.0 and m.kv_bytes_per_prompt_token == 46.0


def test_goodput_judges_both_slos_and_one_token_requests_on_ttft_alone():
    a, b, c, d, e, _ = trace()
    assert [meets_slo(r, 1.0, 0.05) for r in (a, b, c, d, e)] == [False, False, False, False, True]
    assert [meets_slo(r, 1.0, 0.1) for r in (a, b, c, d, e)] == [False, True, False, False, True]
    assert meets_slo(c, 2.0, 0.0)  # one output token: no TPOT to judge
    m = summarize(trace(), 4.0, rate=math.inf, slo_ttft=2.0, slo_tpot=0.3)
    assert m.goodput == 1.0 and m.slo_attainment == pytest.approx(4 / 6, **EXACT)
    assert m.rate == "inf" and m.kv_bytes_per_prompt_token is None and m.kv_transfer_bytes is None


def test_no_cached_tokens_reported_means_none_not_zero():
    records = [RequestRecord(0, start=0.0, chunk_times=[0.5], end=0.5, output_tokens=1, prompt_tokens=5)]
    m = summarize(records, 1.0, rate=1.0, slo_ttft=1.0, slo_tpot=0.05)
    assert m.cached_prompt_tokens is None and m.cached_fraction is None


# ---- workloads and arrivals --------------------------------------------------------------------


def prompts(conversations: list[Conversation]) -> list:
    return [(c.system, [t.prompt for t in c.turns], [t.max_tokens for t in c.turns]) for c in conversations]


@pytest.mark.parametrize("workload", ["random", "shared-prefix", "multi-turn", "mixed"])
def test_workloads_repeat_with_a_seed_and_change_with_another(tokenizer, workload):
    config = ServeBenchConfig(workload=workload, num_requests=6, input_len=24, output_len=8, range_ratio=0.5,
                              num_groups=2, prefix_len=40, num_conversations=3, turns=3, long_input_len=64)
    first = build_workload(config, tokenizer, seed=7)
    assert prompts(first) == prompts(build_workload(config, tokenizer, seed=7))
    assert prompts(first) != prompts(build_workload(config, tokenizer, seed=8))
    assert sum(len(c.turns) for c in first) == config.total_requests


def test_random_prompts_have_the_asked_lengths_in_their_range(tokenizer):
    config = ServeBenchConfig(num_requests=40, input_len=32, output_len=10, range_ratio=0.25)
    turns = [c.turns[0] for c in build_workload(config, tokenizer, seed=1)]
    assert all(24 <= t.input_len <= 40 and 8 <= t.max_tokens <= 12 for t in turns)
    assert len({t.input_len for t in turns}) > 1
    for t in turns:  # decoded text re-encodes to the intended number of tokens
        assert len(tokenizer.encode(t.prompt, add_special_tokens=False)) == t.input_len
    ids = build_workload(ServeBenchConfig(num_requests=5, input_len=32, prompt_format="token-ids"), tokenizer, 1)
    special = set(tokenizer.all_special_ids)
    for c in ids:
        assert len(c.turns[0].prompt) == 32 and not special & set(c.turns[0].prompt)


def test_word_prompts_encode_back_to_the_ids_drawn_inside_the_chat_template(tokenizer):
    from pd_cluster.bench.words import whole_word_ids

    words = set(whole_word_ids(tokenizer))
    config = ServeBenchConfig(workload="multi-turn", num_conversations=3, turns=2, input_len=40, prompt_vocab="words")
    for conv in build_workload(config, tokenizer, seed=3):
        for turn in conv.turns:
            ids = tokenizer.encode(turn.prompt, add_special_tokens=False)
            assert len(ids) == turn.input_len == 40 and set(ids) <= words
        # As an answer inside the template, the same text is the same ids after the role header.
        header = list(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
        chat = list(tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": conv.turns[0].prompt}],
                                                  tokenize=True, return_dict=False))
        answer = tokenizer.encode(conv.turns[0].prompt, add_special_tokens=False)
        assert chat[:len(header) + len(answer)] == header + answer
    anywhere = build_workload(replace(config, prompt_vocab="any"), tokenizer, seed=3)
    assert any(not set(tokenizer.encode(t.prompt, add_special_tokens=False)) <= words
               for c in anywhere for t in c.turns)
    with pytest.raises(ValueError, match="prompt_vocab"):
        ServeBenchConfig(prompt_vocab="letters")


def test_shared_prefix_groups_share_their_prompt_start(tokenizer):
    config = ServeBenchConfig(workload="shared-prefix", num_requests=6, num_groups=2, prefix_len=50, input_len=10,
                              prompt_format="token-ids")
    convs = build_workload(config, tokenizer, seed=0)
    heads = [tuple(c.turns[0].prompt[:50]) for c in convs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] == heads[5] and heads[0] != heads[1]
    chat = build_workload(ServeBenchConfig(workload="shared-prefix", endpoint="chat", num_requests=4, num_groups=2,
                                           prefix_len=50, input_len=10), tokenizer, seed=0)
    assert chat[0].system == chat[2].system != chat[1].system


def test_mixed_workload_has_long_and_short_requests(tokenizer):
    config = ServeBenchConfig(workload="mixed", num_requests=40, input_len=8, long_input_len=64,
                              long_fraction=0.5, prompt_format="token-ids")
    lengths = {c.turns[0].input_len for c in build_workload(config, tokenizer, seed=0)}
    assert lengths == {8, 64}


def test_poisson_arrivals_have_the_asked_mean_rate_and_repeat_with_a_seed():
    times = arrival_times(4000, 5.0, seed=11)
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.05)
    assert times == arrival_times(4000, 5.0, seed=11) != arrival_times(4000, 5.0, seed=12)
    gaps = np.diff(times)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1
    bursty = np.diff(arrival_times(4000, 5.0, seed=11, burstiness=0.25))
    assert np.mean(bursty) == pytest.approx(0.2, rel=0.1) and np.std(bursty) / np.mean(bursty) > 1.5


def test_bursts_send_groups_at_once_and_inf_sends_everything_at_once():
    times = arrival_times(2000, 4.0, seed=3, mode="bursts", burst_size=5)
    assert all(times[i] == times[i - i % 5] for i in range(2000))
    assert len(set(times)) == 400
    assert (len(set(times)) - 1) * 5 / times[-1] == pytest.approx(4.0, rel=0.1)
    assert arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


# ---- running conversations ---------------------------------------------------------------------


class FakeEndpoint:
    """Stands in for a server: logs when each request starts and ends, answers after a few yields."""

    def __init__(self, fail: set[tuple[int, int]] = frozenset()) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.bodies: dict[tuple[int, int], dict] = {}
        self.in_flight = self.max_in_flight = 0
        self.fail = fail

    async def send(self, record: RequestRecord, path: str, body: dict) -> RequestRecord:
        key = (record.conversation, record.turn)
        self.events.append(("start", *key))
        self.bodies[key] = body
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(5):
            await asyncio.sleep(0)
        self.in_flight -= 1
        if key in self.fail:
            record.error = "HTTP 500"
        else:
            record.text = f"answer {key}"
            record.output_tokens = 2
        self.events.append(("end", *key))
        return record


def conversations(n: int, turns: int) -> list[Conversation]:
    return [Conversation(c, [Turn(f"question {c}.{t}", 3, 2) for t in range(turns)]) for c in range(n)]


def clock() -> float:
    return 0.0


async def test_multi_turn_sends_each_turn_after_the_previous_answer():
    endpoint = FakeEndpoint()
    config = ServeBenchConfig(workload="multi-turn", num_conversations=3, turns=3)
    records = await run_conversations(conversations(3, 3), [0.0] * 3, config, "m", endpoint.send, clock)
    assert [r.index for r in records] == list(range(9)) and all(r.ok for r in records)
    position = {event: i for i, event in enumerate(endpoint.events)}
    for c in range(3):
        for t in range(1, 3):
            assert position[("end", c, t - 1)] < position[("start", c, t)]
            messages = endpoint.bodies[(c, t)]["messages"]
            assert messages[-2] == {"role": "assistant", "content": f"answer {(c, t - 1)}"}
            assert messages[-1] == {"role": "user", "content": f"question {c}.{t}"}
            assert len(messages) == 2 * t + 1
    # Conversations did run side by side: another one started before conversation 0 finished.
    assert position[("start", 1, 0)] < position[("end", 0, 0)]


async def test_max_concurrency_caps_requests_in_flight():
    endpoint = FakeEndpoint()
    config = ServeBenchConfig(num_requests=8, max_concurrency=2)
    records = await run_conversations(conversations(8, 1), [0.0] * 8, config, "m", endpoint.send, clock)
    assert len(records) == 8 and endpoint.max_in_flight == 2
    unbounded = FakeEndpoint()
    await run_conversations(conversations(8, 1), [0.0] * 8, ServeBenchConfig(), "m", unbounded.send, clock)
    assert unbounded.max_in_flight == 8


async def test_a_failed_turn_ends_its_conversation_and_is_counted():
    endpoint = FakeEndpoint(fail={(0, 0)})
    config = ServeBenchConfig(workload="multi-turn", num_conversations=2, turns=2)
    records = await run_conversations(conversations(2, 2), [0.0, 0.0], config, "m", endpoint.send, clock)
    assert [r.error for r in records] == ["HTTP 500", CONVERSATION_ABORTED, None, None]
    assert (0, 1) not in endpoint.bodies


# ---- the streaming client ----------------------------------------------------------------------


def sse(*docs: dict | str) -> bytes:
    return "".join(f"data: {d if isinstance(d, str) else json.dumps(d)}\n\n" for d in docs).encode()


def chat_chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": None}


async def stream_one(handler, config: ServeBenchConfig, path: str = "/v1/chat/completions") -> RequestRecord:
    """``handler``'s answer, served by an aiohttp server on loopback, read by the client (``handler``
    None: a port nothing listens on)."""
    ticks = iter(range(100))
    runner = None
    if handler is None:
        port = free_port()
    else:
        app = web.Application()
        app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
    try:
        config = replace(config, base_url=f"http://127.0.0.1:{port}")
        async with make_stream_session(config) as session:
            client = StreamingClient(session, config, lambda: float(next(ticks)), lambda text: len(text.split()))
            return await client.send(RequestRecord(0, requested_prompt_tokens=7), path, {"max_tokens": 3})
    finally:
        if runner is not None:
            await runner.cleanup()


async def test_client_times_content_chunks_and_reads_usage():
    seen = {}

    async def handler(request: web.Request) -> web.Response:
        seen["auth"] = request.headers.get("authorization")
        seen["body"] = await request.json()
        usage = {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
        body = sse(chat_chunk(""), chat_chunk("a"), chat_chunk(" b"), chat_chunk(" c", "length"),
                   {"choices": [], "usage": usage}, "[DONE]")
        return web.Response(body=body, headers={"content-type": "text/event-stream", "x-request-id": "chatcmpl-7"})

    r = await stream_one(handler, ServeBenchConfig(api_key="k"))
    assert seen == {"auth": "Bearer k", "body": {"max_tokens": 3}}
    assert r.request_id == "chatcmpl-7"  # the master's id: its request log line
    # clock ticks: start 0, then one tick per data line: 1 ("" role chunk), 2, 3, 4 (content), 5 (usage)
    assert r.ok and r.text == "a b c" and r.chunk_times == [2.0, 3.0, 4.0] and r.start == 0.0
    assert (r.ttft, r.itl, r.finish_reason) == (2.0, [1.0, 1.0], "length")
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens, r.requested_output_tokens) == (9, 3, 4, 3)


async def test_client_without_usage_counts_text_with_the_tokenizer():
    async def handler(request: web.Request) -> web.Response:
        chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("x", " y")]
        return web.Response(body=sse(*chunks, "[DONE]"), content_type="text/event-stream")

    r = await stream_one(handler, ServeBenchConfig(), "/v1/completions")
    assert r.ok and r.output_tokens == 2 and r.prompt_tokens == 7 and r.cached_tokens is None


async def test_client_reads_events_longer_than_a_read_buffer():
    # An event with logprobs can run to hundreds of kilobytes: it is one line of the stream.
    long_text = "x" * 300_000

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=sse(chat_chunk(long_text), chat_chunk("y", "stop"), "[DONE]"),
                            content_type="text/event-stream")

    r = await stream_one(handler, ServeBenchConfig())
    assert r.ok and r.text == long_text + "y" and len(r.chunk_times) == 2


async def test_client_records_http_stream_and_connection_errors():
    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    r = await stream_one(refused, ServeBenchConfig())
    assert r.error == "HTTP 429" and "busy" in r.error_message

    async def broken(request: web.Request) -> web.Response:
        error = {"error": {"message": "decode node lost", "type": "server_error"}}
        return web.Response(body=sse(chat_chunk("a"), chat_chunk(None, "error"), error, "[DONE]"),
                            content_type="text/event-stream")

    r = await stream_one(broken, ServeBenchConfig())
    assert r.error == "stream:server_error" and r.error_message == "decode node lost"

    r = await stream_one(None, ServeBenchConfig())
    assert r.error == "ClientConnectorError" and not r.ok


def test_request_body_asks_for_streamed_usage_and_a_forced_length():
    conv = Conversation(0, [Turn([1, 2, 3], 3, 5)])
    path, body = request_body(ServeBenchConfig(), "m", conv, 0, [])
    assert path == "/v1/completions" and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 5
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    _, body = request_body(ServeBenchConfig(ignore_eos=False), "m", conv, 0, [])
    assert "ignore_eos" not in body
    chat = Conversation(0, [Turn("hi", 1, 5)], system="be brief")
    path, body = request_body(ServeBenchConfig(endpoint="chat"), "m", chat, 0, [])
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


# ---- server metrics, options, model names -------------------------------------------------------


def test_kv_bytes_counter_is_read_from_prometheus_text():
    text = (f"# HELP {KV_TRANSFER_BYTES} KV bytes\n# TYPE {KV_TRANSFER_BYTES} counter\n"
            f"{KV_TRANSFER_BYTES} 1.5e+06\npdc_kv_transfer_bytes_created 1.7e+09\n"
            f'{KV_TRANSFER_BYTES}{{node="a"}} 500\n')
    assert parse_counter(text, KV_TRANSFER_BYTES) == 1_500_500.0
    assert parse_counter("vllm:num_requests_running 3\n", KV_TRANSFER_BYTES) is None


def parse(*argv: str) -> ServeBenchConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_options_fill_the_config():
    assert parse().rates == [math.inf]
    assert parse("--rate", "2.5").rates == [2.5]
    config = parse("--sweep", "1,2,4,inf", "--base-url", "http://h:1/v1/", "--workload", "multi-turn",
                   "--no-ignore-eos", "--max-concurrency", "3")
    assert config.rates == [1.0, 2.0, 4.0, math.inf] and config.base_url == "http://h:1"
    assert config.endpoint == "chat" and not config.ignore_eos and config.max_concurrency == 3
    assert config.to_json()["rates"] == [1.0, 2.0, 4.0, "inf"]
    with pytest.raises(SystemExit):
        parse("--rate", "0")
    with pytest.raises(ValueError):
        ServeBenchConfig(range_ratio=1.5)


def test_model_name_and_tokenizer_resolution(default_model_dir, tmp_path):
    assert choose_model_name(None, ["served"]) == "served"
    assert choose_model_name("default", ["SmolLM2-135M-Instruct"]) == "SmolLM2-135M-Instruct"
    assert choose_model_name(str(tmp_path), ["served"]) == "served"  # a directory our master serves by name
    assert choose_model_name("meta/llama", []) == "meta/llama"
    assert tokenizer_source(ServeBenchConfig(model="default"), "SmolLM2-135M-Instruct") == str(default_model_dir)
    assert tokenizer_source(ServeBenchConfig(), "SmolLM2-135M-Instruct") == str(default_model_dir)
    assert tokenizer_source(ServeBenchConfig(model=str(tmp_path)), "x") == str(tmp_path)
    assert tokenizer_source(ServeBenchConfig(model="a", tokenizer="/t"), "a") == "/t"
    assert tokenizer_source(ServeBenchConfig(model="org/llama"), "org/llama") == "org/llama"


async def test_an_unreachable_endpoint_stops_the_run_before_it_starts():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchSetupError, match="cannot reach"):
        await run_sweep(ServeBenchConfig(base_url=f"http://127.0.0.1:{port}", progress=False))


# ---- report and plots --------------------------------------------------------------------------


def sweep_of_trace(save_requests: bool = True) -> SweepResult:
    config = ServeBenchConfig(rates=[1.0, 2.0], save_requests=save_requests)
    results = [RateResult(summarize(trace(), 4.0, rate=r, slo_ttft=1.0, slo_tpot=0.1, kv_transfer_bytes=4600.0),
                          trace()) for r in config.rates]
    return SweepResult(config, "m", "tok", results)


def test_table_and_json_hold_every_rate():
    sweep = sweep_of_trace()
    table = format_table(sweep)
    assert "goodput" in table and "375/1550/1955" in table and "errors at rate 2: HTTP 503: 1, ReadTimeout: 1" in table
    doc = json.loads(json.dumps(results_document(sweep)))
    assert [r["rate"] for r in doc["results"]] == [1.0, 2.0]
    assert doc["config"]["slo_ttft"] == 1.0 and len(doc["results"][0]["requests"]) == 6
    assert doc["results"][0]["requests"][1]["tpot"] == 0.0625
    assert "requests" not in results_document(sweep_of_trace(save_requests=False))["results"][0]


def test_plots_are_written(tmp_path):
    paths = write_plots(sweep_of_trace(), tmp_path / "plots")
    assert [p.name for p in paths] == list(PLOT_FILES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install 'pd-cluster\\[bench\\]'") as info:
        require_matplotlib()
    assert str(info.value) == MISSING_MATPLOTLIB
