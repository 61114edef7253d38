"""Load Hugging Face Llama-family safetensors (sharded too) into the engine's fused layout."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pd_cluster.model.checkpoint_quant import ACTIVATION_SCALE_SUFFIXES, KV_SCALE_SUFFIXES, SCALE_SUFFIX
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.dummy_weights import DummyTensors
from pd_cluster.model.hf_names import dense_mlp_names, expert_names, layer_prefix, router_name
from pd_cluster.model.quant_linear import (
    FP8, QUANTIZATIONS, QuantLinear, Weight, fuse, projection_format, quantize, stack,
)
from pd_cluster.model.shard import HeadRange, Shard

logger = logging.getLogger(__name__)

#: Where the weights come from (``--load-format``): the model's safetensors files, or seeded
#: random values of its shape made on the device (:mod:`pd_cluster.model.dummy_weights`).
LOAD_FORMATS = ("safetensors", "dummy")


@dataclass
class ExpertWeights:
    """A sparse layer's routed experts, stacked: expert ``e``'s projections are row ``e``."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: Weight  # [experts, 2 * moe_intermediate, hidden]: gate then up, fused
    down: Weight  # [experts, hidden, moe_intermediate]

    def tensors(self) -> list[torch.Tensor]:
        return _flat([self.router, self.gate_up, self.down])


