"""``pd-cluster local --quantization int8`` on CPU: P and D hold 8-bit weights and answer through
the master, with the official client, as the engine with the same weights does alone."""

from __future__ import annotations

import openai
import pytest

from pd_cluster import LLM, SamplingParams
from tests.cli.test_local_supervisor import LocalRun

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 12


@pytest.mark.timeout(600)
def test_local_cluster_serves_int8_weights_as_the_engine_does(default_model_dir, tmp_path):
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    llm = LLM(device="cpu", max_total_tokens=2048, quantization="int8")
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        want = [o.text for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    run = LocalRun(default_model_dir, tmp_path, "--prefill", "1", "--decode", "1", "--quantization", "int8",
                   "--local-prefill-max-tokens", "0")
    try:
        run.wait_ready(nodes=2)
        node_logs = [path.read_text(errors="replace") for path in tmp_path.rglob("*-0.log")]
        assert len(node_logs) == 2 and all("weights int8" in log for log in node_logs)
        client = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, text in zip(prompts, want):
            reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == text
    finally:
        run.kill_everything()
