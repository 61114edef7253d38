"""Llama-family inference over the token-level KV pool (GQA, RoPE, RMSNorm, SwiGLU; Qwen3's
per-head q/k norms and routed experts where the config has them).

Layer inference only: weights come from :mod:`pd_cluster.model.weights`, the math of each op
from :mod:`kernels` (Triton on CUDA, torch references elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

import kernels
from kernels.gemv import MAX_ROWS as FUSED_ROWS_LIMIT
from kernels.qkv_epilogue import QkvRotary
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.fp8_fused import (decode_attention_o_fp8, norm_gate_up_silu_down_fp8, norm_qkv_rotary_fp8,
                                        norm_then_linear, silu_then_linear)
from pd_cluster.model.forward_batch import ForwardBatch, PrefillPart
from pd_cluster.model.moe import routed_experts
from pd_cluster.model.prefill_sdpa import fresh_attention, fresh_spans, sdpa_applies
from pd_cluster.model.quant_linear import QuantLinear, linear, weight_args
from pd_cluster.model.shard import Shard
from pd_cluster.model.weights import LayerWeights, ModelWeights

#: Called after each layer's KV is stored, e.g. to start sending it to a decode node.
LayerHook = Callable[[int], None]
#: Sums a tensor in place over the ranks of a tensor-parallel node (row-parallel outputs).
AllReduce = Callable[[torch.Tensor], None]


class KVLayers(Protocol):
    """Where the model stores and reads KV: the engine's pool (:class:`pd_cluster.engine.kv_pool.KVPool`)."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key and value caches, ``[slots, kv_heads, head_dim]`` each."""
        ...

    @property
    def quant(self) -> str | None:
        """The quantized kind the caches hold (packed rows, :mod:`kernels.kv_quant`), or None."""
        ...


#: Rows up to which a decode step runs the fused projections (:mod:`kernels.gemv`), measured on
#: an H100: with the default model one row is 12% faster a step than the unfused ops, two rows
#: even, four rows slower (each row is another pass over the tile in every program, where a
#: GEMM's cost hardly grows); with an 8B shape one row's projections stream their weights
#: faster than cuBLAS does.
FUSED_ROWS = 1

#: The same for a model whose layers' inputs fit one block (hidden and intermediate sizes up to
#: 2048, as the default model's): a few rows tile as one does (:data:`kernels.gemv.ONE_BLOCK_ROWS`),
#: and such a model's step is bound by its launches, which the fused path halves.
FUSED_ROWS_SMALL = 4


