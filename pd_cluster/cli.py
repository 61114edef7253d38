"""The ``pd-cluster`` command line: the parser and every command (``ray`` comes from
:mod:`pd_cluster.ray_launcher.cli`).

Roles are imported inside the commands that start them, so ``pd-cluster generate`` or ``bench``
loads no role and a role loads none of the others."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from pd_cluster.config import EngineConfig
from pd_cluster.engine_flags import PASSED_ON, add_engine_arguments, engine_flag, given_values

logger = logging.getLogger("pd_cluster")


#: A decode node's step budget by default: at most this many prompt tokens of its local prefills
#: ride in one step (up to it a chunk costs a decode batch about one step, measured on an H200).
DECODE_STEP_TOKENS = 512


#: Node roles whose batch limit defaults to ``auto`` (sized for decoding from the KV pool); a
#: prefill node's batch is its prefill's, bound by its step budget, and keeps the fixed default.
AUTO_ROWS_ROLES = ("decode", "mixed")


def engine_config_from_args(args: argparse.Namespace, role: str | None = None) -> EngineConfig:
    """The engine a command's flags ask for; a decode node's step budget defaults to
    ``DECODE_STEP_TOKENS``, and a decode or mixed node's batch limit to ``auto``."""
    values = given_values(args)
    if role == "decode":
        values.setdefault("max_num_batched_tokens", DECODE_STEP_TOKENS)
    if role in AUTO_ROWS_ROLES:
        values.setdefault("max_running_requests", "auto")
    return EngineConfig(**values)


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


def cmd_quantize(args: argparse.Namespace) -> int:
    from pd_cluster.quantize.checkpoint import quantize_checkpoint
    from pd_cluster.quantize.options import QuantizeOptions

    options = QuantizeOptions(model=args.model, out=Path(args.out), method=args.method, window=args.window,
                              sampled_tokens=args.sampled_tokens, damp=args.damp, act_order=args.act_order,
                              device=args.device)
    if args.calibration is not None:
        options.calibration = Path(args.calibration)
    out = quantize_checkpoint(options)
    sys.stdout.write(f"{out}\n")
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


# ---- cluster processes ----------------------------------------------------------------


def _node_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--master", required=True,
                   help="the master's HTTP address, e.g. http://127.0.0.1:8000; several masters: comma-separated "
                        "(the node registers with each)")
    p.add_argument("--node-id", default=None, help="unique node name (default: host-pid)")
    p.add_argument("--status-host", default="127.0.0.1", help="bind address of the status server (--status-port)")
    p.add_argument("--status-port", type=int, default=0, help="serve /livez, /readyz, /drain here (0: off)")
    p.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds a draining node waits for its requests before it leaves anyway")
    p.add_argument("--lease-s", type=float, default=30.0, help="KV reservation lease on decode nodes")
    p.add_argument("--kv-ipc", action=argparse.BooleanOptionalAction, default=True,
                   help="on one GPU, write KV in place into the decode node's pool (CUDA IPC) instead of sending it")
    p.add_argument("--tls-ca", default=None,
                   help="CA file (PEM) that an https:// master's certificate and decode nodes' data-plane "
                        "certificates are checked against (default: the system's CAs)")
    p.add_argument("--data-tls", action=argparse.BooleanOptionalAction, default=None,
                   help="data-plane control connections over TLS (not the KV tensors: gloo/NCCL carry them "
                        "as they are); default: on when --tls-ca or --tls-cert is given")
    if role in ("decode", "mixed"):
        p.add_argument("--kv-ipc-across-gpus", action="store_true",
                       help="also share the KV pool with prefill nodes on other GPUs of this host")
        p.add_argument("--data-host", default="127.0.0.1", help="address prefill nodes dial (advertised)")
        p.add_argument("--data-bind", default=None, help="bind address of the data plane (default: --data-host)")
        p.add_argument("--data-port", type=int, default=0, help="port of the data plane (0: any free one)")
        p.add_argument("--tls-cert", default=None,
                       help="certificate (PEM) the data-plane listener presents; it must name --data-host")
        p.add_argument("--tls-key", default=None, help="the key of --tls-cert")
    else:
        p.add_argument("--max-channels", type=int, default=8,
                       help="data-plane channels to decode nodes kept open (least recently used closed first)")
        p.add_argument("--data-tls-name", default=None,
                       help="check decode nodes' data-plane certificates against this name instead of each "
                            "one's --data-host (one certificate for nodes with addresses not known ahead)")
    add_engine_arguments(p)


