"""The ``pd-cluster`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger("pd_cluster")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help='"default" (SmolLM2-135M-Instruct) or an HF model directory')
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV slots (default: from free memory)")
    p.add_argument("--block-size", type=int, default=1, help="tokens per prefix-cache / transfer block")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-cache", action="store_true")


def engine_config_from_args(args: argparse.Namespace):
    from pd_cluster.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
        block_size=args.block_size, max_running_requests=args.max_running_requests,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_cache=not args.no_prefix_cache,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    if args.chat:
        ids = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    else:
        ids = list(tok.encode(args.prompt, add_special_tokens=False))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine.add_request("cli", ids, params)
    finish = None
    while engine.has_unfinished():
        for update in engine.step():
            sys.stdout.write(update.text_delta)
            sys.stdout.flush()
            finish = update.finish_reason or finish
    sys.stdout.write("\n")
    logger.info("finish_reason=%s", finish)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pd_cluster.bench.offline import format_table, run_offline_bench

    result = run_offline_bench(
        model=args.model, batch_sizes=tuple(args.batch_sizes), max_tokens=args.max_tokens, device=args.device,
        out_dir=Path(args.out_dir),
    )
    sys.stdout.write(format_table(result))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from pd_cluster.bench.serve.options import config_from_args
    from pd_cluster.bench.serve.plots import require_matplotlib, write_plots
    from pd_cluster.bench.serve.report import format_table, write_json
    from pd_cluster.bench.serve.runner import BenchSetupError, run_serve_bench

    try:
        config = config_from_args(args)
        if args.plot_dir:
            require_matplotlib()  # before the run, not after an hour of it
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"pd-cluster bench serve: {e}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bar
    try:
        sweep = run_serve_bench(config)
    except BenchSetupError as e:
        raise SystemExit(f"pd-cluster bench serve: {e}") from None
    sys.stdout.write(format_table(sweep))
    if args.json_path:
        sys.stdout.write(f"results: {write_json(sweep, Path(args.json_path))}\n")
    if args.plot_dir:
        for path in write_plots(sweep, Path(args.plot_dir)):
            sys.stdout.write(f"plot: {path}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-cluster", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline with one engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    offline = bench_sub.add_parser("offline", help="engine vs transformers generate(), batch 1 and 16")
    offline.add_argument("--model", default="default")
    offline.add_argument("--device", default="auto")
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    offline.add_argument("--out-dir", default="docs/benchmarks")
    offline.set_defaults(func=cmd_bench)
    from pd_cluster.bench.serve.options import add_arguments as add_bench_serve_arguments

    serve = bench_sub.add_parser(
        "serve", help="serving benchmark against an OpenAI-compatible endpoint (TTFT/TPOT/ITL, goodput)",
        description="Serving benchmark against any OpenAI-compatible endpoint: workloads, arrival rates, "
                    "TTFT/TPOT/ITL/E2E percentiles, goodput at an SLO; table, JSON and PNG plots.",
    )
    add_bench_serve_arguments(serve)
    serve.set_defaults(func=cmd_bench_serve)

    from pd_cluster import cli_serve

    cli_serve.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
