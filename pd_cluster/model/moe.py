"""Routed experts of a mixture-of-experts MLP (Mixtral, Qwen3-MoE).

Each token's router picks its ``top_k`` experts by softmax probability (over every expert, in
float32, as transformers does), weighted by those probabilities, renormalized over the chosen
ones where the config says so. The (token, expert) pairs are sorted by expert, so each expert
runs one GEMM over all of its tokens and the outputs are added back to their tokens in expert
order (transformers' order of summation). The per-expert loop reads each expert's token count
on the host, so a sparse step is not captured in a CUDA graph: that torch reference serves the
CPU, and CUDA tensors take the grouped GEMMs of :mod:`kernels.fused_moe` (no host reads, so
sparse decode steps replay CUDA graphs). The experts' projections may hold 8-bit weights
(:mod:`pd_cluster.model.quant_linear`); the router stays in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels._triton import use_triton
from kernels.fused_moe import fused_moe_triton
from kernels.moe_route import route_topk_ref, route_topk_triton
from pd_cluster.model.config import MoEConfig
from pd_cluster.model.quant_linear import linear
from pd_cluster.model.weights import ExpertWeights


def route(x: torch.Tensor, router: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts ``[T, top_k]`` and their weights (in ``x``'s dtype); the
    softmax and top-k in one kernel where :func:`fused_available`."""
    logits = F.linear(x, router)
    pick = route_topk_triton if fused_available(logits) else route_topk_ref
    return pick(logits, moe.top_k, moe.norm_topk_prob, x.dtype)


def fused_available(x: torch.Tensor) -> bool:
    """Whether :func:`routed_experts` runs the fused kernels on ``x`` (CUDA tensors with Triton)."""
    return use_triton(x)


def routed_experts(x: torch.Tensor, w: ExpertWeights, moe: MoEConfig, fused: bool | None = None) -> torch.Tensor:
    """The sparse MLP's output ``[T, hidden]`` for normed hidden states ``x`` ``[T, hidden]``;
    ``fused`` None: the fused kernels where :func:`fused_available`, else the reference."""
    experts, weights = route(x, w.router, moe)
    if fused if fused is not None else fused_available(x):
        return fused_moe_triton(x, w.gate_up, w.down, experts, weights, moe.num_experts)
    return routed_experts_ref(x, w, moe, experts, weights)


def routed_experts_ref(x: torch.Tensor, w: ExpertWeights, moe: MoEConfig, experts: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """The torch reference over routed pairs: one GEMM an expert, counts read on the host."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = order // moe.top_k
    weight_of = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        tokens, gates = token_of[start:start + count], weight_of[start:start + count]
        start += count
        hidden = kernels.silu_mul(linear(x[tokens], w.gate_up[expert]))
        out.index_add_(0, tokens, linear(hidden, w.down[expert]) * gates[:, None])
    return out
