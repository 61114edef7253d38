"""Tensors written as a Hugging Face safetensors checkpoint: files of up to a size, named
``model-0000k-of-0000n.safetensors`` and indexed by ``model.safetensors.index.json``, written as
they fill (a large model's tensors are never all held at once)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

#: Bytes a file holds at most before the next one starts (a tensor larger than it gets its own).
SHARD_BYTES = 4 * 2**30


class CheckpointWriter:
    """``add`` tensors by name, then ``close`` to name the files and write the index."""

    def __init__(self, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.out = out
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        path = self.out / f"part-{len(self.files)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        """Name the files in order, write the index; the tensors' bytes in all."""
        if self.pending or not self.files:
            self._flush()
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self.files, start=1):
            final = f"model-{number:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
            logger.info("wrote %s (%d tensors)", final, len(names))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return self.total_bytes
