"""Hugging Face tensor names of each family's layers, as published checkpoints spell them."""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.model.config import ModelConfig


@dataclass(frozen=True)
class ExpertNames:
    """One expert's gate, up and down projections."""

    gate: str
    up: str
    down: str


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def router_name(config: ModelConfig, layer: int) -> str:
    """The router's ``[experts, hidden]`` matrix of a sparse layer."""
    block = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
    return f"{layer_prefix(layer)}{block}.gate.weight"


def expert_names(config: ModelConfig, layer: int, expert: int) -> ExpertNames:
    """Mixtral's experts are w1 (gate), w3 (up) and w2 (down); Qwen's are named as a dense MLP's."""
    if config.model_type == "mixtral":
        p = f"{layer_prefix(layer)}block_sparse_moe.experts.{expert}."
        return ExpertNames(p + "w1.weight", p + "w3.weight", p + "w2.weight")
    p = f"{layer_prefix(layer)}mlp.experts.{expert}."
    return ExpertNames(p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")


def dense_mlp_names(layer: int) -> ExpertNames:
    p = f"{layer_prefix(layer)}mlp."
    return ExpertNames(p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
