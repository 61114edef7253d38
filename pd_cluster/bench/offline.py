"""Offline throughput: our engine vs transformers' ``generate()`` on the same prompts, same run."""

from __future__ import annotations

import datetime as dt
import json
import logging
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BENCH_QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for writing clean code.",
    "Why is the sky blue?",
    "Summarize the plot of a heist movie you invent.",
    "How do vaccines train the immune system?",
    "Compare trains and planes for a 500 km trip.",
    "What is a prime number? Give examples.",
    "Describe a sunrise over the mountains.",
    "List five healthy breakfast ideas.",
    "How does a search engine rank pages?",
    "Write a limerick about a cat.",
    "Explain recursion with an example.",
    "What makes a good team leader?",
]


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for q in BENCH_QUESTIONS[:n]
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_engine(llm, prompts, max_tokens: int) -> float:
    from pd_cluster.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.cache.flush()
    _sync(llm.engine.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(llm.engine.device)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def _bench_transformers(model, tokenizer, prompts, max_tokens: int, device: torch.device) -> float:
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=pad,
        )
    _sync(device)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def run_offline_bench(
    model: str = "default", batch_sizes: tuple[int, ...] = (1, 16), max_tokens: int = 64,
    device: str = "auto", out_dir: Path = Path("docs/benchmarks"),
) -> dict:
    from transformers import AutoModelForCausalLM

    from pd_cluster.llm import LLM

    llm = LLM(model, device=device)
    dev = llm.engine.device
    hf = AutoModelForCausalLM.from_pretrained(
        str(llm.engine.model_path), dtype=torch.bfloat16 if llm.engine.dtype_name == "bfloat16" else torch.float32
    ).to(dev)
    hf.eval()
    tokenizer = llm.tokenizer
    rows = []
    # Warm up both (allocator, kernels) on one short request.
    _bench_engine(llm, _prompts(tokenizer, 1), 4)
    _bench_transformers(hf, tokenizer, _prompts(tokenizer, 1), 4, dev)
    from tqdm.auto import tqdm

    for batch in tqdm(batch_sizes, desc="offline bench", unit="batch size", disable=None):
        prompts = _prompts(tokenizer, batch)
        ours = _bench_engine(llm, prompts, max_tokens)
        theirs = _bench_transformers(hf, tokenizer, prompts, max_tokens, dev)
        rows.append({"batch": batch, "max_tokens": max_tokens, "pd_cluster_tok_s": round(ours, 2),
                     "transformers_tok_s": round(theirs, 2), "speedup": round(ours / theirs, 3)})
        logger.info("batch %d: %.1f tok/s vs transformers %.1f tok/s (x%.2f)", batch, ours, theirs, ours / theirs)
    result = {
        "benchmark": "offline",
        "model": llm.engine.model_config.name,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "dtype": llm.engine.dtype_name,
        "host": platform.machine(),
        "threads": torch.get_num_threads(),
        "date": dt.date.today().isoformat(),
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"offline-{dev.type}-{result['date']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(format_table(result))
    return result


def format_table(result: dict) -> str:
    lines = [
        f"# Offline throughput: {result['model']} on {result['device']} ({result['dtype']}), {result['date']}",
        "",
        "Greedy, ignore_eos, same prompts; transformers `generate()` measured in the same run.",
        "",
        "| batch | new tokens | pd-cluster tok/s | transformers tok/s | ratio |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['max_tokens']} | {r['pd_cluster_tok_s']} | {r['transformers_tok_s']} | {r['speedup']}x |"
        )
    return "\n".join(lines) + "\n"
