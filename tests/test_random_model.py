"""Random-weight model directories: loadable by the engine and by transformers, with a real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from pd_cluster.bench.random_model import shape_config, write_random_model


def test_tiny_shape_loads_in_the_engine_and_matches_transformers(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pd_cluster import LLM, SamplingParams

    out = write_random_model("tiny", tmp_path / "tiny", default_model_dir, dtype="float32", device="cpu")
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["vocab_size"] == len(tokenizer)  # every sampled id decodes
    assert config["eos_token_id"] == tokenizer.eos_token_id
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.3.mlp.down_proj.weight" in index["weight_map"]

    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    llm = LLM(model=str(out), device="cpu", dtype="float32")
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(8):
            sequence.append(int(hf(torch.tensor([sequence])).logits[0, -1].argmax()))
    assert list(ours.token_ids) == sequence[len(ids):]


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="shape"):
        shape_config("llama-9000")
