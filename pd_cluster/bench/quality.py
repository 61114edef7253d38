"""``python -m pd_cluster.bench.quality``: what quantization costs in quality, as perplexity.

Each mode is the same engine with other settings (the KV cache's dtype, the weights'
quantization); each scores the same public-domain text (shipped under ``bench/data``) in windows
of ``--window`` tokens, every window's prompt logprobs computed as the engine prefills it. The
prefill runs in chunks of ``--chunk`` tokens, so most of each window's attention reads keys and
values back from the cache, as decode does (a single chunk would attend to fresh, unquantized
keys and hide what the cache's dtype costs). The figure: each mode's perplexity over the
unquantized one's (the first mode).

A mode with a ``checkpoint`` entry first writes the model as an FP8 checkpoint
(:mod:`pd_cluster.quantize`, GPTQ calibrated on its own shipped text, not on the scored ones) and
scores that, loaded as published.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATA = Path(__file__).parent / "data"
TEXTS = ["declaration-of-independence.txt", "gettysburg-address.txt"]
#: name -> EngineConfig fields over the base settings; the first is the baseline.
MODES: dict[str, dict[str, Any]] = {
    "float32": {},
    "int8-kv": {"kv_cache_dtype": "int8"},
    "fp8-kv": {"kv_cache_dtype": "fp8_e4m3"},
    "int8-weights": {"quantization": "int8"},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-mixed-weights": {"quantization": "fp8_mixed"},
    "fp8-gptq-weights": {"quantization": "fp8", "checkpoint": {"method": "gptq"}},
}
#: A mode within this much of the baseline's perplexity passes.
BOUND = 1.02


@dataclass
class QualityOptions:
    model: str = "default"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    window: int = 512
    chunk: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    #: Score only the first this many windows (None: all).
    max_windows: int | None = None


def text_windows(tokenizer: Any, window: int) -> list[list[int]]:
    """The shipped texts' tokens in windows of ``window`` (the last one shorter)."""
    ids: list[int] = []
    for name in TEXTS:
        ids += tokenizer.encode((DATA / name).read_text(), add_special_tokens=False)
    from pd_cluster.quantize.checkpoint import token_windows

    return token_windows(ids, window)


def perplexity(options: QualityOptions, overrides: dict[str, Any]) -> dict[str, Any]:
    """One mode's perplexity over every window (each window's first token is not scored)."""
    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams

    started = time.perf_counter()
    settings = dict(overrides)
    checkpoint = settings.pop("checkpoint", None)
    with tempfile.TemporaryDirectory(prefix="pd-quality-") as scratch:
        model = options.model
        if checkpoint is not None:
            from pd_cluster.quantize.checkpoint import quantize_checkpoint
            from pd_cluster.quantize.options import QuantizeOptions

            model = str(quantize_checkpoint(QuantizeOptions(model=options.model, out=Path(scratch) / "model",
                                                            device=options.device, **checkpoint)))
        llm = LLM(model, device=options.device, dtype=options.dtype, enable_prefix_cache=False,
                  max_num_batched_tokens=options.chunk, prefill_chunk_tokens=options.chunk, **settings)
        try:
            windows = text_windows(llm.tokenizer, options.window)[:options.max_windows]
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            outputs = llm.generate(windows, params)
        finally:
            llm.close()
    logprobs = [lp for out in outputs for lp in out.prompt_logprobs.logprobs]
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "tokens": len(logprobs),
            "windows": len(windows), "settings": overrides, "seconds": time.perf_counter() - started}


def run_quality(options: QualityOptions) -> dict[str, Any]:
    results = {name: perplexity(options, MODES[name]) for name in options.modes}
    base = results[options.modes[0]]["perplexity"]
    for name, result in results.items():
        result["vs_baseline"] = result["perplexity"] / base
        result["within_bound"] = result["vs_baseline"] <= BOUND
        logger.info("%s: perplexity %.4f (%.4fx)", name, result["perplexity"], result["vs_baseline"])
    return {"date": dt.date.today().isoformat(), "device": options.device, "model": options.model,
            "dtype": options.dtype, "window": options.window, "chunk": options.chunk, "texts": TEXTS,
            "command": "python -m pd_cluster.bench.quality --out docs/benchmarks",
            "baseline": options.modes[0], "bound": BOUND, "modes": results,
            "quality_within_2pct": all(r["within_bound"] for r in results.values())}


def markdown(doc: dict[str, Any]) -> str:
    lines = ["| mode | perplexity | vs " + doc["baseline"] + " | tokens |", "| --- | --- | --- | --- |"]
    for name, r in doc["modes"].items():
        lines.append(f"| {name} | {r['perplexity']:.4f} | {r['vs_baseline']:.4f} | {r['tokens']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = QualityOptions()
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--modes", default=",".join(d.modes), help=f"of {', '.join(MODES)}; the first is the baseline")
    parser.add_argument("--window", type=int, default=d.window)
    parser.add_argument("--chunk", type=int, default=d.chunk)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--out", type=Path, default=None, help="folder for quality-<device>-<date>.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    options = QualityOptions(args.model, modes, args.window, args.chunk, args.dtype, args.device)
    doc = run_quality(options)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"quality-{args.device}-{doc['date']}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        logger.info("wrote %s", path)
    sys.stdout.write(markdown(doc) + "\n")
    return 0 if doc["quality_within_2pct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
