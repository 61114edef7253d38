"""The objects one master app is made of, shared by its routes."""

from __future__ import annotations

from dataclasses import dataclass

from master.config import MasterSettings
from master.metrics import MasterMetrics
from master.model_info import ModelInfo
from master.registry import Registry
from master.relay import Relay
from master.request_log import RequestLog
from master.tokenization import Tokenizer


@dataclass
class MasterContext:
    settings: MasterSettings
    metrics: MasterMetrics
    registry: Registry
    relay: Relay
    tokenizer: Tokenizer
    model: ModelInfo | None
    request_log: RequestLog

    @property
    def model_name(self) -> str | None:
        """The name clients use in ``model`` (None while the master has not learned it)."""
        return self.settings.served_model_name or self.registry.model_name

    def knows_model(self, name: str) -> bool:
        return name in {self.settings.served_model_name, self.registry.model_name} - {None}

    def context_limit(self) -> int | None:
        """Longest prompt + output a request may have: the nodes' context, and what one D can hold."""
        limits = [v for v in (self.registry.max_model_len(), self.registry.largest_decode_kv(), self.settings.max_model_len) if v]
        return min(limits) if limits else None