def _node_settings(args: argparse.Namespace, role: str):
    from pd_cluster.node.config import NodeSettings

    fields = {"master": args.master, "engine": engine_config_from_args(args, role), "status_host": args.status_host,
              "status_port": args.status_port, "drain_timeout_s": args.drain_timeout, "lease_s": args.lease_s,
              "kv_ipc": args.kv_ipc}
    tls = {"tls_ca": args.tls_ca, "data_tls": args.data_tls, "tls_cert": getattr(args, "tls_cert", None),
           "tls_key": getattr(args, "tls_key", None)}
    fields.update({k: v for k, v in tls.items() if v is not None})  # left out: $PD_TLS_* or the default
    if args.node_id:
        fields["node_id"] = args.node_id
    if role in ("decode", "mixed"):
        fields.update(data_host=args.data_host, data_bind=args.data_bind, data_port=args.data_port,
                      kv_ipc_across_gpus=args.kv_ipc_across_gpus)
    else:
        fields["max_channels"] = args.max_channels
        if args.data_tls_name:
            fields["data_tls_name"] = args.data_tls_name
    if not os.environ.get("PD_CLUSTER_TOKEN"):
        raise SystemExit("PD_CLUSTER_TOKEN is not set: nodes authenticate to the master with it")
    try:
        settings = NodeSettings(**fields)
        # The TLS files are read now: a missing or bad one stops the node before it loads a model.
        settings.master_link_tls()
        if role in ("decode", "mixed"):
            settings.data_listener_tls()
        else:
            settings.data_dialer_tls()
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        raise SystemExit(f"pd-cluster {role}: {e}") from None
    return settings


def cmd_node(args: argparse.Namespace) -> int:
    """A node of the role the command names, able to change role when the master asks."""
    from decode_node.node import DecodeNode, MixedNode
    from pd_cluster.aio import run
    from pd_cluster.node.agent import RegistrationRefused
    from pd_cluster.node.role_switch import RoleSwitchingNode
    from prefill_node.node import PrefillNode

    settings = _node_settings(args, args.command)
    try:
        run(RoleSwitchingNode(settings, args.command,
                              {"prefill": PrefillNode, "decode": DecodeNode, "mixed": MixedNode}).run())
    except RegistrationRefused as e:
        logger.error("the master refused this node: %s", e)
        return 2
    return 0


def add_planning_arguments(p: argparse.ArgumentParser) -> None:
    """The master's latency targets and planner (``pd-cluster master`` and ``pd-cluster local``)."""
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="time per output token to serve streams to: a decode node prefills a request itself only "
                        "while its running streams stay under it (default: none, every second a local prefill "
                        "takes from them counts)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time to the first token to serve requests to (the planner's prefill target; default: none)")
    p.add_argument("--planner", default=None, choices=["off", "slo"],
                   help="slo: move nodes between the prefill and decode roles as the load mix and the nodes' "
                        "measured rates call for, every few seconds, with hysteresis (default: off)")


def cmd_master(args: argparse.Namespace) -> int:
    from master.app import ConfigError
    from master.config import MasterSettings
    from master.server import run_master

    given = {k: v for k, v in {
        "host": args.host, "port": args.port, "model": args.model, "policy": args.policy,
        "max_model_len": args.max_model_len, "request_timeout_s": args.request_timeout,
        "served_model_name": args.served_model_name, "log_format": args.log_format,
        "api_keys": args.api_key, "api_keys_file": args.api_keys_file,
        "max_concurrent_per_key": args.max_concurrent_per_key,
        "local_prefill_max_tokens": args.local_prefill_max_tokens,
        "slo_tpot_ms": args.slo_tpot_ms, "slo_ttft_ms": args.slo_ttft_ms, "planner": args.planner,
        "tls_cert": args.tls_cert, "tls_key": args.tls_key, "workers": args.workers,
        "worker_ports": args.worker_ports, "advertise_host": args.advertise_host,
    }.items() if v is not None}
    try:
        run_master(MasterSettings(**given))
    except (ConfigError, ValueError) as e:  # ValueError: pydantic's ValidationError of the settings
        logger.error("%s", e)
        return 2
    return 0