def _flat(items: list[Weight]) -> list[torch.Tensor]:
    """The tensors of float and 8-bit weights (an 8-bit one's codes and scales)."""
    return [t for item in items for t in (item.tensors() if isinstance(item, QuantLinear) else [item])]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    # The projections hold float or 8-bit weights (``--quantization``, an FP8 checkpoint).
    qkv: Weight  # [ (Hq + 2*Hkv) * D, hidden ]: q, k and v projections fused
    qkv_bias: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None  # [2 * intermediate, hidden]: gate then up, fused (None: routed experts)
    down: Weight | None
    #: Per-head RMSNorm weights ``[head_dim]`` of queries and keys before rotary (Qwen3).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    #: The routed experts of a sparse layer (then ``gate_up`` and ``down`` are None).
    experts: ExpertWeights | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds."""
        out = [self.input_norm, self.qkv, self.o, self.post_norm]
        out += [t for t in (self.qkv_bias, self.gate_up, self.down, self.q_norm, self.k_norm) if t is not None]
        return _flat(out) + (self.experts.tensors() if self.experts is not None else [])


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def decode_bytes(self) -> int:
        """Bytes a decode step reads from the weights: every matrix but the embedding table (a step
        gathers only its rows), the vocabulary head once even when tied to the embedding (all of a
        sparse layer's experts: the bound of a batch that routes to every one)."""
        tensors = [self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += layer.tensors()
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
    shard: Shard | None = None, load_format: str = "safetensors", quantization: str = "none",
) -> ModelWeights:
    """Read every tensor (or, for one rank of ``shard``, its slices) once, fuse q/k/v and gate/up,
    and place them on ``device`` in ``dtype``. A rank's q/k/v and gate/up are its rows
    (column-parallel), its o and down its columns (row-parallel: the ranks' outputs sum to the
    whole); norms (q/k norms too: they act within a head), the embedding and the head are whole
    on every rank. ``load_format`` "dummy": the same tensors made on ``device`` from a seed (see
    :data:`LOAD_FORMATS`). ``quantization`` int8 / fp8: the projections (q/k/v, o, gate/up, down,
    the experts') held 8-bit with a scale per output channel; the embedding, the norms, the head
    and a router stay in ``dtype``. An FP8 checkpoint's projections keep their own scales with
    fp8, are dequantized into ``dtype`` with none (and requantized with int8); those it leaves
    unquantized stay in ``dtype``."""
    shard = shard or Shard()
    shard.check(config)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r}; expected one of {LOAD_FORMATS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    files: TensorFiles | DummyTensors = (DummyTensors(config, device) if load_format == "dummy"
                                         else TensorFiles(Path(path)))
    reader = _Reader(files, dtype, torch.device(device), shard.whole, quantization,
                     keep_float=config.checkpoint_quantization is not None)
    from tqdm.auto import tqdm

    # A bar only on a terminal (disable=None): node processes write to log files.
    layers = [_load_layer(reader, config, shard, i)
              for i in tqdm(range(config.num_layers), desc="loading weights", unit="layer", disable=None, leave=False)]
    embed = reader.take("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in files
    lm_head = embed if tied else reader.take("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, final_norm=reader.take("model.norm.weight"), lm_head=lm_head)
    reader.taken.add("lm_head.weight")
    kv_scales = [n for n in files.names() if n.endswith(KV_SCALE_SUFFIXES)]
    if kv_scales:
        reader.taken.update(kv_scales)
        logger.info("the checkpoint's %d static KV cache scales are not used: the KV cache stores --kv-cache-dtype, "
                    "with a scale per token and KV head", len(kv_scales))
    leftovers = [n for n in files.names() if n not in reader.taken and "rotary_emb" not in n]
    if leftovers:
        logger.warning("ignored %d unused tensors, e.g. %s", len(leftovers), leftovers[:3])
    return weights


class _Reader:
    """Tensors by name, or a rank's slices of them, in the model's dtype on its device; it keeps
    the names it read (the rest are reported unused)."""

    def __init__(self, files: TensorFiles | DummyTensors, dtype: torch.dtype, device: torch.device,
                 whole: bool, quantization: str = "none", keep_float: bool = False) -> None:
        """``keep_float``: an FP8 checkpoint's projections without scales stay in ``dtype`` (the
        modules it leaves unquantized, as published)."""
        self.files, self.dtype, self.device, self.whole = files, dtype, device, whole
        self.quantization = quantization
        self.keep_float = keep_float
        self.taken: set[str] = set()

    def take(self, name: str, rows: HeadRange | None = None, cols: HeadRange | None = None,
             unit: int = 1) -> torch.Tensor:
        self.taken.add(name)
        if self.whole:
            rows = cols = None
        return self.files.read(name, rows, cols, unit).to(device=self.device, dtype=self.dtype).contiguous()

    def maybe(self, name: str, rows: HeadRange | None = None, unit: int = 1) -> torch.Tensor | None:
        return self.take(name, rows, unit=unit) if name in self.files else None

    def linear(self, name: str, projection: str, rows: HeadRange | None = None, cols: HeadRange | None = None,
               unit: int = 1) -> Weight:
        """Projection ``name`` of kind ``projection`` (qkv, o, gate_up, down: which 8-bit format
        the quantization holds it in; its rows or columns as :meth:`take`), float or 8-bit."""
        prefix = name[: -len("weight")]
        method = projection_format(self.quantization, projection)
        if prefix + SCALE_SUFFIX in self.files:
            return self._published(name, prefix, method, rows, cols, unit)
        if method == "none" or self.keep_float:
            return self.take(name, rows, cols, unit)
        if self.whole or cols is None:
            self.taken.add(name)
            part = self.files.read(name, None if self.whole else rows, unit=unit)
            return quantize(part.to(self.device), method)
        # A row-parallel rank's columns, scaled by their whole rows' amax (as at TP 1).
        self.taken.add(name)
        full = quantize(self.files.read(name).to(self.device), method)
        return full.columns(cols.start * unit, cols.stop * unit)

    def _published(self, name: str, prefix: str, method: str, rows: HeadRange | None, cols: HeadRange | None,
                   unit: int) -> Weight:
        """An FP8 checkpoint's projection with its own scales (a per-tensor scale spread over the
        channels); dequantized for ``none``, requantized for ``int8``."""
        self.taken.update([name, prefix + SCALE_SUFFIX] + [prefix + s for s in ACTIVATION_SCALE_SUFFIXES])
        if self.whole:
            rows = cols = None
        codes = self.files.read(name, rows, cols, unit)
        if codes.dtype != FP8:
            raise ValueError(f"{name}: {codes.dtype} weights with a weight_scale (float8_e4m3fn expected)")
        scale = self.files.read(prefix + SCALE_SUFFIX).float().flatten()
        if scale.numel() == 1:
            scale = scale.expand(codes.shape[0])
        elif rows is not None:
            scale = scale[rows.start * unit : rows.stop * unit]
        published = QuantLinear(codes.to(self.device).contiguous(), scale.to(self.device).contiguous())
        if method == "fp8":
            return published
        if method == "none" or cols is None:
            weight = published.dequantize(self.dtype)
            return weight if method == "none" else quantize(weight, method)
        whole = self.files.read(name)  # int8 from a row-parallel part: the whole rows' amax
        full = QuantLinear(whole.to(self.device), scale.to(self.device)).dequantize(torch.float32)
        return quantize(full, method).columns(cols.start * unit, cols.stop * unit)


def _load_layer(reader: _Reader, config: ModelConfig, shard: Shard, i: int) -> LayerWeights:
    head_dim = config.head_dim
    qh, kvh, inter = shard.q_heads(config), shard.kv_heads(config), shard.intermediate(config)
    p = layer_prefix(i)
    take, linear = reader.take, reader.linear
    q = linear(p + "self_attn.q_proj.weight", "qkv", qh, unit=head_dim)
    k = linear(p + "self_attn.k_proj.weight", "qkv", kvh, unit=head_dim)
    v = linear(p + "self_attn.v_proj.weight", "qkv", kvh, unit=head_dim)
    biases = [reader.maybe(p + f"self_attn.{n}_proj.bias", h, head_dim) for n, h in zip("qkv", (qh, kvh, kvh))]
    layer = LayerWeights(
        input_norm=take(p + "input_layernorm.weight"),
        qkv=fuse([q, k, v], reader.dtype),
        qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
        o=linear(p + "self_attn.o_proj.weight", "o", cols=qh, unit=head_dim),
        post_norm=take(p + "post_attention_layernorm.weight"),
        gate_up=None,
        down=None,
    )
    if config.qk_norm:
        layer.q_norm = take(p + "self_attn.q_norm.weight")
        layer.k_norm = take(p + "self_attn.k_norm.weight")
    if config.is_sparse(i):
        layer.experts = _load_experts(reader, config, i)
    else:
        names = dense_mlp_names(i)
        layer.gate_up = fuse([linear(names.gate, "gate_up", inter), linear(names.up, "gate_up", inter)], reader.dtype)
        layer.down = linear(names.down, "down", cols=inter)
    return layer


def _load_experts(reader: _Reader, config: ModelConfig, layer: int) -> ExpertWeights:
    """A sparse layer's router and experts, stacked (whole: a sparse model runs at TP 1)."""
    router = reader.take(router_name(config, layer))
    if reader.quantization != "none" or config.checkpoint_quantization is not None:
        gate_ups, downs = [], []
        for e in range(config.moe.num_experts):
            names = expert_names(config, layer, e)
            gate_ups.append(fuse([reader.linear(names.gate, "gate_up"), reader.linear(names.up, "gate_up")],
                                 reader.dtype))
            downs.append(reader.linear(names.down, "down"))
        return ExpertWeights(router=router, gate_up=stack(gate_ups, reader.dtype), down=stack(downs, reader.dtype))
    moe = config.moe
    inter, hidden = moe.intermediate_size, config.hidden_size
    gate_up = torch.empty((moe.num_experts, 2 * inter, hidden), dtype=reader.dtype, device=reader.device)
    down = torch.empty((moe.num_experts, hidden, inter), dtype=reader.dtype, device=reader.device)
    for e in range(moe.num_experts):
        names = expert_names(config, layer, e)
        gate_up[e, :inter] = reader.take(names.gate)
        gate_up[e, inter:] = reader.take(names.up)
        down[e] = reader.take(names.down)
    return ExpertWeights(router=router, gate_up=gate_up, down=down)
