"""Tensor-parallel nodes served by ``pd-cluster local`` on CPU (gloo, float32), through the master
with the official client: P and D of different TP hand over KV and answer as transformers does;
a rank killed with -9 takes its node down, the launcher restarts it, no request fails."""

from __future__ import annotations

import os
import signal
import subprocess

import openai
import pytest

from tests.cli.test_local_supervisor import LocalRun, Traffic
from tests.cluster_harness import wait_until

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 10


def _ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes a node process started."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "pd_cluster.engine.tp_rank" in line]


def _serves_like_transformers(run: LocalRun, chat_prompts, hf_reference, tokenizer) -> None:
    client = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in chat_prompts[:3]:
        want = tokenizer.decode(hf_reference.greedy(prompt, NEW_TOKENS), skip_special_tokens=True)
        reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == want


@pytest.fixture(scope="module")
def decode_tp2_run(default_model_dir, tmp_path_factory):
    """P of TP 1 and two D of TP 2, every request through P (--local-prefill-max-tokens 0): read by
    the handover test, then taken down by the rank-kill test, the file's last (one launch for both)."""
    run = LocalRun(default_model_dir, tmp_path_factory.mktemp("decode-tp2"), "--prefill", "1", "--decode", "2",
                   "--decode-tp", "2", "--local-prefill-max-tokens", "0")
    try:
        run.wait_ready(nodes=3)
        yield run
    finally:
        run.kill_everything()


@pytest.mark.timeout(600)
def test_p_of_tp1_hands_over_to_d_of_tp2_token_identical(decode_tp2_run, chat_prompts, hf_reference, tokenizer):
    run = decode_tp2_run
    assert "cpu x2" in run.log()  # the placement table names the tensor-parallel node's processes
    assert len(_ranks_of(run.children()["decode-0"])) == 1
    _serves_like_transformers(run, chat_prompts, hf_reference, tokenizer)


@pytest.mark.timeout(600)
def test_p_of_tp2_hands_over_to_d_of_tp1_token_identical(default_model_dir, tmp_path, chat_prompts, hf_reference,
                                                        tokenizer):
    run = LocalRun(default_model_dir, tmp_path, "--prefill", "1", "--decode", "1", "--prefill-tp", "2",
                   "--decode-tp", "1", "--local-prefill-max-tokens", "0")
    try:
        run.wait_ready(nodes=2)
        assert "cpu x2" in run.log()
        assert len(_ranks_of(run.children()["prefill-0"])) == 1
        _serves_like_transformers(run, chat_prompts, hf_reference, tokenizer)
    finally:
        run.kill_everything()


@pytest.mark.timeout(900)
def test_a_rank_killed_takes_its_node_down_and_it_is_restarted_without_failed_requests(decode_tp2_run):
    run = decode_tp2_run
    before = run.children()
    (rank,) = _ranks_of(before["decode-0"])
    traffic = Traffic(run.url)
    traffic.wait_for(3, 180)
    os.kill(rank, signal.SIGKILL)
    wait_until(lambda: run.children().get("decode-0") not in (None, before["decode-0"]), 60,
               "decode-0 to exit and be restarted")
    traffic.wait_for(4, 240)
    wait_until(lambda: len(_ranks_of(run.children().get("decode-0", 0))) == 1, 120,
               "the new decode-0 to start its rank")
    traffic.stop()
    assert traffic.errors == []
    assert "decode-0 (pid %d) crashed" % before["decode-0"] in run.log()