def cmd_node_drain(args: argparse.Namespace) -> int:
    import httpx

    base = f"http://127.0.0.1:{args.status_port}"
    deadline = time.monotonic() + args.timeout
    try:
        httpx.post(f"{base}/drain", timeout=5).raise_for_status()
        while time.monotonic() < deadline:
            if httpx.get(f"{base}/drain", timeout=5).json().get("done"):
                logger.info("node drained")
                return 0
            time.sleep(0.5)
    except httpx.HTTPError as e:
        logger.info("node status server gone (%s): treating the node as stopped", e)
        return 0
    logger.warning("node still busy after %.0fs", args.timeout)
    return 1


def _gpu_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1 (got {text!r})") from None


#: The engine flags ``pd-cluster local`` hands to its nodes; it sets their device and GPU share itself.
LOCAL_ENGINE_FLAGS = (engine_flag("model"), *PASSED_ON)


def cmd_local(args: argparse.Namespace) -> int:
    """Master + P prefill + D decode nodes as supervised processes on this machine."""
    from pd_cluster.local_cluster import LocalCluster, LocalOptions, PlacementError

    options = LocalOptions(
        **given_values(args, LOCAL_ENGINE_FLAGS), host=args.host, port=args.port, prefill=args.prefill,
        decode=args.decode, mixed=args.mixed, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        mixed_tp=args.mixed_tp, local_prefill_max_tokens=args.local_prefill_max_tokens,
        planner=args.planner, slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms,
        master_workers=args.master_workers,
        device=args.device, gpus=args.gpus, policy=args.policy, ready_timeout_s=args.ready_timeout,
        stop_timeout_s=args.stop_timeout, log_dir=Path(args.log_dir) if args.log_dir else None,
        echo_logs=args.echo_logs, log_level=args.log_level, log_format=args.log_format,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
    )
    try:
        cluster = LocalCluster(options)
    except PlacementError as e:
        logger.error("%s", e)
        return 2
    return cluster.run()


