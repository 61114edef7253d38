"""The default model with 8-bit weights on CPU: its greedy choices agree with the unquantized
model's on nearly every token (each scored in the unquantized run's context)."""

from __future__ import annotations

import pytest

from pd_cluster import LLM, SamplingParams
from tests.engine.test_tensor_parallel import PROMPTS, _generate, kv4_model  # noqa: F401 (a fixture)

NUM_PROMPTS = 16
NEW_TOKENS = 32
#: Agreement the default model keeps (measured on these prompts: see the printed rates).
MIN_AGREEMENT = {"int8": 0.95, "fp8": 0.9, "fp8_mixed": 0.9}


def _prompts(tokenizer) -> list[list[int]]:
    topics = ["the sea", "a city at night", "how plants grow", "the history of bread", "prime numbers",
              "a cat and a dog", "rain in spring", "the moon landing"]
    texts = [f"Write a short paragraph about {t}." for t in topics] + [f"Q: What is {i} times {i + 3}? A:"
                                                                      for i in range(2, 10)]
    return [tokenizer.encode(t) for t in texts[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def unquantized_run(tokenizer) -> list[tuple[list[int], list[int]]]:
    llm = LLM(device="cpu", max_total_tokens=4096)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = _prompts(tokenizer)
        return [(p, list(o.token_ids)) for p, o in zip(prompts, llm.generate(prompts, params))]
    finally:
        llm.close()


@pytest.mark.parametrize("quantization", ["int8", "fp8", "fp8_mixed"])
def test_quantized_weights_choose_the_unquantized_tokens(unquantized_run, quantization):
    # Each unquantized answer scored whole by the quantized model: a token agrees where it is the
    # quantized model's greedy choice (rank 1) in the same context.
    llm = LLM(device="cpu", max_total_tokens=4096, quantization=quantization)
    try:
        sequences = [prompt + answer for prompt, answer in unquantized_run]
        outs = llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    finally:
        llm.close()
    agree = total = 0
    for (prompt, answer), out in zip(unquantized_run, outs):
        ranks = out.prompt_logprobs.ranks[len(prompt) - 1:]  # entry i scores token i + 1
        assert len(ranks) == len(answer)
        agree += sum(r == 1 for r in ranks)
        total += len(answer)
    rate = agree / total
    print(f"--quantization {quantization}: {agree}/{total} greedy tokens agree ({rate:.1%})")
    assert rate >= MIN_AGREEMENT[quantization]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_tp2_equals_tp1_token_for_token(kv4_model, quantization):  # noqa: F811
    options = {"max_num_batched_tokens": 8, "quantization": quantization}
    assert _generate(str(kv4_model), 2, PROMPTS, **options) == _generate(str(kv4_model), 1, PROMPTS, **options)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_tp2_equals_tp1_token_for_token(kv4_model, kv_cache_dtype):  # noqa: F811
    # Each rank's pool stores its own heads' quantized rows (a row's scale is its own token and
    # head's, whatever the split); chunked prefill and a prefix hit read rows stored earlier.
    options = {"max_num_batched_tokens": 8, "kv_cache_dtype": kv_cache_dtype}
    tokens = _generate(str(kv4_model), 2, PROMPTS, **options)
    assert tokens == _generate(str(kv4_model), 1, PROMPTS, **options)
    assert tokens != _generate(str(kv4_model), 1, PROMPTS, max_num_batched_tokens=8)  # the rows are quantized

