"""pd-cluster: disaggregated prefill/decode serving for Llama-family models.

``from pd_cluster import LLM, SamplingParams`` for offline generation. Heavy modules load on
first use, so roles that need only the protocol (the master) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "default_model_path", "__version__"]

if TYPE_CHECKING:
    from pd_cluster.config import EngineConfig
    from pd_cluster.default_model import default_model_path
    from pd_cluster.sampling_params import SamplingParams
    from pd_cluster.llm import LLM


def __getattr__(name: str):
    if name == "LLM":
        from pd_cluster.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pd_cluster.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from pd_cluster.config import EngineConfig

        return EngineConfig
    if name == "default_model_path":
        from pd_cluster.default_model import default_model_path

        return default_model_path
    raise AttributeError(f"module 'pd_cluster' has no attribute {name!r}")
