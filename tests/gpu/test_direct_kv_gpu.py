"""P and D processes sharing one GPU: the KV goes in place through CUDA IPC (real handles,
real processes), output equals the offline engine's, and a P killed in the middle of its
write leaves D serving with every slot back.

    python -m pytest -q -m gpu tests/gpu/test_direct_kv_gpu.py

``PD_GPU_MODEL_8B`` names a Llama-3-8B-shaped directory (a long prefill gives the kill a window);
without it the test writes one (~30 s).
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import pytest
import torch

from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams
from tests.pd_harness import decode_main, prefill_main, start_node

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKEN = "gpu-direct-token"
LONG = 8000
NEW_TOKENS = 12


def config(model: Path) -> dict:
    return {"model": str(model), "device": "cuda", "dtype": "bfloat16", "max_total_tokens": 24576,
            "max_model_len": 8192, "max_num_batched_tokens": 8192, "block_size": 16}


def job(prompt: list[int], address: str) -> str:
    return PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt,
                      sampling=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      decode_node_id="d0", decode_address=address, deadline_s=120.0).model_dump_json()


def test_a_p_killed_mid_write_leaves_d_serving_with_its_slots_back(model_8b):
    rng = random.Random(3)
    prompt = [rng.randrange(200, 40000) for _ in range(LONG)]
    d = start_node(decode_main, config(model_8b), TOKEN, ready_timeout=600)
    p = start_node(prefill_main, config(model_8b), TOKEN, 30.0, ready_timeout=600)
    try:
        idle = d.call("stats")
        # A first request through the in-place path: the reference output, and the slots' idle count.
        d.call("arm_writes")
        spec = job(prompt[:1000], d.info[1])
        result = p.call("job", spec)
        assert result["transport"] == "ipc" and result["committed"]
        reference = [result["first"]["token_id"]] + d.wait_finished(PrefillJob.model_validate_json(spec).request_id)
        bytes_per_token = d.info[2] // 16
        # The missing tokens, no padding: measured in D's pool (slots written when the commit
        # arrived), and as P reports it.
        assert d.call("writes") == [1000 * bytes_per_token]
        assert result["transfer_bytes"] == 1000 * bytes_per_token
        assert d.call("stats")["bytes_received"] - idle["bytes_received"] == result["transfer_bytes"]
        d.call("flush")
        baseline = d.call("stats")
        assert baseline["free"] == idle["free"]

        # Kill P while its long prefill writes layer after layer into D's reserved slots.
        p.conn.send(("job", job(prompt, d.info[1])))
        deadline = time.monotonic() + 60
        while d.call("stats")["reservations"] == 0:
            assert time.monotonic() < deadline, "P never reserved"
        time.sleep(0.05)  # inside the prefill (~0.5 s at 8k tokens on the 8B shape)
        p.kill()
        deadline = time.monotonic() + 30
        while True:
            stats = d.call("stats")
            if stats["reservations"] == 0 and stats["free"] == baseline["free"]:
                break
            assert time.monotonic() < deadline, f"D kept the dead P's slots: {stats} vs {baseline}"
            time.sleep(0.2)

        # D still serves, and a new P's write lands whole: the same output as before.
        p2 = start_node(prefill_main, config(model_8b), TOKEN, 30.0, ready_timeout=600)
        try:
            spec = job(prompt[:1000], d.info[1])
            result = p2.call("job", spec)
            assert result["transport"] == "ipc"
            again = [result["first"]["token_id"]] + d.wait_finished(PrefillJob.model_validate_json(spec).request_id)
            assert again == reference
        finally:
            p2.stop()
    finally:
        p.stop()
        d.stop()


def test_a_bfloat16_p_writes_an_fp8_d_in_place_converting_its_rows(small_model):
    """P keeps bfloat16 KV, D stores fp8 e4m3: P writes D's own rows (codes and scales) into D's
    pool over CUDA IPC, converting on the way; the bytes are D's, and D's greedy tokens agree with
    an engine that stores fp8 itself."""
    from pd_cluster import LLM

    rng = random.Random(5)
    prompts = [[rng.randrange(200, 20000) for _ in range(n)] for n in (300, 700)]
    p_config = {**config(small_model), "max_total_tokens": 8192, "max_model_len": 4096, "max_num_batched_tokens": 4096}
    d_config = {**p_config, "kv_cache_dtype": "fp8_e4m3"}
    llm = LLM(model=str(small_model), **{k: v for k, v in d_config.items() if k != "model"})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        want = [list(o.token_ids) for o in outs]
    finally:
        llm.close()
    d = start_node(decode_main, d_config, TOKEN, ready_timeout=600)
    p = start_node(prefill_main, p_config, TOKEN, 30.0, ready_timeout=600)
    try:
        bytes_per_token = d.info[2] // 16
        same = total = 0
        for prompt, expected in zip(prompts, want):
            d.call("arm_writes")
            spec = job(prompt, d.info[1])
            result = p.call("job", spec)
            assert result["transport"] == "ipc" and result["committed"]
            tokens = [result["first"]["token_id"]] + d.wait_finished(PrefillJob.model_validate_json(spec).request_id)
            # D's rows, measured in its pool: one byte a value plus a scale, not bfloat16's two.
            assert d.call("writes") == [len(prompt) * bytes_per_token] == [result["transfer_bytes"]]
            same += sum(a == b for a, b in zip(tokens, expected))
            total += len(expected)
        print(f"bfloat16 P -> fp8 D over CUDA IPC: {same}/{total} greedy tokens as the fp8 engine's")
        assert same / total >= 0.75
        assert d.call("stats")["reservations"] == 0
    finally:
        p.stop()
        d.stop()
