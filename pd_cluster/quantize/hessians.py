"""What GPTQ needs to know of a projection's inputs: their second moment ``H = 2/n * X.T @ X``,
over the rows the engine's own model feeds it while it prefills calibration text.

The engine runs as it serves (float weights, one rank), its projection matrices swapped for
:class:`ObservedWeight`: the same tensor, which adds each input that ``F.linear`` multiplies by it
to its sum before the product runs. So the inputs are exactly the model's, whatever the family
(biases, per-head norms, rope scaling) and no second forward pass has to be kept in step with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: The projections of a dense layer that take an input of their own (q/k/v share one, as do
#: gate/up), by :class:`pd_cluster.model.weights.LayerWeights` field.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class ObservedWeight(torch.Tensor):
    """A projection's weight that sums ``x.T @ x`` of every input ``F.linear`` multiplies it by."""

    hessian: torch.Tensor
    rows: int

    @staticmethod
    def wrap(weight: torch.Tensor) -> ObservedWeight:
        observed = torch.Tensor._make_subclass(ObservedWeight, weight)
        observed.hessian = torch.zeros(weight.shape[-1], weight.shape[-1], dtype=torch.float32, device=weight.device)
        observed.rows = 0
        return observed

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            if isinstance(weight, ObservedWeight):
                x = args[0] if args else kwargs["input"]
                with torch._C.DisableTorchFunctionSubclass():
                    rows = x.reshape(-1, x.shape[-1]).float()
                    weight.hessian.addmm_(rows.T, rows)
                weight.rows += rows.shape[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def moment(self) -> torch.Tensor:
        """``2/n * X.T @ X`` over the ``n`` rows seen (zeros before any)."""
        return self.hessian * (2.0 / max(1, self.rows))


def projection_hessians(engine: Any, windows: Sequence[Sequence[int]]) -> dict[tuple[int, str], torch.Tensor]:
    """``H`` of every dense layer's projections (by ``(layer, projection)``, of :data:`PROJECTIONS`),
    over the inputs of ``engine`` (an :class:`pd_cluster.engine.llm_engine.LLMEngine` of float
    weights at one rank) prefilling each of ``windows`` (token ids). The weights are restored after."""
    from pd_cluster.sampling_params import SamplingParams

    layers = engine.model.weights.layers
    observed: dict[tuple[int, str], ObservedWeight] = {}
    for index, layer in enumerate(layers):
        if layer.experts is not None:
            raise ValueError(f"layer {index} routes to experts: calibration covers dense layers only")
        for name in PROJECTIONS:
            weight = getattr(layer, name)
            if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16,
                                                                             torch.float16):
                raise ValueError(f"layer {index} {name}: float weights expected for calibration")
            observed[index, name] = ObservedWeight.wrap(weight)
            setattr(layer, name, observed[index, name])
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for number, window in enumerate(windows):
            engine.add_request(f"calibration-{number}", list(window), params)
        while engine.has_unfinished():
            engine.step()
    finally:
        for (index, name), weight in observed.items():
            with torch._C.DisableTorchFunctionSubclass():
                setattr(layers[index], name, weight.as_subclass(torch.Tensor))
    seen = {key: w.rows for key, w in observed.items()}
    logger.info("calibration: %d windows, %d rows into each layer's q/k/v", len(windows), seen.get((0, "qkv"), 0))
    return {key: w.moment() for key, w in observed.items()}
