"""Each family's tiny transformers-written checkpoint served by ``pd-cluster local --device cpu
--model DIR`` (master, P, D as processes), every request prefilled on P and decoded on D, with the
official client: greedy answers are transformers', a repeated prompt hits P's prefix cache, and
the model's generation_config.json defaults apply where a request leaves them unset."""

from __future__ import annotations

import json

import openai
import pytest

from tests.cli.test_local_supervisor import LocalRun
from tests.cluster_harness import wait_until
from tests.family_models import FAMILIES, greedy, write_family_model

NEW_TOKENS = 8
SHARED = list(range(400, 480))
PROMPTS = [[1, 2, 3], SHARED + [5, 6], list(range(2000, 2100))]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory, default_model_dir):
    """One launch per family: P and D, every prompt through P (--local-prefill-max-tokens 0)."""
    family = request.param
    model_dir = tmp_path_factory.mktemp("families") / family
    hf = write_family_model(family, model_dir, default_model_dir)
    # top_k 1 by default: a request that leaves top_k unset is answered greedily.
    (model_dir / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1}))
    run = LocalRun(model_dir, tmp_path_factory.mktemp(f"{family}-run"), "--prefill", "1", "--decode", "1",
                   "--local-prefill-max-tokens", "0")
    try:
        run.wait_ready(nodes=2)
        client = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield family, hf, client, run
    finally:
        run.kill_everything()


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.timeout(600)
def test_served_through_p_and_d_as_transformers_answers(served, tokenizer):
    family, hf, client, run = served
    model = family
    for prompt in PROMPTS:
        want = _text(tokenizer, greedy(hf, prompt, NEW_TOKENS))
        reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == want, (family, prompt[:4])
    # The shared prefix again: P's prefix cache holds its blocks, the answer is the same.
    prompt = SHARED + [11, 12, 13]
    reply = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                      extra_body={"ignore_eos": True})
    # On a miss, where it ran and what each node's cache held say which side forgot the prefix.
    assert reply.usage.prompt_tokens_details.cached_tokens >= 64, (reply.usage, run.nodes(), run.log()[-6000:])
    assert reply.choices[0].text == _text(tokenizer, greedy(hf, prompt, NEW_TOKENS))
    # P's hit reaches the master with its next status report (every STATUS_INTERVAL_S).
    wait_until(lambda: run.nodes().get("prefill-0", {}).get("prefix", {}).get("hit_tokens", 0) >= 64, 10,
               "P's status report with its prefix hit")
    # No top_k in the request: generation_config.json's (1) makes it greedy at temperature 1.
    reply = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NEW_TOKENS, seed=5,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == _text(tokenizer, greedy(hf, PROMPTS[2], NEW_TOKENS))
