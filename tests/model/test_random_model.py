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


#: Parameter counts as the model cards give them (billions, rounded as there).
PUBLISHED_PARAMETERS = {"qwen3-8b": 8.2, "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7, "llama3-70b": 70.6}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_published_shapes_are_what_transformers_builds_from_their_configs(shape, tmp_path):
    """transformers reads each shape's config as its family's and builds a model of the card's size,
    whose tensors are those a checkpoint of the shape holds (:func:`hf_tensor_shapes`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pd_cluster.model.config import ModelConfig
    from pd_cluster.model.dummy_weights import hf_tensor_shapes

    published = shape_config(shape)
    (tmp_path / "config.json").write_text(json.dumps(published))
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__.removesuffix("Config") + "ForCausalLM" == published["architectures"][0]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    count = sum(p.numel() for p in hf.parameters())
    assert round(count / 1e9, 1) == PUBLISHED_PARAMETERS[shape]
    config = ModelConfig.from_path(tmp_path)
    assert sum(torch.Size(s).numel() for s in hf_tensor_shapes(config).values()) == count
