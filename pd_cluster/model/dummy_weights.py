"""Seeded random weights in place of a model's files (``--load-format dummy``).

A model of a large shape (70B) is served for benchmarks from a directory holding only its
``config.json`` and tokenizer, rather than from 140 GB of random safetensors written first. Each
value is a hash of the seed, the tensor's name and the value's index in the whole Hugging Face
tensor, so a rank makes only its own slices, directly on its device, and they equal the slices of
the whole model's: every rank of every node of any TP holds the same model. Matrices are uniform
with a standard deviation of 0.02 (as a fresh Hugging Face model's normal init, which keeps bf16
activations finite), norms are ones and biases zeros.
"""

from __future__ import annotations

import zlib

import torch

from pd_cluster.model.config import ModelConfig
from pd_cluster.model.hf_names import dense_mlp_names, expert_names, layer_prefix, router_name
from pd_cluster.model.shard import HeadRange

#: The seed every node uses, so that a prefill node's KV and first token are the decode node's.
DUMMY_SEED = 0
#: Half-width of the uniform values: a standard deviation of 0.02.
HALF_WIDTH = 0.02 * 3**0.5
_MASK32 = 0xFFFFFFFF
#: Rows made at once: bounds the int64 scratch of one tensor's hashes.
_CHUNK_VALUES = 1 << 26


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a model of ``config``'s shape."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = layer_prefix(i)
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        })
        shapes.update(_mlp_shapes(config, i))
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The MLP's tensors of one layer: dense, or the router and every expert's."""
    h = config.hidden_size
    if not config.is_sparse(layer):
        names, inter = [dense_mlp_names(layer)], config.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {}
    else:
        moe = config.moe
        names, inter = [expert_names(config, layer, e) for e in range(moe.num_experts)], moe.intermediate_size
        shapes = {router_name(config, layer): (moe.num_experts, h)}
    for n in names:
        shapes.update({n.gate: (inter, h), n.up: (inter, h), n.down: (h, inter)})
    return shapes


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of each value of ``x`` (int64 holding values below 2**32)."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


class DummyTensors:
    """The tensors of ``config``'s shape by name, as :class:`pd_cluster.model.weights.TensorFiles`
    reads them from files, made on ``device`` from their indices (see the module's docstring)."""

    def __init__(self, config: ModelConfig, device: torch.device | str, seed: int = DUMMY_SEED) -> None:
        self.shapes = hf_tensor_shapes(config)
        self.device = torch.device(device)
        self.seed = seed
        self.path = f"dummy weights (seed {seed})"

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str, rows: HeadRange | None = None, cols: HeadRange | None = None,
             unit: int = 1) -> torch.Tensor:
        """Tensor ``name``, or its rows / columns ``[start*unit, stop*unit)``, in float32."""
        try:
            shape = self.shapes[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is not in the model's shape") from None
        if len(shape) == 1:  # norms are ones, biases zeros
            fill = torch.ones if name.endswith("norm.weight") else torch.zeros
            return fill(len(self._span(rows, unit, shape[0])), device=self.device)
        r, c = self._span(rows, unit, shape[0]), self._span(cols, unit, shape[1])
        return self._values(name, r, c, shape[1])

    @staticmethod
    def _span(heads: HeadRange | None, unit: int, size: int) -> range:
        return range(0, size) if heads is None else range(heads.start * unit, heads.stop * unit)

    def _values(self, name: str, rows: range, cols: range, width: int) -> torch.Tensor:
        """Uniform values of rows ``rows`` and columns ``cols`` of a matrix ``width`` columns wide."""
        base = zlib.crc32(f"{self.seed}:{name}".encode())
        out = torch.empty((len(rows), len(cols)), dtype=torch.float32, device=self.device)
        col_index = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=self.device)
        step = max(1, _CHUNK_VALUES // max(1, len(cols)))
        for first in range(0, len(rows), step):
            row_index = torch.arange(rows.start + first, min(rows.stop, rows.start + first + step), dtype=torch.int64,
                                     device=self.device)
            index = row_index[:, None] * width + col_index[None, :]
            bits = _hash32(_hash32(index & _MASK32) ^ base)
            out[first:first + len(row_index)] = (bits.float() * (2.0 / 2**32) - 1.0) * HALF_WIDTH
        return out
