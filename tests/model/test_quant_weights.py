"""8-bit weights: quantization error bounds, and FP8 checkpoints (compressed-tensors, fbgemm_fp8)
loading with their own scales into the logits of their dequantized float32 weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pd_cluster import LLM, SamplingParams
from pd_cluster.bench.random_model import write_random_model
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.forward_batch import ForwardBatch
from pd_cluster.model.llama import LlamaModel
from pd_cluster.model.quant_linear import FP8, QuantLinear, linear, quantize
from pd_cluster.model.weights import load_weights, read_state_dict

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [5, 17, 300, 42, 9, 11, 12, 900, 31, 7]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_dequantize_round_trip_error_is_bounded(method):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # channels of unlike sizes
    w[3] = 0.0  # an all-zero channel
    q = quantize(w, method)
    assert q.qweight.dtype == (torch.int8 if method == "int8" else FP8) and q.scale.shape == (64,)
    assert torch.equal(q.scale[3], torch.tensor(1.0)) and not q.qweight[3].float().any()
    err = (q.dequantize(torch.float32) - w).abs()
    amax = w.abs().amax(dim=1, keepdim=True)
    if method == "int8":
        assert (err <= amax / 127 / 2 * 1.0001 + 1e-12).all()  # half a step of the channel's grid
    else:
        # e4m3: 3 mantissa bits (half an ulp, 2**-4 relative), and subnormals below 2**-6 of the
        # scale (steps of 2**-9 scale).
        scale = amax / 448
        assert (err <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()
    # Each channel's largest value lands on the format's largest code (up to float32 rounding).
    torch.testing.assert_close(q.dequantize(torch.float32).abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_quantized_product_is_the_product_with_the_dequantized_weight(method):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 96, generator=gen), torch.randn(40, 96, generator=gen)
    bias = torch.randn(40, generator=gen)
    q = quantize(w, method)
    torch.testing.assert_close(linear(x, q, bias), torch.nn.functional.linear(x, q.dequantize(torch.float32), bias),
                               rtol=1e-5, atol=1e-5)
    rel = (linear(x, q) - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < (0.01 if method == "int8" else 0.05)


def _fp8_per_tensor(w: torch.Tensor) -> QuantLinear:
    scale = w.abs().amax() / 448
    return QuantLinear((w / scale).clamp(-448, 448).to(FP8), scale.reshape(1).expand(w.shape[0]))


def _write_fp8_checkpoint(src: Path, out: Path, quantization_config: dict, per_tensor: bool = False,
                          keep: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """The model at ``src`` as an FP8 checkpoint at ``out`` (names in ``keep`` left in float32),
    and the same weights dequantized into a float32 checkpoint beside it."""
    state = read_state_dict(src)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS and module not in keep:
            q = _fp8_per_tensor(tensor) if per_tensor else quantize(tensor, "fp8")
            quantized[name] = q.qweight
            quantized[module + ".weight_scale"] = (q.scale[:1].clone() if per_tensor else q.scale[:, None].clone())
            dequantized[name] = q.dequantize(torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    dirs = []
    for suffix, tensors, qconfig in (("fp8", quantized, quantization_config), ("dequantized", dequantized, None)):
        target = out.with_name(out.name + "-" + suffix)
        shutil.copytree(src, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
        if qconfig is not None:
            config = json.loads((target / "config.json").read_text())
            config["quantization_config"] = qconfig
            (target / "config.json").write_text(json.dumps(config))
        dirs.append(target)
    return dirs[0], dirs[1]


class _Caches:
    quant = None  # model-dtype KV

    def __init__(self, config: ModelConfig, slots: int) -> None:
        shape = (slots, config.num_kv_heads, config.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches[index]


def _prompt_logits(path: Path, quantization: str) -> torch.Tensor:
    config = ModelConfig.from_path(path)
    weights = load_weights(path, config, torch.float32, "cpu", quantization=quantization)
    n = len(PROMPT)
    positions = torch.arange(n)
    batch = ForwardBatch(input_ids=torch.tensor(PROMPT), positions=positions, out_slots=positions,
                         slot_table=positions[None], ctx_lens=torch.tensor([n]), q_lens=torch.tensor([n]),
                         q_start_loc=torch.tensor([0]), logits_indices=positions, is_decode=False)
    return LlamaModel(config, weights, torch.device("cpu")).forward(batch, _Caches(config, n))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir) -> Path:
    return write_random_model("tiny", tmp_path_factory.mktemp("tiny") / "float", default_model_dir, dtype="float32",
                              device="cpu")


COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                              "strategy": "token"}}},
}
FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]}


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "compressed-tensors-tensor", "fbgemm_fp8"])
def test_an_fp8_checkpoint_serves_the_logits_of_its_dequantized_weights(tiny_model, fmt):
    if fmt == "fbgemm_fp8":
        fp8, ref = _write_fp8_checkpoint(tiny_model, tiny_model.parent / fmt, FBGEMM,
                                         keep=tuple(m for m in FBGEMM["modules_to_not_convert"] if m != "lm_head"))
    else:
        per_tensor = fmt.endswith("tensor")
        qconfig = json.loads(json.dumps(COMPRESSED_TENSORS))
        qconfig["config_groups"]["group_0"]["weights"]["strategy"] = "tensor" if per_tensor else "channel"
        fp8, ref = _write_fp8_checkpoint(tiny_model, tiny_model.parent / fmt, qconfig, per_tensor=per_tensor)
    assert ModelConfig.from_path(fp8).checkpoint_quantization == ("fbgemm_fp8" if fmt == "fbgemm_fp8"
                                                                  else "compressed-tensors")
    weights = load_weights(fp8, ModelConfig.from_path(fp8), torch.float32, "cpu", quantization="fp8")
    assert isinstance(weights.layers[1].qkv, QuantLinear) and weights.layers[1].qkv.qweight.dtype == FP8
    expected = _prompt_logits(ref, "none")
    torch.testing.assert_close(_prompt_logits(fp8, "fp8"), expected, rtol=1e-4, atol=1e-4)  # its own scales
    torch.testing.assert_close(_prompt_logits(fp8, "none"), expected, rtol=1e-5, atol=1e-5)  # dequantized
    # Re-quantized to fp8 at load, an fp8 grid's values come back as they were.
    if fmt == "compressed-tensors-channel":
        torch.testing.assert_close(_prompt_logits(ref, "fp8"), expected, rtol=1e-4, atol=1e-4)


def test_an_fp8_checkpoint_generates_the_tokens_of_its_dequantized_weights(tiny_model):
    fp8, ref = _write_fp8_checkpoint(tiny_model, tiny_model.parent / "gen", FBGEMM,
                                     keep=("model.layers.0.self_attn.k_proj",))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], list(range(100, 130))]
    tokens = {}
    for name, path, quantization in (("fp8", fp8, "fp8"), ("ref", ref, "none")):
        llm = LLM(model=str(path), device="cpu", dtype="float32", quantization=quantization, max_total_tokens=512)
        try:
            tokens[name] = [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert tokens["fp8"] == tokens["ref"]


#: An "FP8-KV" release's kv_cache_scheme: one static scale a layer for the keys, one for the values.
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def test_an_fp8_kv_checkpoint_loads_and_its_static_kv_scales_go_unused(tiny_model, caplog):
    """The weights load with their own scales as without the scheme (the same logits), the
    static KV scales in each of their published spellings count as known (no "unused tensors"
    warning, one line that says they are not used), and the engine serves it with fp8 KV."""
    qconfig = {**COMPRESSED_TENSORS, "kv_cache_scheme": KV_CACHE_SCHEME}
    fp8, _ = _write_fp8_checkpoint(tiny_model, tiny_model.parent / "fp8kv", qconfig)
    plain, _ = _write_fp8_checkpoint(tiny_model, tiny_model.parent / "fp8plain", COMPRESSED_TENSORS)
    state = read_state_dict(fp8)
    spellings = [("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale"),
                 ("k_proj.k_scale", "v_proj.v_scale"), ("kv_scale",)]  # the module's, older, ModelOpt's, oldest
    for layer in range(ModelConfig.from_path(fp8).num_layers):
        for i, name in enumerate(spellings[layer % len(spellings)]):
            state[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(0.02 + 0.01 * i)
    save_file({k: v.contiguous() for k, v in state.items()}, str(fp8 / "model.safetensors"))
    with caplog.at_level("INFO", logger="pd_cluster.model.weights"):
        logits = _prompt_logits(fp8, "fp8")
    assert "unused tensors" not in caplog.text and "static KV cache scales are not used" in caplog.text
    assert torch.equal(logits, _prompt_logits(plain, "fp8"))
    llm = LLM(model=str(fp8), device="cpu", dtype="float32", quantization="fp8", kv_cache_dtype="fp8_e4m3",
              max_total_tokens=512)
    try:
        [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4 and llm.engine.kv_spec.kv_dtype == "fp8_e4m3"
    finally:
        llm.close()


@pytest.mark.parametrize("qconfig, field", [
    ({"quant_method": "gptq"}, "gptq"),
    ({**COMPRESSED_TENSORS, "format": "pack-quantized"}, "format"),
    ({**COMPRESSED_TENSORS, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "num_bits"),
    ({**COMPRESSED_TENSORS, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "block"}}}}, "strategy"),
])
def test_other_quantized_checkpoints_are_refused_naming_the_field(default_model_dir, qconfig, field):
    raw = json.loads((default_model_dir / "config.json").read_text())
    raw["quantization_config"] = qconfig
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(raw, "m")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_dummy_weights_load_quantized(tiny_model, method):
    config = ModelConfig.from_path(tiny_model)
    weights = load_weights(tiny_model, config, torch.float32, "cpu", load_format="dummy", quantization=method)
    plain = load_weights(tiny_model, config, torch.float32, "cpu", load_format="dummy")
    layer = weights.layers[0]
    for name in ("qkv", "o", "gate_up", "down"):
        held = getattr(layer, name)
        assert isinstance(held, QuantLinear) and held.method == method
        torch.testing.assert_close(held.dequantize(torch.float32), getattr(plain.layers[0], name),
                                   rtol=0.07, atol=1e-3)
    assert weights.embed.dtype == weights.lm_head.dtype == layer.input_norm.dtype == torch.float32
    assert weights.decode_bytes() < plain.decode_bytes()


def test_fp8_mixed_holds_gate_up_int8_and_the_rest_fp8_in_the_bytes_of_fp8(tiny_model):
    config = ModelConfig.from_path(tiny_model)
    mixed = load_weights(tiny_model, config, torch.float32, "cpu", quantization="fp8_mixed")
    fp8 = load_weights(tiny_model, config, torch.float32, "cpu", quantization="fp8")
    plain = load_weights(tiny_model, config, torch.float32, "cpu")
    for layer, plain_layer in zip(mixed.layers, plain.layers):
        for name, method in (("qkv", "fp8"), ("o", "fp8"), ("gate_up", "int8"), ("down", "fp8")):
            held = getattr(layer, name)
            assert isinstance(held, QuantLinear) and held.method == method, name
            torch.testing.assert_close(held.dequantize(torch.float32), getattr(plain_layer, name),
                                       rtol=0.07, atol=1e-3)
    assert mixed.decode_bytes() == fp8.decode_bytes()


def test_an_fp8_checkpoint_under_fp8_mixed_keeps_its_fp8_and_requantizes_gate_up(tiny_model):
    fp8, _ = _write_fp8_checkpoint(tiny_model, tiny_model.parent / "mixed", COMPRESSED_TENSORS)
    config = ModelConfig.from_path(fp8)
    mixed = load_weights(fp8, config, torch.float32, "cpu", quantization="fp8_mixed")
    published = load_weights(fp8, config, torch.float32, "cpu", quantization="fp8")
    layer, kept = mixed.layers[0], published.layers[0]
    assert layer.gate_up.method == "int8" and layer.down.method == "fp8"
    assert torch.equal(layer.down.qweight.float(), kept.down.qweight.float())
    torch.testing.assert_close(layer.gate_up.dequantize(torch.float32), kept.gate_up.dequantize(torch.float32),
                               rtol=0.02, atol=1e-3)
