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


def test_a_model_written_to_answer_in_words_generates_ids_that_encode_back(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    from pd_cluster import LLM, SamplingParams
    from pd_cluster.bench.words import whole_word_ids

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("The capital of France is", "x = [1,")]
    answers = {}
    for mode in ("any", "words"):
        out = write_random_model("tiny", tmp_path / mode, default_model_dir, dtype="float32", device="cpu",
                                 answers=mode)
        llm = LLM(model=str(out), device="cpu", dtype="float32")
        answers[mode] = [list(o.token_ids)
                         for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    words = set(whole_word_ids(tokenizer))
    for ids in answers["words"]:
        assert set(ids) <= words
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    # The same weights with an all-random head answer in other tokens too (word pieces, punctuation).
    assert any(not set(ids) <= words for ids in answers["any"])
    with pytest.raises(ValueError, match="answers"):
        write_random_model("tiny", tmp_path / "bad", default_model_dir, device="cpu", answers="letters")


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="shape"):
        shape_config("llama-9000")
