"""What an engine settles before its step loop exists: the ids that end a generation, the settings
a tensor-parallel or mixture-of-experts model changes, and the KV pool's size where none is given."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kernels._triton import HAS_TRITON
from pd_cluster.config import EngineConfig
from pd_cluster.kv_spec import KVSpec
from pd_cluster.model.config import ModelConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384
#: Activations and CUDA graphs, kept out of the KV pool (an 8B-shape engine's 39 step graphs take
#: about 270 MiB, a 2048-token eager prefill about 300 MiB more).
GPU_HEADROOM_BYTES = 768 * 2**20
#: More of it for the side stream's prefill graphs (their own buffers and memory pool).
SIDE_GRAPHS_HEADROOM_BYTES = 256 * 2**20
#: The fewest KV slots a GPU engine sizes itself to, however little memory is free.
MIN_GPU_KV_TOKENS = 1024


def eos_token_ids(model_config: ModelConfig, tokenizer, path: Path) -> set[int]:
    """Every id that ends a generation: the model config's, the generation config's and the
    tokenizer's (checkpoints disagree on which of them carries it)."""
    ids = set(model_config.eos_token_ids)
    generation = path / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def tp_config(config: EngineConfig) -> EngineConfig:
    """A tensor-parallel node's settings: no side prefills (a second stream's steps beside the
    main one would need every rank to run both in the same order). CUDA graphs and the overlap
    schedule stay: every rank replays the graph rank 0 plans, and the plan goes out before the
    forward (the ids a step reads on the device follow it over the model group)."""
    if config.side_prefill_max_tokens:
        logger.info("tp %d: side prefills off (a tensor-parallel node runs one stream of steps)", config.tp)
    return config.model_copy(update={"side_prefill_max_tokens": 0})


def sparse_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """A mixture-of-experts model's settings: CUDA graphs only where the fused experts run (the
    torch reference reads each expert's token count on the host, which a captured step cannot)."""
    if not config.cuda_graphs or (device.type == "cuda" and HAS_TRITON):
        return config
    logger.info("mixture-of-experts model without the fused experts: CUDA graphs off (steps run eagerly)")
    return config.model_copy(update={"cuda_graphs": False})


def default_kv_tokens(config: EngineConfig, device: torch.device, rank_kv_spec: KVSpec) -> int:
    """KV slots when none are configured. With ``gpu_memory_fraction`` (engines sharing a GPU) the
    pool is that share of the GPU's total memory less what this process already holds (its
    weights) and the headroom, capped by what is free; otherwise a fraction of the free memory."""
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    headroom = GPU_HEADROOM_BYTES
    if config.cuda_graphs and config.side_prefill_max_tokens > 0:
        headroom += SIDE_GRAPHS_HEADROOM_BYTES
    fraction = config.gpu_memory_fraction
    if fraction is None:
        budget = int(free * config.kv_memory_fraction) - headroom
    else:
        # Reserved, not just allocated: the allocator's cached blocks are this process's too.
        held = torch.cuda.memory_reserved(device)
        budget = min(int(fraction * total) - held, free) - headroom
    # Each rank sizes its pool for its own heads: the budget is one GPU's, like every rank's.
    return max(budget // rank_kv_spec.pool_bytes_per_token, MIN_GPU_KV_TOKENS)
