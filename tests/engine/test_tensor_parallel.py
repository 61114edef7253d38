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
        assert llm.engine.pipelined == bool(options.get("overlap_schedule"))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [list(out.token_ids) for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def test_tp2_equals_tp1_token_for_token(kv4_model):
    # Chunked prefill (8-token steps) mixes prefill chunks into decode batches; the last prompt
    # shares the first one's prefix (a prefix-cache hit reads KV the ranks stored earlier).
    options = {"max_num_batched_tokens": 8}
    assert _generate(str(kv4_model), 2, PROMPTS, **options) == _generate(str(kv4_model), 1, PROMPTS, **options)


def test_tp2_with_the_overlap_schedule_equals_tp1(kv4_model):
    # Each step's plan goes out before the last step's ids are read back (they follow the plan).
    options = {"max_num_batched_tokens": 8}
    assert (_generate(str(kv4_model), 2, PROMPTS, overlap_schedule=True, **options)
            == _generate(str(kv4_model), 1, PROMPTS, **options))


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


def test_qwen3_at_tp2_matches_transformers(tmp_path, default_model_dir):
    # Per-head q/k norms act within a head: every rank holds them whole beside its heads.
    from tests.family_models import greedy, write_family_model

    hf = write_family_model("qwen3", tmp_path, default_model_dir)
    assert _generate(str(tmp_path), 2, PROMPTS[:3]) == [greedy(hf, p, 12) for p in PROMPTS[:3]]


def _held_kv(model: str, tp: int) -> tuple[torch.Tensor, int, int]:
    """Every head's KV (as a handover reads it) of a request held after its prefill, and the
    heads and slots of rank 0's pool."""
    llm = LLM(model=model, device="cpu", dtype="float32", tp=tp, max_total_tokens=256)
    try:
        engine = llm.engine
        req = engine.add_request("held", PROMPTS[2], SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
        while engine.has_unfinished():
            engine.step()
        slots = engine.held_slots(req)
        kv = engine.node_kv.gather(slots)
        pool = engine.pool
        return kv, pool.k_cache.shape[2], pool.k_cache.shape[1]
    finally:
        llm.close()


def test_each_rank_holds_only_its_heads_and_a_handover_reads_every_head_as_tp1(kv4_model):
    kv1, heads1, slots1 = _held_kv(str(kv4_model), 1)
    kv2, heads2, slots2 = _held_kv(str(kv4_model), 2)
    # Rank 0's pool: its two of the four KV heads, as many slots (a TP 2 node holds twice the
    # tokens of TP 1 in each GPU's KV budget).
    config = ModelConfig.from_path(kv4_model)
    assert (heads1, heads2) == (4, 2) and slots2 == slots1
    assert kv1.shape == kv2.shape == (2, config.num_layers, len(PROMPTS[2]), 4, config.head_dim)
    assert kv1.abs().sum() > 0
    torch.testing.assert_close(kv2, kv1, rtol=1e-4, atol=1e-5)


def test_kv_written_from_outside_reaches_every_rank(kv4_model):
    # A decode node's handover: every head written at reserved slots (each rank keeps its own),
    # then read back through the ranks.
    llm = LLM(model=str(kv4_model), device="cpu", dtype="float32", tp=2, max_total_tokens=256)
    try:
        engine = llm.engine
        spec = engine.kv_spec
        slots = engine.pool.alloc(5)
        kv = torch.randn(2, spec.num_layers, 5, spec.num_kv_heads, spec.head_dim)
        engine.node_kv.scatter(kv, slots)
        torch.testing.assert_close(engine.node_kv.gather(slots), kv)
        engine.pool.free(slots)
    finally:
        llm.close()
