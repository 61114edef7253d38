"""What the master knows about the cluster's model before any node joins."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """The model's name (as nodes announce it), the KV shape every node must share, and the
    sampling defaults of its generation_config.json (:mod:`pd_cluster.generation_defaults`)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    sampling_defaults: dict[str, float | int] = field(default_factory=dict, compare=False)


def read_model_info(path: Path) -> ModelInfo:
    """Read config.json the way the nodes do, so names and shapes agree by construction."""
    from pd_cluster.generation_defaults import generation_defaults
    from pd_cluster.model.config import ModelConfig

    config = ModelConfig.from_path(path)
    return ModelInfo(
        name=config.name,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_model_len=config.max_position_embeddings,
        sampling_defaults=generation_defaults(path),
    )
