"""Load Hugging Face Llama-family safetensors (sharded too) into the engine's fused layout."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pd_cluster.model.config import ModelConfig
from pd_cluster.model.dummy_weights import DummyTensors
from pd_cluster.model.shard import HeadRange, Shard

logger = logging.getLogger(__name__)

#: Where the weights come from (``--load-format``): the model's safetensors files, or seeded
#: random values of its shape made on the device (:mod:`pd_cluster.model.dummy_weights`).
LOAD_FORMATS = ("safetensors", "dummy")


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


class TensorFiles:
    """The tensors of a model directory by name, read lazily: a rank of a tensor-parallel node
    reads only its slices (``get_slice``), never a whole matrix it would throw most of away."""

    def __init__(self, path: Path) -> None:
        self._handles = [safe_open(str(file), framework="pt") for file in _weight_files(path)]
        self._where = {name: handle for handle in self._handles for name in handle.keys()}
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str, rows: HeadRange | None = None, cols: HeadRange | None = None,
             unit: int = 1) -> torch.Tensor:
        """Tensor ``name``, or its rows / columns ``[start*unit, stop*unit)`` (``unit``: a head's size)."""
        try:
            part = self._where[name].get_slice(name)
        except KeyError:
            raise KeyError(f"weight {name!r} is missing from {self.path}") from None
        if rows is None and cols is None:
            return part[:]
        r = slice(rows.start * unit, rows.stop * unit) if rows is not None else slice(None)
        if cols is None:
            return part[r]
        return part[r, cols.start * unit : cols.stop * unit]


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = TensorFiles(path)
    return {name: files.read(name) for name in files.names()}


def load_weights(
    path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
    shard: Shard | None = None, load_format: str = "safetensors",
) -> ModelWeights:
    """Read every tensor (or, for one rank of ``shard``, its slices) once, fuse q/k/v and gate/up,
    and place them on ``device`` in ``dtype``. A rank's q/k/v and gate/up are its rows
    (column-parallel), its o and down its columns (row-parallel: the ranks' outputs sum to the
    whole); norms, the embedding and the head are whole on every rank. ``load_format`` "dummy":
    the same tensors made on ``device`` from a seed (see :data:`LOAD_FORMATS`)."""
    shard = shard or Shard()
    shard.check(config)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r}; expected one of {LOAD_FORMATS}")
    files: TensorFiles | DummyTensors = (DummyTensors(config, device) if load_format == "dummy"
                                         else TensorFiles(Path(path)))
    taken: set[str] = set()
    head_dim = config.head_dim
    qh, kvh, inter = shard.q_heads(config), shard.kv_heads(config), shard.intermediate(config)
    whole = shard.whole

    def take(name: str, rows: HeadRange | None = None, cols: HeadRange | None = None, unit: int = 1) -> torch.Tensor:
        taken.add(name)
        if whole:
            rows = cols = None
        return files.read(name, rows, cols, unit).to(device=device, dtype=dtype).contiguous()

    def maybe(name: str, rows: HeadRange | None = None) -> torch.Tensor | None:
        return take(name, rows, unit=head_dim) if name in files else None

    from tqdm.auto import tqdm

    layers = []
    # A bar only on a terminal (disable=None): node processes write to log files.
    for i in tqdm(range(config.num_layers), desc="loading weights", unit="layer", disable=None, leave=False):
        p = f"model.layers.{i}."
        q = take(p + "self_attn.q_proj.weight", qh, unit=head_dim)
        k = take(p + "self_attn.k_proj.weight", kvh, unit=head_dim)
        v = take(p + "self_attn.v_proj.weight", kvh, unit=head_dim)
        biases = [maybe(p + f"self_attn.{n}_proj.bias", h) for n, h in zip("qkv", (qh, kvh, kvh))]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        gate, up = take(p + "mlp.gate_proj.weight", inter), take(p + "mlp.up_proj.weight", inter)
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat((q, k, v)).contiguous(),
                qkv_bias=qkv_bias,
                o=take(p + "self_attn.o_proj.weight", cols=qh, unit=head_dim),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat((gate, up)).contiguous(),
                down=take(p + "mlp.down_proj.weight", cols=inter),
            )
        )
        del q, k, v, gate, up
    embed = take("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in files
    lm_head = embed if tied else take("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)
    taken.add("lm_head.weight")
    leftovers = [n for n in files.names() if n not in taken and "rotary_emb" not in n]
    if leftovers:
        logger.warning("ignored %d unused tensors, e.g. %s", len(leftovers), leftovers[:3])
    return weights