def _add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that start cluster processes: master, prefill, decode, local, node-drain."""
    m = sub.add_parser("master", help="run the master (OpenAI API, node registry, routing)")
    m.add_argument("--host", default=None, help="bind address (default: $PD_HOST, else 0.0.0.0)")
    m.add_argument("--port", type=int, default=None, help="HTTP port (default: $PD_PORT, else 8000)")
    m.add_argument("--tls-cert", default=None,
                   help="certificate (PEM, with its chain): serve HTTPS and wss:// (default: $PD_TLS_CERT, else "
                        "plain HTTP)")
    m.add_argument("--tls-key", default=None, help="the key of --tls-cert (default: $PD_TLS_KEY)")
    m.add_argument("--model", default=None, help='"default" or an HF model directory (tokenizer, chat template)')
    m.add_argument("--served-model-name", default=None,
                   help="the name clients put in `model` (default: the model's own name)")
    m.add_argument("--policy", default=None, choices=["cache_aware", "least_load", "round_robin"],
                   help="how a (prefill, decode) pair is chosen per request (default: cache_aware)")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="cap on prompt + output tokens (default: what the nodes and the model allow)")
    m.add_argument("--request-timeout", type=float, default=None,
                   help="seconds one request may take end to end (default: 600)")
    m.add_argument("--log-format", default=None, choices=["text", "json"],
                   help="json: every log line one JSON object, a request's fields at its top level (default: text)")
    m.add_argument("--api-key", action="append", default=None,
                   help="a key clients must send as `Authorization: Bearer KEY` (repeatable; default: open API)")
    m.add_argument("--api-keys-file", default=None, help="more keys, one a line: KEY [MAX_CONCURRENT]")
    m.add_argument("--max-concurrent-per-key", type=int, default=None,
                   help="generations one API key may run at once, each prompt x n (or best_of) of a request counting one "
                        "(a key's own limit in the file wins)")
    m.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="the most prompt tokens a decode node may prefill itself (those its prefix cache lacks); "
                        "within it cache_aware weighs the prefill node's queue and the transfer against the decode "
                        "node's queue and its streams' slowdown (least_load, round_robin: up to 512); 0: always "
                        "through a prefill node while one is ready (default: 4096)")
    add_planning_arguments(m)
    m.add_argument("--workers", type=int, default=None,
                   help="master processes behind the one port, each relaying its share of the streams (about 25k "
                        "tokens/s each at full load; more workers, fewer streams each, shorter token delays: see "
                        "docs/operations.md); nodes link to every worker (default: 1)")
    m.add_argument("--worker-ports", type=int, default=None,
                   help="first private port of the workers: worker i takes this + i for node links and sibling "
                        "calls (default: --port + 1)")
    m.add_argument("--advertise-host", default=None,
                   help="host the workers' private URLs carry when a node registers (default: the host it dialled)")
    m.set_defaults(func=cmd_master)

    p = sub.add_parser("prefill", help="run a prefill node that joins --master")
    _node_args(p, "prefill")
    p.set_defaults(func=cmd_node)

    d = sub.add_parser("decode", help="run a decode node that joins --master")
    _node_args(d, "decode")
    d.set_defaults(func=cmd_node)

    mx = sub.add_parser("mixed", help="run a mixed node (prefill and decode in one engine, the colocated baseline) "
                                      "that joins --master; the master sends it whole requests")
    _node_args(mx, "mixed")
    mx.set_defaults(func=cmd_node)

    loc = sub.add_parser(
        "local", help="master + prefill + decode (and mixed) nodes on this machine, supervised (crashes are restarted)")
    loc.add_argument("--host", default="127.0.0.1", help="the master's bind address")
    loc.add_argument("--port", type=int, default=8000, help="the master's HTTP port (the OpenAI API)")
    loc.add_argument("--tls-cert", default=None,
                     help="certificate (PEM) of the master (HTTPS, wss://) and of each decode node's data plane; "
                          "it must name 127.0.0.1 (or --host): see docs/operations.md")
    loc.add_argument("--tls-key", default=None, help="the key of --tls-cert")
    loc.add_argument("--tls-ca", default=None,
                     help="CA file the nodes (and this launcher) check --tls-cert against (for a self-signed "
                          "certificate: the certificate itself; default: the system's CAs)")
    loc.add_argument("--prefill", type=int, default=None,
                     help="prefill nodes to keep running (default: 1; with no count given and one GPU, 0: "
                          "one mixed node serves a single GPU best, see docs/benchmarks)")
    loc.add_argument("--decode", type=int, default=None, help="decode nodes to keep running (default: as --prefill)")
    loc.add_argument("--mixed", type=int, default=None,
                     help="mixed nodes (prefill and decode in one engine) to keep running (default: 0; with no count "
                          "given and one GPU, 1); --prefill 0 --decode 0 --mixed 1 is the colocated baseline")
    for role in ("prefill", "decode", "mixed"):
        loc.add_argument(f"--{role}-tp", type=int, default=1, metavar="N",
                         help=f"tensor parallelism of each {role} node: N whole GPUs a node, none shared (on CPU: "
                              "N processes a node); default 1")
    loc.add_argument("--local-prefill-max-tokens", type=int, default=None,
                     help="the master's cap: a decode node may prefill a request itself when it misses at most "
                          "this many prompt tokens, the route cost decides (default: 4096; 0: always through a "
                          "prefill node)")
    add_planning_arguments(loc)
    loc.add_argument("--master-workers", type=int, default=1,
                     help="the master's worker processes behind its one port (pd-cluster master --workers)")
    loc.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (N: the one GPU every node shares)")
    loc.add_argument("--gpus", type=_gpu_list, default=None,
                     help="GPUs to spread the nodes over, e.g. 0,1 (default: every visible GPU); nodes sharing a "
                          "GPU split its free memory")
    add_engine_arguments(loc.add_argument_group(
        "engine flags", "given to every node (the model to the master too); left out, a node keeps its default"),
        LOCAL_ENGINE_FLAGS)
    loc.add_argument("--policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"],
                     help="how the master chooses a (prefill, decode) pair per request")
    loc.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the cluster to serve")
    loc.add_argument("--stop-timeout", type=float, default=30.0,
                     help="seconds Ctrl-C/SIGTERM waits for the nodes to drain and the master to stop")
    loc.add_argument("--log-dir", default=None, help="per-process log files (default: $PD_CLUSTER_HOME/local/logs)")
    loc.add_argument("--echo-logs", action="store_true", help="also print every process's output here")
    loc.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="the master's log: json makes every line one JSON object (a request's fields at its "
                          "top level)")
    loc.set_defaults(func=cmd_local)

    drain = sub.add_parser("node-drain", help="ask the node on this host to drain and wait for it (preStop)")
    drain.add_argument("--status-port", type=int, default=9000, help="the node's --status-port")
    drain.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the node to finish")
    drain.set_defaults(func=cmd_node_drain)

    from pd_cluster.ray_launcher.cli import add_ray_commands

    add_ray_commands(sub)


def _add_quantize_command(sub: argparse._SubParsersAction) -> None:
    from pd_cluster.quantize.options import CALIBRATION_TEXT, METHODS, QuantizeOptions

    d = QuantizeOptions(model="default", out=Path("."))
    q = sub.add_parser("quantize", help="write a float checkpoint as an FP8 one (GPTQ over calibration text)",
                       description="Write a float checkpoint as an FP8 checkpoint (compressed-tensors, a scale an "
                                   "output channel) that nodes load as published: rounded by GPTQ over calibration "
                                   "text, or to nearest (as --quantization fp8 does at every start).")
    q.add_argument("--model", default="default", help='"default" (SmolLM2-135M-Instruct) or an HF model directory')
    q.add_argument("--out", required=True, help="the new checkpoint's directory (empty or new)")
    q.add_argument("--method", choices=METHODS, default=d.method, help="gptq, or rtn (round to nearest)")
    q.add_argument("--calibration", default=None,
                   help=f"a text file to calibrate on (default: the shipped {CALIBRATION_TEXT.name})")
    q.add_argument("--window", type=int, default=d.window, help="calibration tokens a prefill")
    q.add_argument("--sampled-tokens", type=int, default=d.sampled_tokens,
                   help="tokens the model samples itself to calibrate on besides the text (0: none)")
    q.add_argument("--damp", type=float, default=d.damp, help="GPTQ's damping, a fraction of the mean input moment")
    q.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=d.act_order,
                   help="round the columns of the largest inputs first")
    q.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    q.set_defaults(func=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-cluster", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline with one engine")
    gen.add_argument("prompt", help="the text to continue (or, with --chat, the user's message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling stream (same seed, same text)")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    _add_quantize_command(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    offline = bench_sub.add_parser("offline", help="engine vs transformers generate(), batch 1 and 16")
    offline.add_argument("--model", default="default",
                         help='"default" (SmolLM2-135M-Instruct) or an HF model directory')
    offline.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    offline.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    offline.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="batch sizes to measure")
    offline.add_argument("--out-dir", default="docs/benchmarks", help="where the results JSON is written")
    offline.set_defaults(func=cmd_bench)
    from pd_cluster.bench.serve.options import add_arguments as add_bench_serve_arguments

    serve = bench_sub.add_parser(
        "serve", help="serving benchmark against an OpenAI-compatible endpoint (TTFT/TPOT/ITL, goodput)",
        description="Serving benchmark against any OpenAI-compatible endpoint: workloads, arrival rates, "
                    "TTFT/TPOT/ITL/E2E percentiles, goodput at an SLO; table, JSON and PNG plots.",
    )
    add_bench_serve_arguments(serve)
    serve.set_defaults(func=cmd_bench_serve)
    from pd_cluster.bench import master_load, master_scale

    master_bench = bench_sub.add_parser(
        "master", help="the master alone under multi-turn load or N concurrent streams, against synthetic decode nodes",
        description=master_load.__doc__.split("\n\n")[0].replace("\n", " "),
    )
    master_scale.add_arguments(master_bench)
    master_bench.set_defaults(func=master_scale.run_from_args)

    _add_cluster_commands(sub)
    from pd_cluster.admin_cli import add_admin_commands

    add_admin_commands(sub)
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
