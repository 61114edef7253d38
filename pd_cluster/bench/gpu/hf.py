"""(c) transformers ``generate()`` on the engine's own weights, same batch and context as (a)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from pd_cluster.bench.gpu.plan import Plan
from pd_cluster.bench.gpu.timing import empty_cache, sync
from pd_cluster.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def hf_model(engine: LLMEngine, config_file: Path):
    """transformers' Llama on the engine's own weight tensors (views, no copies)."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(str(config_file))
    cfg.eos_token_id = None
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    w, mc = engine.model.weights, engine.model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim

    def put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))

    put(model.model.embed_tokens, "weight", w.embed)
    for layer, lw in zip(model.model.layers, w.layers):
        wq, wk, wv = lw.qkv.split((q, kv, kv))
        put(layer.self_attn.q_proj, "weight", wq)
        put(layer.self_attn.k_proj, "weight", wk)
        put(layer.self_attn.v_proj, "weight", wv)
        put(layer.self_attn.o_proj, "weight", lw.o)
        gate, up = lw.gate_up.chunk(2)
        put(layer.mlp.gate_proj, "weight", gate)
        put(layer.mlp.up_proj, "weight", up)
        put(layer.mlp.down_proj, "weight", lw.down)
        put(layer.input_layernorm, "weight", lw.input_norm)
        put(layer.post_attention_layernorm, "weight", lw.post_norm)
    put(model.model.norm, "weight", w.final_norm)
    put(model.lm_head, "weight", w.lm_head)
    # Its inverse frequencies are buffers made at construction: rebuild it off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(engine.device)
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not leftovers, f"unassigned tensors: {leftovers[:3]}"
    return model.eval()


def measure_hf(engine: LLMEngine, plan: Plan, config_file: Path, ours: dict) -> dict:
    """Decode step of ``generate()`` = (time of 1 + k new tokens - time of 1) / k, same batch and context."""
    model = hf_model(engine, config_file)
    vocab, device = engine.model_config.vocab_size, engine.device
    out: dict[str, Any] = {"new_tokens": plan.hf_new_tokens, "context": plan.decode_ctx}
    generate_ms(model, torch.randint(3, vocab, (2, 16), device=device), 2)  # warm-up: handles, allocator
    for batch in plan.hf_batches:
        ids = torch.randint(3, vocab, (batch, plan.decode_ctx), device=device)
        one = generate_ms(model, ids, 1)
        more = generate_ms(model, ids, 1 + plan.hf_new_tokens)
        step_ms = (more - one) / plan.hf_new_tokens
        row = {"step_ms": step_ms, "prefill_ms": one, "tokens_per_s": batch / step_ms * 1e3}
        mine = ours.get(f"b{batch}")
        if mine:
            row["our_step_ms"] = mine["step_ms"]
            row["speedup"] = step_ms / mine["step_ms"]
        out[f"b{batch}"] = row
        logger.info("transformers b%d: %.2f ms/step", batch, step_ms)
    del model
    empty_cache()
    return out


def generate_ms(model, ids: torch.Tensor, k: int) -> float:
    """Wall milliseconds of a greedy ``generate()`` of exactly ``k`` new tokens after ``ids``."""
    device = ids.device
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        result = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                                do_sample=False, pad_token_id=0)
    sync(device)
    assert result.shape[1] == ids.shape[1] + k
    return (time.perf_counter() - start) * 1e3
