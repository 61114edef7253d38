"""The prompts whose KV leaves P layer by layer while their prefill runs, and the engine's hook
that feeds them (``LLMEngine.set_layer_hook_factory``)."""

from __future__ import annotations

import torch

from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.handover.sender import LayerSink
from pd_cluster.model.llama import LayerHook


class LayerCaptures:
    """Layer sinks by request id (added and removed on the event loop, read on the engine thread).

    ``table`` is the engine's device table of request slots: a sink begins with a view of its
    request's row, which holds the prompt's slots once the step's inputs are written."""

    def __init__(self, table: torch.Tensor) -> None:
        self._table = table
        self._sinks: dict[str, LayerSink] = {}

    def add(self, request_id: str, sink: LayerSink) -> None:
        self._sinks[request_id] = sink

    def discard(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def hook_for(self, step: ScheduledStep) -> LayerHook | None:
        """Engine thread: a hook for the steps that complete a captured prompt."""
        if not self._sinks:
            return None
        sinks = []
        for req, sample in zip(step.requests, step.samples):
            sink = self._sinks.get(req.request_id)
            if sink is not None and sample:
                sink.begin(self._table[req.row, sink.start : sink.n_tokens])
                sinks.append(sink)
        if not sinks:
            return None

        def hook(layer: int) -> None:
            for sink in sinks:
                sink.capture(layer)

        return hook
