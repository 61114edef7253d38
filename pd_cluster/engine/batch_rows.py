"""``--max-running-requests auto``: a batch limit sized for decoding.

A decode node's batch is its throughput: a fixed limit (64) left most of a large GPU's KV pool
idle while prefill nodes' leases were refused as "full". Sized from the pool instead, the limit is
as many requests as the pool holds at a typical context (prompt and output), so rows and KV run
out together. It is capped by the largest decode CUDA graph, and the graphs are captured up to the
limit (``EngineConfig.graph_batch_sizes``), so every batch still replays one; the floor keeps a
small pool (or a long typical context) from serializing short requests, whose KV the master's
admission checks anyway.
"""

from __future__ import annotations

from pd_cluster.config import EngineConfig

#: Rows at least, whatever the pool.
MIN_ROWS = 16
#: The largest decode graph on a GPU: the most rows ``auto`` gives there (an 8B shape's pool on an
#: 80 GB GPU holds about 400 requests of 1k tokens, on an H200 about 800).
MAX_ROWS_GPU = 512
#: On CPU a step's time grows with every row: a small batch.
MAX_ROWS_CPU = 32
#: Bounds of the default typical context (an eighth of the context length).
MIN_TYPICAL_CONTEXT = 256
MAX_TYPICAL_CONTEXT = 2048


def typical_context(config: EngineConfig, max_model_len: int) -> int:
    """Tokens a request typically holds: ``--typical-context``, else an eighth of the context
    length within [MIN_TYPICAL_CONTEXT, MAX_TYPICAL_CONTEXT], never past the context length."""
    if config.typical_context is not None:
        return min(config.typical_context, max_model_len)
    return min(max(max_model_len // 8, MIN_TYPICAL_CONTEXT), MAX_TYPICAL_CONTEXT, max_model_len)


def auto_rows(config: EngineConfig, kv_tokens: int, max_model_len: int, on_gpu: bool) -> int:
    """The batch limit ``auto`` stands for on an engine with ``kv_tokens`` KV slots."""
    cap = MAX_ROWS_GPU if on_gpu else MAX_ROWS_CPU
    if on_gpu and config.cuda_graphs and config.cuda_graph_batch_sizes is not None:
        cap = max(config.cuda_graph_batch_sizes)  # the largest graph asked for
    rows = kv_tokens // typical_context(config, max_model_len)
    return max(min(rows, cap), min(MIN_ROWS, cap))


def resolve_rows(config: EngineConfig, kv_tokens: int, max_model_len: int, on_gpu: bool) -> EngineConfig:
    """``config`` with ``max_running_requests`` a number (``auto`` resolved; a number kept)."""
    if config.max_running_requests != "auto":
        return config
    rows = auto_rows(config, kv_tokens, max_model_len, on_gpu)
    return config.model_copy(update={"max_running_requests": rows})
