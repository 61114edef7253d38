"""``pd-cluster quantize``: a float checkpoint written as an FP8 one that every node loads as
published (``compressed-tensors``' float format: e4m3 weights, a float32 ``weight_scale`` an
output channel; activations quantized per token as they come), rounded by GPTQ over calibration
text or to nearest.

Quantizing at load (``--quantization fp8``) rounds to nearest on every start; GPTQ needs the
model run over text and a matrix inverse a projection, so it is done once, here, and the result
served like any published FP8 release (vLLM and SGLang read the same files). The embedding, the
norms, biases and the vocabulary head are copied as they are.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from pd_cluster.model.checkpoint_writer import CheckpointWriter
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.hf_names import dense_mlp_names, layer_prefix
from pd_cluster.model.quant_linear import QuantLinear, quantize
from pd_cluster.model.weights import TensorFiles
from pd_cluster.quantize.gptq import gptq_quantize
from pd_cluster.quantize.options import METHODS, SAMPLE_OPENINGS, QuantizeOptions

logger = logging.getLogger(__name__)

#: KV slots of the engine that calibrates (its requests queue for them).
CALIBRATION_KV_TOKENS = 16384
#: The ``quantization_config`` written to config.json: 8-bit float weights, a scale a channel;
#: activations dynamic, a scale a token; the vocabulary head left out.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        },
    },
    "ignore": ["lm_head"],
}


def projection_names(config: ModelConfig) -> dict[str, tuple[int, str]]:
    """Each dense projection's tensor name -> ``(layer, input)``: the projections that share an
    input (q/k/v, gate/up) share its name, and are rounded as one matrix."""
    names: dict[str, tuple[int, str]] = {}
    for i in range(config.num_layers):
        p = layer_prefix(i)
        for proj in ("q", "k", "v"):
            names[f"{p}self_attn.{proj}_proj.weight"] = (i, "qkv")
        names[f"{p}self_attn.o_proj.weight"] = (i, "o")
        mlp = dense_mlp_names(i)
        names[mlp.gate] = names[mlp.up] = (i, "gate_up")
        names[mlp.down] = (i, "down")
    return names


def token_windows(ids: list[int], window: int) -> list[list[int]]:
    """``ids`` in windows of ``window`` (the last one shorter, none under two tokens)."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def calibration_windows(tokenizer: Any, text: str, window: int) -> list[list[int]]:
    """``text``'s tokens in windows of ``window``."""
    return token_windows(list(tokenizer.encode(text, add_special_tokens=False)), window)


def sampled_windows(engine: Any, total: int, seed: int = 0) -> list[list[int]]:
    """About ``total`` tokens the model writes itself (temperature 1, top-p 0.95, each opening of
    :data:`SAMPLE_OPENINGS` its own seed; a sample ends early at the end of its text), with their
    openings."""
    from pd_cluster.sampling_params import SamplingParams

    if total <= 0:
        return []
    each = max(1, total // len(SAMPLE_OPENINGS))
    requests = []
    for number, opening in enumerate(SAMPLE_OPENINGS):
        ids = list(engine.tokenizer.encode(opening, add_special_tokens=False))
        params = SamplingParams(max_tokens=each, temperature=1.0, top_p=0.95, seed=seed + number)
        requests.append(engine.add_request(f"calibration-sample-{number}", ids, params))
    while engine.has_unfinished():
        engine.step()
    return [list(r.prompt_token_ids) + list(r.output_token_ids) for r in requests]


def collect_hessians(options: QuantizeOptions, source: Path) -> dict[tuple[int, str], torch.Tensor]:
    """Each projection's input moment over the calibration text and the model's own samples, the
    engine run in float32 on CPU (the model's dtype on a GPU), prefix cache and CUDA graphs off."""
    from pd_cluster.config import EngineConfig, resolve_device
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.quantize.hessians import projection_hessians

    device = resolve_device(options.device)
    # A small KV pool: the moments (a large model's take tens of GB) need the memory more.
    engine = LLMEngine(EngineConfig(model=str(source), device=device, dtype="float32" if device == "cpu" else "auto",
                                    enable_prefix_cache=False, cuda_graphs=False,
                                    max_num_batched_tokens=max(options.window, 64),
                                    max_total_tokens=CALIBRATION_KV_TOKENS))
    try:
        windows = calibration_windows(engine.tokenizer, options.calibration.read_text(), options.window)
        if not windows:
            raise ValueError(f"{options.calibration} holds no text to calibrate on")
        samples = sampled_windows(engine, options.sampled_tokens)
        logger.info("calibrating on %d tokens of %s and %d the model sampled", sum(map(len, windows)),
                    options.calibration.name, sum(map(len, samples)))
        return projection_hessians(engine, windows + samples)
    finally:
        engine.close()


def _round_group(tensors: list[torch.Tensor], hessian: torch.Tensor | None, options: QuantizeOptions,
                 device: torch.device) -> list[QuantLinear]:
    """Matrices of one input, rounded as one (GPTQ) or each to nearest; split back by rows."""
    whole = torch.cat([t.to(device=device, dtype=torch.float32) for t in tensors])
    if hessian is None:
        q = quantize(whole, "fp8")
    else:
        q = gptq_quantize(whole, hessian.to(device), "fp8", damp=options.damp, block=options.block,
                          act_order=options.act_order)
    out, start = [], 0
    for t in tensors:
        stop = start + t.shape[0]
        out.append(QuantLinear(q.qweight[start:stop].cpu().contiguous(), q.scale[start:stop].cpu().contiguous()))
        start = stop
    return out


def quantize_checkpoint(options: QuantizeOptions) -> Path:
    """Write ``options.model`` (a float Hugging Face directory, or "default") to ``options.out`` as
    an FP8 checkpoint; the output directory."""
    from pd_cluster.config import resolve_device
    from pd_cluster.default_model import resolve_model_path

    if options.method not in METHODS:
        raise ValueError(f"method {options.method!r}; expected one of {METHODS}")
    source = resolve_model_path(options.model)
    config = ModelConfig.from_path(source)
    if config.checkpoint_quantization is not None:
        raise ValueError(f"{source} is already quantized ({config.checkpoint_quantization}): start from float weights")
    if config.moe is not None:
        raise ValueError("models with routed experts are not supported (their experts see routed inputs; "
                         "serve them with --quantization fp8 instead)")
    out = Path(options.out)
    if out.resolve() == source.resolve():
        raise ValueError("the output directory must not be the model's own")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out} already holds a checkpoint")
    hessians = collect_hessians(options, source) if options.method == "gptq" else None
    device = torch.device(resolve_device(options.device))
    files = TensorFiles(source)
    inputs = projection_names(config)
    groups: dict[tuple[int, str], list[str]] = {}
    for name in files.names():
        if name in inputs:
            groups.setdefault(inputs[name], []).append(name)
    writer = CheckpointWriter(out)
    for name in files.names():
        if name not in inputs:
            writer.add(name, files.read(name))
    for key, names in sorted(groups.items()):
        rounded = _round_group([files.read(n) for n in names], hessians[key] if hessians else None, options, device)
        for name, q in zip(names, rounded):
            writer.add(name, q.qweight)
            writer.add(name[: -len("weight")] + "weight_scale", q.scale[:, None])
        logger.debug("layer %d %s: %s rounded", key[0], key[1], ", ".join(names))
    writer.close()
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    logger.info("wrote %s: %d projections in FP8 (%s)", out, sum(len(n) for n in groups.values()), options.method)
    return out
