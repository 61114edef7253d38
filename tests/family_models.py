"""Tiny random-weight models of each supported family, written by transformers itself.

Each is saved with ``save_pretrained(safe_serialization=True, max_shard_size=...)`` (sharded
safetensors with the index) next to the default model's tokenizer, so the engine and
``pd-cluster local --model DIR`` load them as they load a published checkpoint. Vocabulary rows
past the tokenizer's keep a zero output row (never the argmax): every greedy token decodes to
text, so answers through the master compare as text.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: The default model's tokenizer vocabulary.
TOKENIZER_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=TOKENIZER_VOCAB)


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    fields: dict = field(default_factory=dict)


FAMILIES = {
    # head_dim 32 where hidden / heads is 16; tied embeddings as Qwen3's small models; yarn rope
    # as Qwen3's long-context setting.
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 1000000.0})),
    # Layer 1 dense (mlp_only_layers), experts' probabilities not renormalized (norm_topk_prob false).
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, decoder_sparse_step=1,
        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # Llama 3.1 as published: a 128,256-token vocabulary, llama3 rope scaling, untied head.
    "llama3": Family("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
}


def write_family_model(family: str, out: Path, default_model_dir: Path, seed: int = 0, embed_scale: float = 1.0):
    """Write ``family``'s tiny model into ``out`` (sharded); returns transformers' model (float32, eval).
    ``embed_scale``: larger embeddings than a fresh init, for clear top-1 margins (no float32
    rounding of another device's kernels flips them)."""
    import transformers

    spec = FAMILIES[family]
    config = getattr(transformers, spec.config_class)(**{**_COMMON, **spec.fields})
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).eval()
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
        head[TOKENIZER_VOCAB:] = 0
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4MB")
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    return model


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS neither stopping nor masked."""
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
                             pad_token_id=0)
    return ids[0, len(prompt):].tolist()
