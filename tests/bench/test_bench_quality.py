"""``python -m pd_cluster.bench.quality``: perplexity of the shipped text, mode by mode."""

from __future__ import annotations

import math

import torch

from pd_cluster.bench.quality import QualityOptions, markdown, run_quality, text_windows


def test_the_unquantized_perplexity_is_transformers_own(default_model_dir, tokenizer, hf_reference):
    """Scored in 32-token chunks through the cache, two windows of the shipped text give the
    perplexity transformers computes over the same windows in one pass (float32)."""
    options = QualityOptions(model=str(default_model_dir), modes=["float32"], window=96, chunk=32, max_windows=2)
    doc = run_quality(options)
    windows = text_windows(tokenizer, 96)[:2]
    logprobs: list[float] = []
    with torch.no_grad():
        for ids in windows:
            logits = hf_reference.model(torch.tensor([ids])).logits[0].float()
            scored = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
            logprobs += scored[:, 0].tolist()
    want = math.exp(-sum(logprobs) / len(logprobs))
    result = doc["modes"]["float32"]
    assert result["tokens"] == len(logprobs) == 2 * 95
    assert abs(result["perplexity"] / want - 1) < 1e-4, (result["perplexity"], want)
    assert result["vs_baseline"] == 1.0 and doc["quality_within_2pct"]
    assert "| float32 |" in markdown(doc)
