"""A mixture-of-experts router's choice: each token's ``top_k`` experts by softmax probability
and their weights, in one launch.

torch's path takes a softmax, a top-k (a sort per row), a sum, a division and a cast: five
launches, the top-k the slowest of them at a prompt's thousands of rows. Here a program takes a
block of tokens, their probabilities in float32 and the ``top_k`` largest by repeated maxima (the
lowest expert index first among equal probabilities), largest first as ``torch.topk`` gives them.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, next_pow2, require_triton, tl, triton


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[T, E]`` -> (experts ``[T, top_k]`` int64, weights ``[T, top_k]`` in ``dtype``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(dtype)


@triton.jit
def _route_topk_kernel(logits_ptr, experts_ptr, weights_ptr, num_tokens, num_experts, stride_l,
                       TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, E_BLOCK)
    tmask = t < num_tokens
    t64 = t.to(tl.int64)
    mask = tmask[:, None] & (e < num_experts)[None, :]
    x = tl.load(logits_ptr + t64[:, None] * stride_l + e[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=1)[:, None]
    p = tl.exp(x)
    probs = p / tl.sum(p, axis=1)[:, None]
    probs = tl.where(mask, probs, -1.0)
    k = tl.arange(0, K_BLOCK)
    top_w = tl.zeros((ROWS, K_BLOCK), dtype=tl.float32)
    top_e = tl.zeros((ROWS, K_BLOCK), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # The lowest expert index holding the maximum.
        idx = tl.min(tl.where(probs == best[:, None], e[None, :], E_BLOCK), axis=1)
        top_w = tl.where(k[None, :] == i, best[:, None], top_w)
        top_e = tl.where(k[None, :] == i, idx[:, None], top_e)
        probs = tl.where(e[None, :] == idx[:, None], -2.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(k[None, :] < TOP_K, top_w, 0.0), axis=1)[:, None]
    out = t64[:, None] * TOP_K + k[None, :]
    omask = tmask[:, None] & (k < TOP_K)[None, :]
    tl.store(experts_ptr + out, top_e.to(tl.int64), mask=omask)
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=omask)


def route_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_topk_ref` in one launch (``logits``: any float dtype, rows contiguous)."""
    require_triton()
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top {top_k} of {num_experts} experts")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    experts = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    if tokens == 0:
        return experts, weights
    e_block = next_pow2(max(num_experts, 16))
    rows = max(1, min(64, 4096 // e_block))
    _route_topk_kernel[(cdiv(tokens, rows),)](
        logits, experts, weights, tokens, num_experts, logits.stride(0), TOP_K=top_k, K_BLOCK=next_pow2(top_k),
        E_BLOCK=e_block, ROWS=rows, RENORMALIZE=renormalize, num_warps=4)
    return experts, weights
