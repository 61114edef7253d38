"""Load Hugging Face Llama-family safetensors (sharded too) into the engine's fused layout."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pd_cluster.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [ (Hq + 2*Hkv) * D, hidden ]: q, k and v projections fused
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate then up, fused
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def decode_bytes(self) -> int:
        """Bytes a decode step reads from the weights: every matrix but the embedding table (a step
        gathers only its rows), the vocabulary head once even when tied to the embedding."""
        tensors = [self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_weights(
    path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> ModelWeights:
    """Read every tensor once, fuse q/k/v and gate/up, and place them on ``device`` in ``dtype``."""
    state = read_state_dict(Path(path))

    def take(name: str) -> torch.Tensor:
        try:
            tensor = state.pop(name)
        except KeyError:
            raise KeyError(f"weight {name!r} is missing from {path}") from None
        return tensor.to(device=device, dtype=dtype).contiguous()

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in state else None

    from tqdm.auto import tqdm

    layers = []
    # A bar only on a terminal (disable=None): node processes write to log files.
    for i in tqdm(range(config.num_layers), desc="loading weights", unit="layer", disable=None, leave=False):
        p = f"model.layers.{i}."
        q, k, v = take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"), take(p + "self_attn.v_proj.weight")
        biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat((q, k, v)).contiguous(),
                qkv_bias=qkv_bias,
                o=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat((gate, up)).contiguous(),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
        del q, k, v, gate, up
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings or "lm_head.weight" not in state else take("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)
    state.pop("lm_head.weight", None)
    leftovers = [n for n in state if "rotary_emb" not in n]
    if leftovers:
        logger.warning("ignored %d unused tensors, e.g. %s", len(leftovers), leftovers[:3])
    return weights
