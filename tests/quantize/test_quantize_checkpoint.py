"""``pd-cluster quantize``: a float checkpoint written as a compressed-tensors FP8 one that loads as
published, its projections rounded by GPTQ over the shipped calibration text (or to nearest), the
rest copied as it was."""

from __future__ import annotations

import json

import pytest
import torch

from pd_cluster import cli
from pd_cluster.bench.random_model import write_random_model
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.quant_linear import FP8, QuantLinear, quantize
from pd_cluster.model.weights import load_weights, read_state_dict
from pd_cluster.quantize.checkpoint import calibration_windows, projection_names
from pd_cluster.quantize.gptq import FP8_HEADROOM
from pd_cluster.quantize.options import CALIBRATION_TEXT
from pd_cluster.quantize.hessians import projection_hessians

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    return write_random_model("tiny", tmp_path_factory.mktemp("tiny") / "float", default_model_dir, dtype="float32",
                              device="cpu")


@pytest.fixture(scope="module")
def written(tiny_model, tmp_path_factory):
    """The tiny model quantized by the command, by GPTQ and to nearest."""
    out = {}
    for method in ("gptq", "rtn"):
        path = tmp_path_factory.mktemp("quantized") / method
        # A few sampled tokens: the calibration text's moments are what the tests check against.
        assert cli.main(["quantize", "--model", str(tiny_model), "--out", str(path), "--method", method,
                         "--device", "cpu", "--sampled-tokens", "256"]) == 0
        out[method] = path
    return out


def _layer_inputs(model_dir) -> dict[tuple[int, str], torch.Tensor]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", enable_prefix_cache=False,
                                    cuda_graphs=False))
    try:
        windows = calibration_windows(engine.tokenizer, CALIBRATION_TEXT.read_text(), 512)
        return projection_hessians(engine, windows)
    finally:
        engine.close()


def test_the_checkpoint_loads_as_published_fp8_with_everything_else_as_it_was(tiny_model, written):
    source = read_state_dict(tiny_model)
    projections = projection_names(ModelConfig.from_path(tiny_model))
    for method, path in written.items():
        config = ModelConfig.from_path(path)
        assert config.checkpoint_quantization == "compressed-tensors"
        assert json.loads((path / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
        tensors = read_state_dict(path)
        for name, tensor in source.items():
            if name in projections:
                scale = tensors[name[: -len("weight")] + "weight_scale"]
                assert tensors[name].dtype == FP8 and scale.dtype == torch.float32
                assert scale.shape == (tensor.shape[0], 1)
                headroom = FP8_HEADROOM if method == "gptq" else 1.0
                torch.testing.assert_close(scale[:, 0], quantize(tensor, "fp8").scale * headroom)
                if method == "rtn":  # what --quantization fp8 makes at load
                    assert torch.equal(tensors[name], quantize(tensor, "fp8").qweight)
            else:
                assert torch.equal(tensors[name], tensor), name
        assert set(tensors) == set(source) | {n[: -len("weight")] + "weight_scale" for n in projections}
        for name in TOKENIZER_FILES:
            assert (path / name).read_bytes() == (tiny_model / name).read_bytes()
        weights = load_weights(path, config, torch.float32, "cpu", quantization="fp8")
        qkv = weights.layers[0].qkv
        assert isinstance(qkv, QuantLinear) and qkv.qweight.dtype == FP8
        q_name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(qkv.qweight[: tensors[q_name].shape[0]], tensors[q_name])


def test_gptq_leaves_a_smaller_output_error_over_the_calibration_inputs_than_rounding_to_nearest(tiny_model, written):
    moments = _layer_inputs(tiny_model)
    source = read_state_dict(tiny_model)
    rounded = {method: read_state_dict(path) for method, path in written.items()}
    errors = {}
    for method, tensors in rounded.items():
        total = 0.0
        for name, (layer, kind) in projection_names(ModelConfig.from_path(tiny_model)).items():
            q = QuantLinear(tensors[name], tensors[name[: -len("weight")] + "weight_scale"][:, 0])
            diff = source[name].float() - q.dequantize(torch.float32)
            total += float(torch.einsum("nk,kj,nj->", diff, moments[layer, kind], diff))
        errors[method] = total
    assert errors["gptq"] < 0.9 * errors["rtn"], errors
    assert not torch.equal(rounded["gptq"]["model.layers.1.mlp.down_proj.weight"],
                           rounded["rtn"]["model.layers.1.mlp.down_proj.weight"])


def test_the_command_refuses_a_quantized_model_and_a_used_output_directory(written, tmp_path):
    with pytest.raises(ValueError, match="already quantized"):
        cli.main(["quantize", "--model", str(written["rtn"]), "--out", str(tmp_path / "again"), "--method", "rtn"])
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        cli.main(["quantize", "--model", "default", "--out", str(written["rtn"]), "--method", "rtn"])