def default_fused_rows(config: ModelConfig) -> int:
    """Rows up to which a decode step runs the fused projections: :data:`FUSED_ROWS_SMALL` for a
    model whose layer inputs fit one block, else :data:`FUSED_ROWS`."""
    small = max(config.hidden_size, config.intermediate_size) <= 2048
    return FUSED_ROWS_SMALL if small else FUSED_ROWS


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device,
                 fused_rows: int | None = None, shard: Shard | None = None,
                 all_reduce: AllReduce | None = None) -> None:
        """``fused_rows``: decode steps of at most this many rows fold each RMSNorm and the SiLU
        gate into the projection after them (fewer kernels); ``None``: :func:`default_fused_rows`.
        ``shard``: the part of the model ``weights`` hold (one rank of a tensor-parallel node, whose
        o and down outputs ``all_reduce`` sums over the ranks); None: the whole model."""
        self.config = config
        self.fused_rows = min(default_fused_rows(config) if fused_rows is None else fused_rows,
                              FUSED_ROWS_LIMIT)
        if config.qk_norm or config.moe is not None:
            # The fused kernels know no per-head norm and no experts: such models decode unfused.
            self.fused_rows = 0
        self.weights = weights
        self.device = device
        self.cos, self.sin = kernels.rotary_cos_sin(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device
        )
        self.sm_scale = config.head_dim**-0.5
        shard = shard or Shard()
        if not shard.whole and all_reduce is None:
            raise ValueError("a model shard needs an all-reduce over its node's ranks")
        self.shard = shard
        self._all_reduce = all_reduce if not shard.whole else None
        #: Heads of this rank (all of them on a whole model).
        self.num_heads = shard.q_heads(config).count
        self.num_kv_heads = shard.kv_heads(config).count
        self._q_size = self.num_heads * config.head_dim
        self._kv_size = self.num_kv_heads * config.head_dim

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the node's ranks (as is on a whole model)."""
        if self._all_reduce is not None:
            self._all_reduce(partial)
        return partial

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVLayers, layer_hook: LayerHook | None = None,
                float_logits: bool = True, embedded: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; store the new tokens' KV; return logits ``[K, vocab]``: float32, or in the
        model's dtype with ``float_logits=False`` (half the memory, for a caller that converts the
        rows it keeps). ``embedded``: the input ids' embeddings, already gathered (a captured
        step's first kernel does it with the step's other input writes)."""
        hidden = F.embedding(batch.input_ids, self.weights.embed) if embedded is None else embedded
        residual: torch.Tensor | None = None
        prefill = None if batch.is_decode else batch.prefill_part()
        # The fused projections store KV in the model dtype only.
        fused = batch.is_decode and batch.num_tokens <= self.fused_rows and kv.quant is None
        layer_fn = self._fused_layer if fused else self._layer
        for index, layer in enumerate(self.weights.layers):
            hidden, residual = layer_fn(index, layer, hidden, residual, batch, prefill, kv)
            if layer_hook is not None:
                layer_hook(index)
        if fused:
            logits, _ = kernels.norm_linear(hidden, residual, self.weights.final_norm, self.config.rms_norm_eps,
                                            self.weights.lm_head, rows=batch.logits_indices,
                                            out_dtype=torch.float32 if float_logits else None)
        else:
            rows = batch.logits_indices
            if batch.hidden_rows is not None:
                rows = torch.cat((rows, batch.hidden_rows))
            hidden = hidden[rows]
            residual = residual[rows] if residual is not None else None
            normed, _ = kernels.rms_norm(hidden, self.weights.final_norm, self.config.rms_norm_eps, residual)
            if batch.hidden_rows is not None:
                sampled = batch.logits_indices.shape[0]
                normed, batch.hidden_out = normed[:sampled], normed[sampled:]
            logits = F.linear(normed, self.weights.lm_head)
        return logits.float() if float_logits else logits

    def _layer(
        self,
        index: int,
        w: LayerWeights,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        prefill: PrefillPart | None,
        kv: KVLayers,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        k_cache, v_cache = kv.layer(index)
        done = None
        if prefill is None and w.q_norm is None and isinstance(w.qkv, QuantLinear):
            # A decode step: the FP8 GEMM, where it serves, ends in the rotary and the KV store.
            rotary = QkvRotary(batch.positions, self.cos, self.sin, self.num_heads, self.num_kv_heads, cfg.head_dim,
                               k_cache, v_cache, batch.out_slots)
            done = norm_qkv_rotary_fp8(hidden, residual, w.input_norm, cfg.rms_norm_eps, w.qkv, w.qkv_bias, rotary,
                                       kv.quant)
        if done is not None:
            q, residual = done
        else:
            qkv, residual = norm_then_linear(hidden, residual, w.input_norm, cfg.rms_norm_eps, w.qkv, w.qkv_bias)
            q = self._rotary_store(index, w, qkv, batch, kv)
        projected = None
        if prefill is None:
            projected = decode_attention_o_fp8(q, k_cache, v_cache, batch.slot_table, batch.ctx_lens, self.sm_scale,
                                               batch.table_rows, kv.quant, w.o)
        if projected is None:
            attn = self._attention(q, k_cache, v_cache, batch, prefill, kv.quant)
            projected = linear(attn.reshape(-1, self._q_size), w.o)
        hidden = self._reduce(projected)
        if w.experts is not None:
            x, residual = kernels.rms_norm(hidden, w.post_norm, cfg.rms_norm_eps, residual)
            return routed_experts(x, w.experts, cfg.moe), residual
        mlp = norm_gate_up_silu_down_fp8(hidden, residual, w.post_norm, cfg.rms_norm_eps, w.gate_up, w.down)
        if mlp is not None:
            return self._reduce(mlp[0]), mlp[1]
        gate_up, residual = norm_then_linear(hidden, residual, w.post_norm, cfg.rms_norm_eps, w.gate_up)
        return self._reduce(silu_then_linear(gate_up, w.down)), residual

    def _rotary_store(self, index: int, w: LayerWeights, qkv: torch.Tensor, batch: ForwardBatch,
                      kv: KVLayers) -> torch.Tensor:
        """The queries of the projected ``qkv``, rotated; the keys (rotated) and values stored."""
        cfg = self.config
        q, k, v = qkv.split((self._q_size, self._kv_size, self._kv_size), dim=-1)
        q = q.view(-1, self.num_heads, cfg.head_dim)
        k = k.view(-1, self.num_kv_heads, cfg.head_dim)
        v = v.view(-1, self.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q, k = self._head_norm(q, w.q_norm), self._head_norm(k, w.k_norm)
        k_cache, v_cache = kv.layer(index)
        return kernels.rotary_store_kv(q, k, v, batch.positions, self.cos, self.sin, k_cache, v_cache, batch.out_slots,
                                       kv.quant)

    def _head_norm(self, heads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head ``[T, H, D]`` over its ``D`` values (Qwen3's q_norm and k_norm), read
        from the strided view of the projection (no copy first)."""
        return kernels.head_rms_norm(heads, weight, self.config.rms_norm_eps)

    def _fused_layer(
        self,
        index: int,
        w: LayerWeights,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        prefill: PrefillPart | None,
        kv: KVLayers,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_layer` for a decode step of few rows: each norm folded into the projection after
        it, rotary embedding and the KV store into the qkv projection, the SiLU gate into the down
        projection (same math, four kernels fewer)."""
        cfg = self.config
        k_cache, v_cache = kv.layer(index)
        qkv_weight, qkv_scale = weight_args(w.qkv)
        q, residual = kernels.norm_qkv_rotary(hidden, residual, w.input_norm, cfg.rms_norm_eps, qkv_weight, w.qkv_bias,
                                              batch.positions, self.cos, self.sin, k_cache, v_cache, batch.out_slots,
                                              self.num_heads, self.num_kv_heads, weight_scale=qkv_scale)
        attn = self._attention(q, k_cache, v_cache, batch, prefill, None)
        hidden = self._reduce(kernels.linear(attn.reshape(-1, self._q_size), *weight_args(w.o)))
        gate_up_w, gate_up_scale = weight_args(w.gate_up)
        gate_up, residual = kernels.norm_linear(hidden, residual, w.post_norm, cfg.rms_norm_eps, gate_up_w,
                                                weight_scale=gate_up_scale)
        return self._reduce(kernels.silu_linear(gate_up, *weight_args(w.down))), residual

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                   prefill: PrefillPart | None, quant: str | None) -> torch.Tensor:
        """One-token rows through the split-K decode kernel, prefill chunks through the prefill
        kernel (which would walk a decode row's whole context in one program)."""
        rows = batch.table_rows
        if prefill is None:
            return kernels.decode_attention(q, k_cache, v_cache, batch.slot_table, batch.ctx_lens, self.sm_scale,
                                            table_rows=rows, quant=quant)
        nd = batch.num_decode
        out = torch.empty_like(q)
        if nd:
            kernels.decode_attention(q[:nd], k_cache, v_cache, batch.slot_table if rows is not None else
                                     batch.slot_table[:nd], batch.ctx_lens[:nd], self.sm_scale, out=out[:nd],
                                     table_rows=rows[:nd] if rows is not None else None, quant=quant)
        fresh = fresh_spans(batch.host_spans, nd)
        if fresh is not None and sdpa_applies(q, k_cache, quant):
            fresh_attention(q, k_cache, v_cache, batch.out_slots, fresh, self.sm_scale, out)
            return out
        kernels.context_attention(q[nd:], k_cache, v_cache, prefill.slot_table, prefill.ctx_lens, prefill.q_lens,
                                  prefill.q_start_loc, self.sm_scale, out=out[nd:], table_rows=prefill.table_rows,
                                  quant=quant)
        return out
