"""Our Llama implementation against transformers on small random models of several shapes."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pd_cluster import LLM, SamplingParams


def _make_model(path, default_model_dir, **overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    fields.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    # Sharded on purpose: the loader must follow model.safetensors.index.json.
    model.save_pretrained(path, max_shard_size="5MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True, "num_key_value_heads": 6},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}},
    ],
    ids=["gqa-untied-sharded", "mha-tied", "llama3-rope"],
)
def test_greedy_matches_transformers_on_random_models(tmp_path, default_model_dir, overrides):
    hf = _make_model(tmp_path, default_model_dir, **overrides).eval()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    llm = LLM(str(tmp_path), max_total_tokens=2048, max_num_batched_tokens=64)
    prompts = [[1, 2, 3], list(range(100, 190)), [7] * 40]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ids[0, len(prompt):].tolist()


def test_bfloat16_weights_load_and_generate(tmp_path, default_model_dir):
    _make_model(tmp_path, default_model_dir)
    llm = LLM(str(tmp_path), dtype="bfloat16", max_total_tokens=512)
    assert llm.engine.pool.k_cache.dtype == torch.bfloat16
    [out] = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and all(0 <= t < 49152 for t in out.token_ids)
