"""Tensor parallelism inside one engine (gloo on CPU, float32): the same tokens as TP 1."""

from __future__ import annotations

import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.bench.random_model import write_random_model
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import load_weights

PROMPTS = [[5, 17, 300, 42, 9], [7] * 3, list(range(100, 140)), [5, 17, 300, 42, 9, 11, 12]]


@pytest.fixture(scope="module")
def kv4_model(tmp_path_factory, default_model_dir):
    return write_random_model("tiny-kv4", tmp_path_factory.mktemp("kv4"), default_model_dir, dtype="float32",
                              device="cpu")


def _generate(model: str, tp: int, prompts, **options) -> list[list[int]]:
    llm = LLM(model=model, device="cpu", dtype="float32", tp=tp, max_total_tokens=2048, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [list(out.token_ids) for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def test_tp2_equals_tp1_token_for_token(kv4_model):
    # Chunked prefill (8-token steps) mixes prefill chunks into decode batches; the last prompt
    # shares the first one's prefix (a prefix-cache hit reads KV the ranks stored earlier).
    options = {"max_num_batched_tokens": 8}
    assert _generate(str(kv4_model), 2, PROMPTS, **options) == _generate(str(kv4_model), 1, PROMPTS, **options)


def test_tp4_splits_kv_heads_one_each_and_equals_tp1(kv4_model):
    assert _generate(str(kv4_model), 4, PROMPTS[:2]) == _generate(str(kv4_model), 1, PROMPTS[:2])


def test_a_rank_loads_only_its_slices(kv4_model):
    config = ModelConfig.from_path(kv4_model)
    whole = load_weights(kv4_model, config, torch.float32, "cpu")
    part = load_weights(kv4_model, config, torch.float32, "cpu", Shard(1, 2))
    d = config.head_dim
    q_rows, kv_rows = config.num_heads // 2 * d, config.num_kv_heads // 2 * d
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    layer, ref = part.layers[0], whole.layers[0]
    assert layer.qkv.shape[0] == q_rows + 2 * kv_rows
    assert torch.equal(layer.qkv[:q_rows], ref.qkv[q_rows:q_size])
    assert torch.equal(layer.qkv[q_rows:q_rows + kv_rows], ref.qkv[q_size + kv_rows:q_size + kv_size])
    assert torch.equal(layer.o, ref.o[:, q_rows:])
    half = config.intermediate_size // 2
    assert torch.equal(layer.gate_up[:half], ref.gate_up[half:config.intermediate_size])
    assert torch.equal(layer.down, ref.down[:, half:])


def test_uneven_and_replicated_kv_heads():
    config = ModelConfig.from_dict({"vocab_size": 10, "hidden_size": 576, "intermediate_size": 1536,
                                    "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3},
                                   name="m")
    # Three KV heads over two ranks: one and two, each with its three query heads.
    shards = [Shard(r, 2) for r in range(2)]
    assert [(s.kv_heads(config).count, s.q_heads(config).start, s.q_heads(config).count) for s in shards] == [
        (1, 0, 3), (2, 3, 6)]
    # Over six ranks each KV head is held twice; its three query heads do not split in two.
    with pytest.raises(ValueError, match="do not split"):
        Shard(0, 6).check(config)
    with pytest.raises(ValueError, match="not a multiple"):
        Shard(0, 4).check(config)


def test_default_model_at_tp2_matches_transformers(default_model_dir, tokenizer, hf_reference):
    # SmolLM2-135M: 3 KV heads split two and one, 9 query heads six and three.
    prompts = [tokenizer.encode(text, add_special_tokens=False)
               for text in ("The capital of France is", "1, 2, 3, 4,")]
    ours = _generate(str(default_model_dir), 2, prompts)
    assert ours == [hf_reference.greedy(p, 12) for p in prompts]


def test_rank0_pool_holds_every_heads_kv_as_tp1(kv4_model):
    # What a prefill node hands over is rank 0's pool: after the steps, every head of it (the
    # other ranks' gathered layer by layer) equals a TP 1 engine's.
    pools = []
    for tp in (1, 2):
        llm = LLM(model=str(kv4_model), device="cpu", dtype="float32", tp=tp, max_total_tokens=256)
        try:
            llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            pools.append((llm.engine.pool.k_cache.clone(), llm.engine.pool.v_cache.clone()))
        finally:
            llm.close()
    (k1, v1), (k2, v2) = pools
    assert k1.abs().sum() > 0
    torch.testing.assert_close(k2, k1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v2, v1, rtol=1e-4, atol=1e-5)
