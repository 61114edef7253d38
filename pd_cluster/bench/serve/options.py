"""The ``bench serve`` command-line options and their translation into a :class:`ServeBenchConfig`.

Kept beside the benchmark rather than in ``cli.py`` so the options and the config they fill
change together; ``cli.py`` only mounts them under ``pd-cluster bench serve``.
"""

from __future__ import annotations

import argparse
import math

from pd_cluster.bench.serve.config import WORKLOADS, ServeBenchConfig


def parse_rate(text: str) -> float:
    """A request rate in req/s: a positive number or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of req/s, or inf)") from None
    if rate <= 0 or math.isnan(rate):
        raise argparse.ArgumentTypeError(f"a rate must be > 0, got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    return [parse_rate(part.strip()) for part in text.split(",") if part.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's address, with or without /v1 (default: %(default)s)")
    target.add_argument("--model", default=None,
                        help='served model name, an HF model directory, or "default" (our default model); '
                             "default: the first model /v1/models lists")
    target.add_argument("--served-model-name", default=None, help="name to put in requests (default: from --model)")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or hub name (default: --model if a directory, else our default "
                             "model when --model names it, else the --model value)")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="/v1/completions or /v1/chat/completions (multi-turn always uses chat)")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random",
                      help="random prompts, a shared prefix, multi-turn chats, or a mix")
    work.add_argument("--num-requests", "--num-prompts", type=int, default=100,
                      help="requests per rate (random, shared-prefix, mixed)")
    work.add_argument("--input-len", type=int, default=1024, help="prompt tokens (per turn for multi-turn)")
    work.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    work.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths drawn uniformly from len*(1-r)..len*(1+r), r in 0.0..1.0")
    work.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups, each with its own prefix")
    work.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the shared prefix")
    work.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations per rate")
    work.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    work.add_argument("--first-turn-len", type=int, default=None,
                      help="multi-turn: tokens of the first message (default: --input-len, like the later turns)")
    work.add_argument("--long-fraction", type=float, default=0.2, help="mixed: share of long requests")
    work.add_argument("--long-input-len", type=int, default=4096, help="mixed: prompt tokens of a long request")
    work.add_argument("--long-output-len", type=int, default=128, help="mixed: max_tokens of a long request")
    work.add_argument("--prompt-format", choices=["text", "token-ids"], default="text",
                      help="completions prompts as decoded text or as token-id lists")
    work.add_argument("--prompt-vocab", choices=["any", "words"], default="any",
                      help="prompts from any ordinary token, or from whole-word tokens only (text that encodes "
                           "back to the same ids, as real text does)")
    work.add_argument("--no-ignore-eos", action="store_true",
                      help="do not send ignore_eos (for servers that refuse it); outputs may then end early")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    work.add_argument("--seed", type=int, default=0, help="prompts and arrivals; the same seed repeats a run")

    load = p.add_argument_group("load")
    load.add_argument("--rate", type=parse_rate, default=math.inf, help="requests (conversations) per second; inf: "
                                                                          "all at once (default)")
    load.add_argument("--sweep", type=parse_rates, default=None, help="comma-separated rates, one result each, "
                                                                       "e.g. 1,2,4,8 (overrides --rate)")
    load.add_argument("--arrival", choices=["poisson", "bursts"], default="poisson",
                      help="poisson (gamma with --burstiness) or bursts of --burst-size at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    load.add_argument("--burst-size", type=int, default=8, help="requests per burst in --arrival bursts")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")

    judge = p.add_argument_group("results")
    judge.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, seconds")
    judge.add_argument("--slo-tpot", type=float, default=0.05, help="goodput SLO on TPOT, seconds")
    judge.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write results as JSON")
    judge.add_argument("--save-requests", action="store_true", help="include per-request records in the JSON")
    judge.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")
    judge.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, served_model_name=args.served_model_name,
        tokenizer=args.tokenizer, api_key=args.api_key, endpoint=args.endpoint, workload=args.workload,
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, num_groups=args.num_groups, prefix_len=args.prefix_len,
        num_conversations=args.num_conversations, turns=args.turns, first_turn_len=args.first_turn_len,
        long_fraction=args.long_fraction,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len,
        prompt_format=args.prompt_format, prompt_vocab=args.prompt_vocab, ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
        rates=args.sweep or [args.rate], arrival=args.arrival, burstiness=args.burstiness,
        burst_size=args.burst_size, max_concurrency=args.max_concurrency, seed=args.seed,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, request_timeout=args.request_timeout,
        save_requests=args.save_requests, progress=not args.no_progress,
    )
