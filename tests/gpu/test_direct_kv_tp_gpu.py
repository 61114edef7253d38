"""P at TP 1 writes in place into a decode node at TP 2 on two GPUs: D's two ranks each offer
their own KV pool over CUDA IPC (rank 0's on cuda:0, rank 1's on cuda:1, each in its own
process), P writes each rank's KV heads into that rank's pool, and the output equals the engine
alone's, also after a prefix hit on D.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_direct_kv_tp_gpu.py -s
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from pd_cluster import LLM
from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams
from tests.pd_harness import decode_main, prefill_main, start_node

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TOKEN = "gpu-direct-tp-token"
NEW_TOKENS = 12
BLOCK = 16


def config(model: Path, tp: int) -> dict:
    # float32: a TP 2 decode gives the TP 1 engine's greedy tokens.
    return {"model": str(model), "device": "cuda:0", "dtype": "float32", "max_total_tokens": 8192,
            "max_model_len": 4096, "max_num_batched_tokens": 2048, "block_size": BLOCK, "tp": tp}


def job(prompt: list[int], address: str) -> str:
    return PrefillJob(request_id=uuid.uuid4().hex, token_ids=prompt,
                      sampling=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      decode_node_id="d0", decode_address=address, deadline_s=120.0).model_dump_json()


def engine_tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(model), device="cuda:0", dtype="float32", max_total_tokens=8192, block_size=BLOCK)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        return [list(o.token_ids) for o in outs]
    finally:
        llm.close()


def test_p_tp1_writes_each_d_rank_its_heads_over_cuda_ipc(small_model):
    g = torch.Generator().manual_seed(7)
    first = torch.randint(200, 20000, (700,), generator=g).tolist()
    follow_up = first + torch.randint(200, 20000, (90,), generator=g).tolist()
    want = engine_tokens(small_model, [first, follow_up])
    d = start_node(decode_main, config(small_model, 2), TOKEN, ready_timeout=600)
    p = start_node(prefill_main, config(small_model, 1), TOKEN, 30.0, ready_timeout=600)
    try:
        bytes_per_token = d.info[2] // BLOCK
        for prompt, expected, hit in ((first, want[0], 0), (follow_up, want[1], len(first) // BLOCK)):
            d.call("arm_writes")
            spec = job(prompt, d.info[1])
            result = p.call("job", spec)
            assert result["transport"] == "ipc" and result["committed"] and result["hit_blocks"] == hit
            tokens = [result["first"]["token_id"]] + d.wait_finished(PrefillJob.model_validate_json(spec).request_id)
            assert tokens == expected
            missing = len(prompt) - hit * BLOCK
            # Every head once (rank 0's heads measured in its pool: the missing tokens' slots only).
            assert result["transfer_bytes"] == missing * bytes_per_token
            assert d.call("writes") == [missing * bytes_per_token]
        stats = d.call("stats")
        assert stats["reservations"] == 0
    finally:
        p.stop()
        d.stop()
