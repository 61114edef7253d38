"""Prompt logprobs from the engine equal transformers' log-softmax (float32): computed chunk by
chunk as the prompt is prefilled, never read from the prefix cache, after a preemption too."""

from __future__ import annotations

import pytest

from pd_cluster.engine import prompt_logprobs
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.reference import CHAT_MESSAGES, GreedyReference, prompt_logprobs as reference_logprobs

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    # Chunks of 48 tokens: a prompt's entries come from several steps.
    return LLM(str(default_model_dir), max_total_tokens=4096, max_num_batched_tokens=256, prefill_chunk_tokens=48,
               block_size=4)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return GreedyReference(default_model_dir).model


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    assert worst < TOLERANCE, worst


def test_prompt_logprobs_equal_transformers_cold_and_over_a_cached_prefix(llm, hf_model, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_BLOCK", 16)  # several LM-head blocks a chunk
    prompt = llm.tokenizer.encode(CHAT_MESSAGES[6], add_special_tokens=False)[:150]
    want, want_ids, want_top = reference_logprobs(hf_model, prompt, top=3)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    cold = llm.generate([prompt], params)[0]
    assert cold.prompt_logprobs is not None
    _close(cold.prompt_logprobs.logprobs, want)
    assert cold.prompt_logprobs.top_ids == want_ids
    _close([v for row in cold.prompt_logprobs.top_logprobs for v in row], [v for row in want_top for v in row])

    # The same prompt again: its blocks are in the prefix cache now, and still every entry is there.
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens > 100 and plain.prompt_logprobs is None
    warm = llm.generate([prompt + prompt[:20]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert warm.num_cached_tokens == 0 and warm.prompt_logprobs.top_ids == []
    _close(warm.prompt_logprobs.logprobs, reference_logprobs(hf_model, prompt + prompt[:20])[0])


def test_requests_that_do_not_ask_leave_nothing_to_score(llm):
    out = llm.generate(["One, two, three,"] * 3, SamplingParams(max_tokens=4, temperature=0))
    assert all(o.prompt_logprobs is None for o in out)
    assert not llm.engine.runner.scoring


def test_a_batch_mixing_askers_and_others_scores_each_askers_prompt(llm, hf_model):
    prompts = [llm.tokenizer.encode(text, add_special_tokens=False) for text in CHAT_MESSAGES[:5]]
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1 if i % 2 == 0 else None)
              for i in range(len(prompts))]
    out = llm.generate(prompts, params)
    for prompt, p, o in zip(prompts, params, out):
        if p.prompt_logprobs is None:
            assert o.prompt_logprobs is None
            continue
        want, ids, _ = reference_logprobs(hf_model, prompt, top=1)
        _close(o.prompt_logprobs.logprobs, want)
        assert o.prompt_logprobs.top_ids == ids
    assert not llm.engine.runner.scoring


def test_a_one_token_prompt_has_no_entries(llm):
    out = llm.generate([[1]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs.logprobs == []
