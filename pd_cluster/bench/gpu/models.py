"""Engines on random weights made on the GPU from a shape's ``config.json``: nothing is downloaded
or written but the config. (``pd_cluster.bench.random_model`` writes a whole model directory to
disk instead, for commands that take ``--model DIR``.)"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine import llm_engine
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.quant_linear import Weight, quantize
from pd_cluster.model.weights import ExpertWeights, LayerWeights, ModelWeights, load_weights


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   quantization: str = "none") -> ModelWeights:
    """Llama weights of ``cfg``'s shape (routed experts in its sparse layers), N(0, 0.02) like a fresh Hugging Face model, made on the device;
    ``quantization`` int8 / fp8: the projections quantized per output channel as the loader does,
    a layer at a time (the same values as the unquantized model's, to the format's precision)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    def projection(*shape: int) -> Weight:
        weight = normal(*shape)
        return weight if quantization == "none" else quantize(weight, quantization)

    def experts() -> ExpertWeights:
        e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
        return ExpertWeights(router=normal(e, h), gate_up=projection(e, 2 * inter, h), down=projection(e, h, inter))

    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [
        LayerWeights(
            input_norm=ones(h),
            qkv=projection(q + 2 * kv, h),
            qkv_bias=torch.zeros(q + 2 * kv, dtype=dtype, device=device) if cfg.attention_bias else None,
            o=projection(h, q),
            post_norm=ones(h),
            gate_up=None if cfg.is_sparse(layer) else projection(2 * inter, h),
            down=None if cfg.is_sparse(layer) else projection(h, inter),
            q_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            experts=experts() if cfg.is_sparse(layer) else None,
        )
        for layer in range(cfg.num_layers)
    ]
    embed = normal(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)


@contextlib.contextmanager
def random_model(config_file: Path, seed: int = 0) -> Iterator[str]:
    """A model directory holding only ``config.json``; engines built inside get random weights."""
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        shutil.copy(config_file, Path(tmp) / "config.json")

        def load(path, config: ModelConfig, dtype: torch.dtype, device, shard=None,
                 load_format: str = "safetensors", quantization: str = "none") -> ModelWeights:
            if load_format == "dummy":  # an engine of any TP (its other ranks make theirs alike)
                return load_weights(path, config, dtype, device, shard, load_format, quantization)
            if shard is not None and not shard.whole:
                raise NotImplementedError("random in-memory weights are whole: use load_format dummy for TP > 1")
            return random_weights(config, dtype, torch.device(device), seed, quantization)

        with mock.patch.object(llm_engine, "load_weights", load):
            yield tmp


class BlankTokenizer:
    """Random weights have no vocabulary: every token decodes to "" (the detokenizer still runs)."""

    eos_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""


def build_engine(config_file: Path, device: str, seed: int = 0, **options: Any) -> LLMEngine:
    """An engine on random weights of ``config_file``'s shape. A prompt within the step budget is
    prefilled in one step (unless ``prefill_chunk_tokens`` says otherwise): the keys time whole
    prompts' steps, not the graph-sized chunks a node's defaults take."""
    if "max_num_batched_tokens" in options:
        options.setdefault("prefill_chunk_tokens", options["max_num_batched_tokens"])
    with random_model(config_file, seed) as path:
        return LLMEngine(EngineConfig(model=path, device=device, **{"dtype": "bfloat16", **options}),
                         tokenizer=BlankTokenizer())


def random_prompt(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()
