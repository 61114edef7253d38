"""Rotary position embedding (rotate-half layout, as Llama checkpoints in HF format use)."""

from __future__ import annotations

import math

import torch


def rotary_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3's frequency-dependent scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def rotary_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``cos, sin`` of shape ``[max_positions, head_dim]`` in float32."""
    inv_freq = rotary_inv_freq(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their positions ``[T]``.

    Returns new tensors of the input dtype; the math runs in float32.
    """
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    qf, kf = q.float(), k.float()
    q_out = qf * c + _rotate_half(qf) * s
    k_out = kf * c + _rotate_half(kf) * s
    return q_out.to(q.dtype), k_out.to(k.dtype)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_ref(q, k, positions, cos, sin)
