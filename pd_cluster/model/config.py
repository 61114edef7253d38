"""The model hyper-parameters the engine needs, read from a Hugging Face config.json.

Anything a config asks for that the engine does not compute (an activation, a rope type, a
quantization other than the FP8 checkpoints of :mod:`pd_cluster.model.checkpoint_quant`) is
refused here with the field's name: a model that loads answers as transformers does, never
silently otherwise.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from kernels.rotary import ROPE_TYPES, rope_type
from pd_cluster.model.checkpoint_quant import checkpoint_quantization

logger = logging.getLogger(__name__)

#: Families whose layers are Llama's (RMSNorm, GQA, rotary, SwiGLU), with what each adds.
DENSE_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_FAMILIES = {"mixtral", "qwen3_moe"}
SUPPORTED_ARCHITECTURES = DENSE_FAMILIES | MOE_FAMILIES
#: Families that RMS-normalize each query and key head before rotary (Qwen3's q_norm/k_norm).
QK_NORM_FAMILIES = {"qwen3", "qwen3_moe"}
#: Families whose q/k/v projections have a bias unless the config says otherwise.
QKV_BIAS_FAMILIES = {"qwen2"}
#: Keys each rope type needs besides its factor.
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
                 "yarn": ("original_max_position_embeddings",)}


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a mixture-of-experts MLP: each token goes to the ``top_k`` experts of
    the largest softmax router probabilities, weighted by them (renormalized over the ``top_k``
    when ``norm_topk_prob``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    #: The layers whose MLP is the experts' (the others are dense, of ``ModelConfig.intermediate_size``).
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    #: Each query and key head RMS-normalized (weights of head_dim) before rotary.
    qk_norm: bool = False
    moe: MoEConfig | None = None
    #: The ``quant_method`` of an FP8 checkpoint (:mod:`pd_cluster.model.checkpoint_quant`).
    checkpoint_quantization: str | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def from_dict(cls, raw: dict, name: str) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})")
        _refuse_unsupported(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_layers = int(raw["num_hidden_layers"])
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_context_limit(raw, model_type),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type in QKV_BIAS_FAMILIES)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            qk_norm=model_type in QK_NORM_FAMILIES,
            moe=_moe(raw, model_type, num_layers),
            checkpoint_quantization=checkpoint_quantization(raw.get("quantization_config")),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        name = raw.get("_name_or_path") or path.name
        if "/" in str(name) or not name:
            name = path.name
        return cls.from_dict(raw, name=str(name))


def _refuse_unsupported(raw: dict) -> None:
    """Raise ValueError naming the first field that asks for math the engine does not do."""
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (the engine's MLPs are SiLU-gated)")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias true is not supported (the engine's MLP projections have no bias)")


def _rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict (None for plain rotary), checked: an unknown type or a
    missing key names the field."""
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta/rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if rope_type(params) != "default" else None)
    if scaling is None:
        return theta, None
    kind = rope_type(scaling)
    field_name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{field_name}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    missing = [key for key in ROPE_REQUIRED.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{field_name}: rope type {kind!r} needs {', '.join(missing)}")
    partial = float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
    return theta, (None if kind == "default" else dict(scaling))


def _context_limit(raw: dict, model_type: str) -> int:
    """max_position_embeddings, or the sliding window where attention slides: up to the window
    sliding attention is full attention, so a context capped there is served exactly."""
    limit = int(raw.get("max_position_embeddings", 4096))
    window = raw.get("sliding_window")
    slides = raw.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    if slides and window and int(window) < limit:
        logger.info("sliding_window %d: the context is capped at the window (full attention up to it)", window)
        return int(window)
    return limit


def _moe(raw: dict, model_type: str, num_layers: int) -> MoEConfig | None:
    """The routed experts of a Mixtral or Qwen3-MoE config (None for a dense family)."""
    if model_type not in MOE_FAMILIES:
        return None
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not experts:
        raise ValueError(f"{model_type}: num_experts (num_local_experts) is missing")
    if model_type == "mixtral":
        sparse = frozenset(range(num_layers))
        return MoEConfig(int(experts), int(raw.get("num_experts_per_tok", 2)), int(raw["intermediate_size"]),
                         True, sparse)
    step = int(raw.get("decoder_sparse_step", 1))
    dense_layers = set(raw.get("mlp_only_layers") or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step} must be at least 1")
    sparse = frozenset(i for i in range(num_layers) if i not in dense_layers and (i + 1) % step == 0)
    if raw.get("shared_expert_intermediate_size"):
        raise ValueError(f"shared_expert_intermediate_size is not supported for {model_type}")
    return MoEConfig(int(experts), int(raw.get("num_experts_per_tok", 8)), int(raw["moe_intermediate_size"]),
                     bool(raw.get("norm_topk_prob", False)), sparse)
