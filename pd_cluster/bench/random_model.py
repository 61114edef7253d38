"""Write a random-weight model directory that any command takes as ``--model DIR``.

GPU benchmarks and GPU end-to-end tests need a model of a real shape (Llama-3-8B) on disk, as
users give one, without downloading it: the weights are N(0, 0.02) like a fresh Hugging Face
model, in Hugging Face tensor names and safetensors shards, and the tokenizer (with its chat
template) is copied from a real small model, by default the converted default model. Token ids
beyond the tokenizer's vocabulary would decode to nothing, so by default the vocabulary is the
tokenizer's (for the Llama-3-8B shape: 49,152 rows instead of 128,256, 15.4 GB of bf16 weights
instead of 16.06 GB).

A random model's greedy answers are arbitrary tokens, whose text does not encode back to the
ids it generated, so a conversation's next turn would miss its last answer in every prefix cache,
which a real model's chats seldom do. With ``--answers words`` the output head's rows are zero
for every token but the whole-word ones (:mod:`pd_cluster.bench.words`): every other logit is 0
while the largest word logit is well above it, so greedy answers are words that encode back to
the ids generated (the compute per token is unchanged). With tied embeddings the same rows of the
embedding are zero too.

    python -m pd_cluster.bench.random_model --shape llama3-8b --out /tmp/llama3-8b-random

Shapes (:data:`SHAPES`) carry their published config.json as is: Llama-3 8B and 70B, Qwen3-8B,
Qwen3-30B-A3B (128 experts, 8 a token) and Mixtral-8x7B (8 experts, 2 a token), and small ones.

With ``--config-only`` the directory holds the config and tokenizer and no weights: engines load
it with ``--load-format dummy`` (:mod:`pd_cluster.model.dummy_weights`), each rank making its own
shards on its GPU, which is how a 70B shape is served without writing 140 GB first.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from importlib import resources
from pathlib import Path

import torch

from pd_cluster.model.checkpoint_writer import CheckpointWriter
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.dummy_weights import hf_tensor_shapes

logger = logging.getLogger(__name__)

#: Shapes shipped as package data (pd_cluster/bench/configs/<name>.json).
SHAPES = ("llama3-8b", "llama3-70b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "smollm2-135m", "tiny", "tiny-kv4",
          "tiny-head128")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def shape_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"shape: {shape!r}; expected one of {SHAPES}")
    return json.loads(resources.files("pd_cluster.bench").joinpath(f"configs/{shape}.json").read_text())


def write_random_model(
    shape: str, out_dir: Path, tokenizer_dir: Path | None = None, *, dtype: str = "bfloat16", seed: int = 0,
    device: str | None = None, vocab: str = "tokenizer", answers: str = "any", config_only: bool = False,
) -> Path:
    """Write config, safetensors shards and tokenizer files into ``out_dir``; returns it.
    ``config_only``: no weights (served with ``--load-format dummy``; ``answers`` does not apply)."""
    cfg = shape_config(shape)
    if tokenizer_dir is None:
        from pd_cluster.default_model import default_model_path

        tokenizer_dir = default_model_path()
    torch_dtype = getattr(torch, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    # The tokenizer's special tokens stand in for the shape's own (they decode and stop generation).
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tokenizer_cfg:
            cfg[key] = tokenizer_cfg[key]
    # Every prompt token must be a valid id, so a shape smaller than the tokenizer grows its
    # vocabulary; with ``vocab="tokenizer"`` a larger one shrinks to it too, so that every sampled
    # id decodes to text and streamed timings (which count chunks with text) stay exact.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer_vocab = len(tokenizer)
    if vocab == "tokenizer":
        cfg["vocab_size"] = tokenizer_vocab
    elif vocab == "shape":
        cfg["vocab_size"] = max(cfg["vocab_size"], tokenizer_vocab)
    else:
        raise ValueError(f"vocab: {vocab!r}; expected 'tokenizer' or 'shape'")
    if answers not in ("any", "words"):
        raise ValueError(f"answers: {answers!r}; expected 'any' or 'words'")
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings", False) else "lm_head.weight"
    silent_rows = None
    if answers == "words":
        from pd_cluster.bench.words import whole_word_ids

        silent_rows = torch.ones(cfg["vocab_size"], dtype=torch.bool)
        silent_rows[whole_word_ids(tokenizer)] = False
    cfg["_name_or_path"] = out_dir.name
    cfg["torch_dtype"] = dtype
    if config_only:
        _write_config_and_tokenizer(cfg, out_dir, tokenizer_dir)
        logger.info("%s config (no weights: --load-format dummy) in %s", shape, out_dir)
        return out_dir

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    writer = CheckpointWriter(out_dir)
    for name, tensor_shape in hf_tensor_shapes(ModelConfig.from_dict(cfg, name=out_dir.name)).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(tensor_shape, dtype=torch_dtype)
        else:
            tensor = torch.empty(tensor_shape, dtype=torch_dtype, device=device).normal_(0.0, 0.02, generator=gen).cpu()
            if name == head and silent_rows is not None:
                tensor[silent_rows] = 0
        writer.add(name, tensor)
    total = writer.close()
    _write_config_and_tokenizer(cfg, out_dir, tokenizer_dir)
    logger.info("random %s model (%.2f GB of %s weights) in %s", shape, total / 1e9, dtype, out_dir)
    return out_dir


def _write_config_and_tokenizer(cfg: dict, out_dir: Path, tokenizer_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=SHAPES)
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory with tokenizer files (default: the converted default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", default="tokenizer", choices=["tokenizer", "shape"],
                        help="vocabulary size: the tokenizer's (every id decodes) or the shape's own")
    parser.add_argument("--answers", default="any", choices=["any", "words"],
                        help="any: the head is all random; words: greedy answers are whole words that encode back "
                             "to the ids generated, as a real model's mostly do")
    parser.add_argument("--config-only", action="store_true",
                        help="write the config and tokenizer only, no weights: serve it with --load-format dummy")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_random_model(args.shape, args.out, args.tokenizer, dtype=args.dtype, seed=args.seed, vocab=args.vocab,
                       answers=args.answers, config_only=args.config_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
