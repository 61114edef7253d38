"""Long fresh prompts' attention through torch's scaled-dot-product attention on cuDNN.

A prompt with no cached prefix attends only to its own new keys, which an eager step has just
stored at its ``out_slots``: gathered into one contiguous tensor, they are a plain causal
attention, which cuDNN's fused kernel runs at about 1.9x our Triton kernel's rate on an H200
(4096 tokens, 32 q / 8 kv heads of 128: 0.29 against 0.55 ms a layer). Everything else (prefix
hits, short chunks, quantized KV, CUDA graph captures, CPUs) stays on :mod:`kernels.attention`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

#: Fewest new tokens of a fresh prompt that take cuDNN: below them the gathers and launches weigh
#: more than the kernel's gain.
MIN_TOKENS = 512


def fresh_spans(host_spans: list[tuple[int, int, int]] | None, num_decode: int) -> list[tuple[int, int]] | None:
    """``(q_start, q_len)`` of the prefill sequences when every one is a fresh prompt of at least
    :data:`MIN_TOKENS` new tokens (its context is its new tokens); else None."""
    if not host_spans or len(host_spans) <= num_decode:
        return None
    spans = host_spans[num_decode:]
    if any(ctx != q_len or q_len < MIN_TOKENS for _, q_len, ctx in spans):
        return None
    return [(start, q_len) for start, q_len, _ in spans]


def sdpa_applies(q: torch.Tensor, k_cache: torch.Tensor, quant: str | None) -> bool:
    """A CUDA step outside a graph capture over 16-bit KV of q's dtype."""
    return (q.is_cuda and quant is None and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and not torch.cuda.is_current_stream_capturing())


def fresh_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_slots: torch.Tensor,
                    spans: list[tuple[int, int]], sm_scale: float, out: torch.Tensor) -> None:
    """Causal attention of each fresh prompt ``(start, length)`` (rows of ``q`` ``[T, H, D]``) over
    its own keys and values at ``out_slots[start:start + length]``, written into ``out``'s rows."""
    heads = q.shape[1]
    for start, length in spans:
        slots = out_slots[start:start + length]
        group = heads // k_cache.shape[1]
        # cuDNN takes as many key heads as query heads: each kv head repeated for its group.
        k = k_cache.index_select(0, slots).repeat_interleave(group, dim=1)
        v = v_cache.index_select(0, slots).repeat_interleave(group, dim=1)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q[start:start + length].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=sm_scale)
        out[start:start + length] = o[0].transpose(0, 1)
