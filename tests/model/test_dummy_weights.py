"""Dummy weights (``--load-format dummy``): a directory of config and tokenizer only serves with
seeded random weights, the same on every load and every rank, so TP 2 equals TP 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.bench.random_model import TOKENIZER_FILES, main as random_model_main, shape_config
from pd_cluster.cli import build_parser, engine_config_from_args
from pd_cluster.local_cluster import LocalCluster, LocalOptions
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.dummy_weights import HALF_WIDTH
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import load_weights

PROMPTS = [[5, 17, 300, 42, 9], [7] * 3, list(range(100, 140))]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory, default_model_dir) -> Path:
    """The tiny-kv4 shape (4 KV heads, its own 4096-token vocabulary), config and tokenizer only."""
    out = tmp_path_factory.mktemp("dummy")
    (out / "config.json").write_text(json.dumps(shape_config("tiny-kv4")))
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    return out


def _load(path: Path, shard: Shard | None = None):
    return load_weights(path, ModelConfig.from_path(path), torch.float32, "cpu", shard, load_format="dummy")


def _tensors(weights) -> list[torch.Tensor]:
    out = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        out += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
    return out


def test_two_loads_give_the_same_small_finite_weights(config_dir):
    first, second = _load(config_dir), _load(config_dir)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(first), _tensors(second), strict=True))
    qkv = first.layers[0].qkv
    assert qkv.abs().max() <= HALF_WIDTH and 0.015 < qkv.std() < 0.025
    assert torch.equal(first.layers[0].input_norm, torch.ones_like(first.layers[0].input_norm))
    # Different tensors differ (each has its own stream of values).
    assert not torch.equal(first.layers[0].o, first.layers[1].o)
    assert not torch.equal(first.embed[:, :8], first.lm_head[:, :8])


def test_a_rank_makes_exactly_its_slices_of_the_whole_model(config_dir):
    config = ModelConfig.from_path(config_dir)
    whole = _load(config_dir)
    d, half = config.head_dim, config.intermediate_size // 2
    q_rows, kv_rows = config.num_heads // 2 * d, config.num_kv_heads // 2 * d
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    for rank in (0, 1):
        part, ref = _load(config_dir, Shard(rank, 2)).layers[1], whole.layers[1]
        q, k, v = part.qkv.split((q_rows, kv_rows, kv_rows))
        assert torch.equal(q, ref.qkv[rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(k, ref.qkv[q_size + rank * kv_rows:q_size + (rank + 1) * kv_rows])
        assert torch.equal(v, ref.qkv[q_size + kv_size + rank * kv_rows:q_size + kv_size + (rank + 1) * kv_rows])
        assert torch.equal(part.o, ref.o[:, rank * q_rows:(rank + 1) * q_rows])
        gate, up = part.gate_up.split(half)
        assert torch.equal(gate, ref.gate_up[rank * half:(rank + 1) * half])
        assert torch.equal(up, ref.gate_up[config.intermediate_size + rank * half:config.intermediate_size
                                           + (rank + 1) * half])
        assert torch.equal(part.down, ref.down[:, rank * half:(rank + 1) * half])


def _generate(model: Path, tp: int) -> list[list[int]]:
    llm = LLM(model=str(model), device="cpu", dtype="float32", tp=tp, max_total_tokens=1024, load_format="dummy")
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        return [list(out.token_ids) for out in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


def test_tp2_on_dummy_weights_equals_tp1_token_for_token(config_dir):
    one = _generate(config_dir, 1)
    assert len(set(map(tuple, one))) > 1  # the weights are not degenerate: prompts answer differently
    assert _generate(config_dir, 2) == one


def test_a_directory_without_weights_is_refused_by_the_safetensors_format(config_dir):
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        load_weights(config_dir, ModelConfig.from_path(config_dir), torch.float32, "cpu")
    with pytest.raises(ValueError, match="load format 'pickle'"):
        load_weights(config_dir, ModelConfig.from_path(config_dir), torch.float32, "cpu", load_format="pickle")


def test_random_model_writes_the_70b_shape_config_only(tmp_path, default_model_dir):
    out = tmp_path / "m70b"
    assert random_model_main(["--shape", "llama3-70b", "--out", str(out), "--tokenizer", str(default_model_dir),
                              "--config-only", "--vocab", "shape"]) == 0
    assert not list(out.glob("*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    config = ModelConfig.from_path(out)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (8192, 80, 64, 8)
    assert (config.intermediate_size, config.vocab_size, config.rope_theta) == (28672, 128256, 500000.0)
    assert config.rope_scaling["rope_type"] == "llama3"
    assert (out / "tokenizer.json").is_file()
    Shard(0, 2).check(config)


def test_local_hands_the_load_format_to_every_node():
    args = build_parser().parse_args(["local", "--device", "cpu", "--prefill", "1", "--decode", "1",
                                      "--load-format", "dummy"])
    cluster = LocalCluster(LocalOptions(device="cpu", prefill=1, decode=1, load_format=args.load_format))
    cluster.plan()
    nodes = [s for s in cluster.process_specs("token", "admin") if s.name != "master"]
    assert len(nodes) == 2
    for spec in nodes:
        argv = list(spec.argv)
        assert engine_config_from_args(build_parser().parse_args(argv[argv.index(spec.role):]),
                                       spec.role).load_format == "dummy"
