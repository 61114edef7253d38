"""Qwen3, Qwen3-MoE, Mixtral and Llama 3.1 checkpoints as transformers writes them: the engine's
greedy output is transformers' (float32), with prefix-cache hits and chunked prefills; configs
asking for what the engine does not compute are refused naming the field."""

from __future__ import annotations

import json

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.model.config import ModelConfig
from tests.family_models import FAMILIES, greedy, write_family_model

NEW_TOKENS = 12
SHARED = list(range(300, 372))
#: Short and long prompts, two sharing 72 tokens (the second hits the first's prefix cache), and
#: one past the rope scaling's original context.
PROMPTS = [[1, 2, 3], SHARED + [5, 6, 7], SHARED + [9, 10], [7] * 40, list(range(1000, 1150))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(family, tmp_path, default_model_dir):
    hf = write_family_model(family, tmp_path, default_model_dir)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as published checkpoints are
    llm = LLM(str(tmp_path), max_total_tokens=2048, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params)
    rest = llm.generate(PROMPTS[2:], params)
    assert rest[0].num_cached_tokens >= 64  # the shared prefix came from the cache
    for prompt, out in zip(PROMPTS, first + rest):
        assert out.token_ids == greedy(hf, prompt, NEW_TOKENS), prompt[:5]


def _config(**overrides) -> dict:
    raw = {"model_type": "llama", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    return {**raw, **overrides}


@pytest.mark.parametrize("overrides, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                          "factor": 2.0}}, "partial_rotary_factor"),
    ({"model_type": "qwen2_moe"}, "model_type"),
    ({"model_type": "qwen3_moe", "moe_intermediate_size": 8}, "num_experts"),
])
def test_what_the_engine_does_not_compute_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(_config(**overrides), name="m")


def test_config_fields_of_each_family():
    qwen3_moe = ModelConfig.from_dict(_config(model_type="qwen3_moe", num_hidden_layers=4, num_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=2,
                                              mlp_only_layers=[3], norm_topk_prob=True), name="m")
    assert qwen3_moe.qk_norm and qwen3_moe.moe.sparse_layers == {1} and qwen3_moe.moe.norm_topk_prob
    mixtral = ModelConfig.from_dict(_config(model_type="mixtral", num_local_experts=4, sliding_window=None), name="m")
    assert mixtral.moe.sparse_layers == {0} and mixtral.moe.norm_topk_prob and not mixtral.qk_norm
    # Attention that slides is full attention up to its window: the context stops there.
    mistral = ModelConfig.from_dict(_config(model_type="mistral", sliding_window=64, max_position_embeddings=256),
                                    name="m")
    assert mistral.max_position_embeddings == 64
    qwen2 = ModelConfig.from_dict(_config(model_type="qwen2", sliding_window=64, use_sliding_window=False,
                                          max_position_embeddings=256), name="m")
    assert qwen2.max_position_embeddings == 256 and qwen2.attention_bias


def test_a_moe_model_is_refused_at_tp_above_one():
    from pd_cluster.model.shard import Shard

    config = ModelConfig.from_dict(_config(model_type="mixtral", num_local_experts=4), name="m")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Shard(0, 2).check(config)


def test_generation_config_sampling_defaults_apply_where_a_request_leaves_them(tmp_path, default_model_dir):
    from pd_cluster.generation_defaults import generation_defaults

    hf = write_family_model("qwen3", tmp_path, default_model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 1, "top_p": 0.95, "eos_token_id": [7, 9]}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 1, "top_p": 0.95}
    llm = LLM(str(tmp_path), max_total_tokens=512)
    assert {7, 9} <= llm.engine.eos_token_ids  # a list of eos ids, each one stops
    # No params: the model's (top_k 1: greedy); the same defaults left out: sampled at temperature 1.
    [defaults] = llm.generate([PROMPTS[3]])
    [plain] = llm.generate([PROMPTS[3]], SamplingParams(seed=3))
    want = greedy(hf, PROMPTS[3], len(defaults.token_ids))
    assert defaults.token_ids == want and plain.token_ids != want
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(tmp_path)
