"""Model directories' tokenizers: loaded without AutoTokenizer's registry where that gives the same
tokenizer, through AutoTokenizer everywhere else."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pd_cluster import tokenizer as tokenizer_module
from pd_cluster.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and Straße 東京 😀\n\n", "<|im_start|>user\nhi<|im_end|>", "", "x" * 300,
         "<|endoftext|> a literal end"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "<|im_end|> again"}]]


def test_the_default_model_loads_the_tokenizer_auto_tokenizer_gives(default_model_dir, tokenizer):
    mine = load_tokenizer(default_model_dir)
    assert type(mine) is type(tokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert mine(text, add_special_tokens=special).input_ids == tokenizer(text, add_special_tokens=special).input_ids
    for chat in CHATS:
        assert (mine.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert mine.chat_template == tokenizer.chat_template
    assert (mine.eos_token_id, mine.bos_token_id, mine.pad_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                                                         tokenizer.pad_token_id)
    assert len(mine) == len(tokenizer) and mine.all_special_ids == tokenizer.all_special_ids
    assert mine.model_max_length == tokenizer.model_max_length
    ids = tokenizer("Straße 東京 😀 and more").input_ids
    assert mine.decode(ids) == tokenizer.decode(ids)


def test_loading_it_leaves_the_model_registry_unimported(default_model_dir):
    """The point of the direct path: no transformers model registry, generation code or torch."""
    code = ("import sys; from pd_cluster.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print([m for m in ('transformers.models.auto.modeling_auto', 'transformers.generation.utils', 'torch') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(default_model_dir)], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def _copy(default_model_dir: Path, dest: Path, tokenizer_class: str | None = None, model_type: str | None = None) -> Path:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, dest / name)
    for name, key, value in (("tokenizer_config.json", "tokenizer_class", tokenizer_class),
                             ("config.json", "model_type", model_type)):
        if value is not None:
            data = json.loads((dest / name).read_text())
            data[key] = value
            (dest / name).write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("tokenizer_class, model_type", [("GPT2Tokenizer", None), (None, "qwen2")])
def test_other_directories_go_through_auto_tokenizer(default_model_dir, tmp_path, monkeypatch, tokenizer_class, model_type):
    import transformers

    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, *a, **kw: calls.append(path) or real(path, *a, **kw))
    plain = _copy(default_model_dir, tmp_path / "plain")
    load_tokenizer(plain)
    assert calls == []
    other = _copy(default_model_dir, tmp_path / "other", tokenizer_class, model_type)
    assert not tokenizer_module._loads_as_generic_fast(other)
    load_tokenizer(other)
    assert calls == [str(other)]
    (plain / "tokenizer.json").unlink()
    assert not tokenizer_module._loads_as_generic_fast(plain)
