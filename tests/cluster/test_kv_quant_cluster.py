"""P in the model dtype, D with ``--kv-cache-dtype int8``: real processes, the official openai client.

P converts each prompt's KV into D's int8 rows (values and a float32 scale per token and KV
head) before sending, so the bytes moved are D's; greedy output stays close to the unquantized
model's; D's prefix cache still hits across turns."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import httpx
import openai
import pytest

from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
PROMPTS, NEW_TOKENS = 32, 64
SUBJECTS = ["a lighthouse keeper", "a lost robot", "the first snow", "a river town", "an old violin",
            "a night market", "a desert well", "a paper boat"]
FORMS = ["Write a short story about {}.", "Describe {} in a few sentences.", "Tell me a fact about {}.",
         "Write a poem about {}."]


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("kvquant-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0", "--kv-cache-dtype", "int8")
        wait_until(lambda: httpx.get(c.url + "/health", timeout=5).status_code == 200, 30, "health")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _moved(cluster: Cluster) -> int:
    return int(cluster.node("d0")["kv_transfer_bytes"])


def test_bytes_moved_per_token_are_int8_rows_plus_scales(cluster, client, tokenizer):
    spec = cluster.node("d0")["kv_spec"]
    assert spec["kv_dtype"] == "int8" and cluster.node("p0")["kv_spec"]["kv_dtype"] == "float32"
    before = _moved(cluster)
    reply = client.completions.create(model=MODEL, prompt="Count the colours of a rainbow, slowly, one by one.",
                                      max_tokens=4, temperature=0)
    moved = wait_until(lambda: (_moved(cluster) - before) or None, 10, "the transfer's report")
    per_token = moved / reply.usage.prompt_tokens
    int8_with_scales = 2 * spec["num_layers"] * spec["num_kv_heads"] * (spec["head_dim"] + 4)
    float32 = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * 4
    print(f"KV moved per token: {per_token:.0f} bytes (int8 + scales {int8_with_scales}, float32 {float32})")
    assert per_token == int8_with_scales


def _unquantized(model_dir, prompts: list[list[int]], answers: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The unquantized model's own greedy answers to ``prompts``, and the rank it gives each token
    of ``answers`` in the answer's own context (1: its greedy choice there). One offline engine,
    token-identical to transformers' greedy loop (tests/engine checks) and minutes faster here."""
    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    try:
        own = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        scored = llm.generate([p + a for p, a in zip(prompts, answers)],
                              SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    finally:
        llm.close()
    # prompt_logprobs entry i scores token i + 1: the answer's tokens start at the prompt's last entry.
    ranks = [list(out.prompt_logprobs.ranks[len(p) - 1:]) for p, out in zip(prompts, scored)]
    return [out.token_ids for out in own], ranks


def test_greedy_output_agrees_with_the_unquantized_model(client, tokenizer, default_model_dir):
    prompts = [list(tokenizer.encode(form.format(subject), add_special_tokens=False))
               for form in FORMS for subject in SUBJECTS][:PROMPTS]

    def complete(ids: list[int]) -> list[int]:
        reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(name.removeprefix("token_id:")) for name in reply.choices[0].logprobs.tokens]

    with cf.ThreadPoolExecutor(PROMPTS) as pool:  # D decodes them as one batch
        answers = list(pool.map(complete, prompts))
    assert all(len(a) == NEW_TOKENS for a in answers)
    own, ranks = _unquantized(default_model_dir, prompts, answers)
    # Each of D's greedy tokens against the unquantized model's choice in the same context: once an
    # answer takes the other side of a near-tie, every later position differs, so positions alone
    # would measure where answers part, not how often the quantized KV changed a choice.
    agree = sum(r == 1 for rs in ranks for r in rs)
    total = sum(len(rs) for rs in ranks)
    same_position = sum(a == b for got, want in zip(answers, own) for a, b in zip(got, want))
    print(f"int8 KV on D: {agree}/{total} greedy tokens ({agree / total:.1%}) are the unquantized model's choice in "
          f"their context; {same_position / total:.1%} equal its own answers position by position; "
          f"{sum(a == b for a, b in zip(answers, own))}/{len(prompts)} answers equal whole")
    # Rows read back with wrong scales, or a mangled handover, give answers the model would not choose.
    assert agree / total >= 0.95


def test_prefix_cache_hits_on_a_second_turn(client):
    messages = [{"role": "user", "content": "Plan a day of hiking near a lake. Where do we start?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What should we pack?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content


def _rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks process ``pid`` started (its children running tp_rank)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(child) for child in f.read().split()]
    ranks = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"pd_cluster.engine.tp_rank" in f.read():
                ranks.append(child)
    return ranks


def test_a_decode_node_of_two_ranks_stores_int8_and_stops_them_cleanly(default_model_dir, tmp_path):
    """A D of ``--tp 2 --kv-cache-dtype int8`` serves a float32 P's request (the bytes moved are
    int8 rows), and on SIGTERM drains and exits 0 with its second rank taking the stop: it exits
    0 too, nothing logged as failed."""
    c = Cluster(default_model_dir, tmp_path)
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        d = c.start_node("decode", "d2", "--data-port", "0", "--kv-cache-dtype", "int8", "--tp", "2")
        wait_until(lambda: httpx.get(c.url + "/health", timeout=5).status_code == 200, 30, "health")
        spec = c.node("d2")["kv_spec"]
        assert spec["kv_dtype"] == "int8"
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
        moved = wait_until(lambda: int(c.node("d2")["kv_transfer_bytes"]) or None, 10, "the transfer's report")
        assert moved % (2 * spec["num_layers"] * spec["num_kv_heads"] * (spec["head_dim"] + 4)) == 0
        (rank,) = _rank_processes(d.pid)
        d.send_signal(signal.SIGTERM)
        assert d.wait(60) == 0
        wait_until(lambda: not os.path.exists(f"/proc/{rank}"), 30, "rank 1 to exit")
        log = c.log("d2")
        assert "tensor parallel rank 1 of 2 ready" in log and "tensor parallel rank 1 failed" not in log
    finally:
        c.stop()

