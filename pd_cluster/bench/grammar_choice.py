"""``python -m pd_cluster.bench.grammar_choice``: xgrammar against llguidance on this CPU, at the
default model's vocabulary: each engine's compile time and per-token mask time for a few JSON
schemas. The numbers chose the grammar engine (docs/architecture.md, "Structured outputs").

Needs both packages (``pip install xgrammar llguidance``); pd-cluster itself depends on one.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["id", "email"]},
        "active": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["user", "active"]},
    "enum_array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
        "size": {"enum": ["S", "M", "L", "XL"]}, "note": {"type": "string", "maxLength": 40}},
        "required": ["colors", "size"]},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}},
        "required": ["name", "parameters"]},
}
#: A JSON text of each schema's shape, to walk the matcher through (tokenized, then fed token by token).
SAMPLES: dict[str, Any] = {
    "flat": {"name": "Ada Lovelace, mathematician and writer", "age": 36},
    "nested": {"user": {"id": 12345, "email": "ada@example.com", "tags": ["math", "engines", "poetry"]},
               "active": True, "score": 0.75},
    "enum_array": {"colors": ["red", "blue", "green"], "size": "XL", "note": "a short note about sizes"},
    "tool_call": {"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}},
}


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_xgrammar(hf_tokenizer: Any, vocab: int, repeat: int) -> dict[str, Any]:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    out: dict[str, Any] = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?",
                           "tokenizer_ms": (time.perf_counter() - start) * 1e3}
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)

        def compile_once() -> Any:
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))

        compile_ms = _median_ms(compile_once, repeat)
        compiled = compile_once()
        tokens = hf_tokenizer.encode(json.dumps(SAMPLES[name], separators=(",", ":")), add_special_tokens=False)
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def walk() -> list[float]:
            matcher = xgr.GrammarMatcher(compiled)
            per = []
            for t in tokens:
                s = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                per.append((time.perf_counter() - s) * 1e3)
                assert matcher.accept_token(t), f"xgrammar refused token {t} of {name}"
            return per

        masks = [m for _ in range(repeat) for m in walk()]
        out[name] = {"compile_ms": compile_ms, "mask_ms_p50": statistics.median(masks),
                     "mask_ms_p99": sorted(masks)[int(0.99 * (len(masks) - 1))], "tokens": len(tokens)}
    return out


def measure_llguidance(hf_tokenizer: Any, vocab: int, repeat: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
    out: dict[str, Any] = {"version": llguidance.get_version() if hasattr(llguidance, "get_version") else "?",
                           "tokenizer_ms": (time.perf_counter() - start) * 1e3}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})

        def compile_once() -> Any:
            matcher = llguidance.LLMatcher(tok, grammar)
            # llguidance compiles lazily: the first mask pays for the lexer.
            mask = llguidance.torch.allocate_token_bitmask(1, vocab)
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            assert not matcher.is_error(), matcher.get_error()
            return matcher

        compile_ms = _median_ms(compile_once, repeat)
        tokens = hf_tokenizer.encode(json.dumps(SAMPLES[name], separators=(",", ":")), add_special_tokens=False)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def walk() -> list[float]:
            matcher = llguidance.LLMatcher(tok, grammar)
            per = []
            for t in tokens:
                s = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                per.append((time.perf_counter() - s) * 1e3)
                assert matcher.consume_token(t), f"llguidance refused token {t} of {name}: {matcher.get_error()}"
            return per

        masks = [m for _ in range(repeat) for m in walk()]
        out[name] = {"compile_ms": compile_ms, "mask_ms_p50": statistics.median(masks),
                     "mask_ms_p99": sorted(masks)[int(0.99 * (len(masks) - 1))], "tokens": len(tokens)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model directory (default: the default model)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each measurement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pd_cluster.default_model import resolve_model_path
    from pd_cluster.model.config import ModelConfig
    from pd_cluster.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    vocab = ModelConfig.from_path(path).vocab_size
    tokenizer = load_tokenizer(path)
    torch.set_num_threads(1)
    results = {"vocab": vocab, "xgrammar": measure_xgrammar(tokenizer, vocab, args.repeat),
               "llguidance": measure_llguidance(tokenizer, vocab, args.repeat)}
    logger.info("%s", json.dumps(results, indent=2))
    logger.info("| schema | xgrammar compile ms | xgrammar mask ms p50/p99 | llguidance compile ms | "
                "llguidance mask ms p50/p99 |")
    logger.info("|---|---|---|---|---|")
    for name in SCHEMAS:
        x, g = results["xgrammar"][name], results["llguidance"][name]
        logger.info("| %s | %.1f | %.3f / %.3f | %.1f | %.3f / %.3f |", name, x["compile_ms"], x["mask_ms_p50"],
                    x["mask_ms_p99"], g["compile_ms"], g["mask_ms_p50"], g["mask_ms_p99"])


if __name__ == "__main__":
    main()
