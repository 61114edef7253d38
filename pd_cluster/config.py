"""Engine configuration: one place for the knobs and their defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


#: Prefill chunks a decode node's local prefill (up to ``local_prefill_max_tokens``, 512 by
#: default) falls in: a chunk pads to the next size, and from about 256 tokens an 8B-shape step
#: is bound by its compute, so the sizes there are close together.
DEFAULT_MIXED_GRAPH_TOKENS = (32, 64, 128, 192, 256, 320, 384, 512)


class EngineConfig(BaseModel):
    """How one engine (a node's, or the offline ``LLM``'s) is sized and run."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="default", description='"default" or a Hugging Face model directory')
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$")
    device: str = Field(default="auto", description='"auto", "cpu", "cuda" or "cuda:N"')
    max_total_tokens: int | None = Field(
        default=None, gt=0, description="KV slots in the pool; None: a fraction of free GPU memory, or 32768 on CPU"
    )
    kv_memory_fraction: float = Field(default=0.85, gt=0.0, lt=1.0)
    gpu_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="share of the GPU's total memory this engine may hold (weights, headroom, KV), for engines "
                    "sharing a GPU; None: the KV pool takes kv_memory_fraction of the memory free at start",
    )
    block_size: int = Field(default=1, gt=0, description="tokens per prefix-cache and transfer block")
    enable_prefix_cache: bool = True
    max_running_requests: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0, description="token budget of one step (chunked prefill)")
    max_model_len: int | None = Field(default=None, gt=0, description="context length; None: the model's")
    max_waiting_requests: int = Field(default=4096, gt=0)
    seed: int = 0
    cuda_graphs: bool = Field(default=True, description="replay decode steps as CUDA graphs (CUDA devices only)")
    overlap_schedule: bool | None = Field(
        default=None,
        description="launch step N+1 before step N's tokens are read back (its inputs take them on the device), "
                    "and accept and detokenize them while it runs; a request found finished drops what later "
                    "steps drew for it. None: on for CUDA devices, which run ahead of the host; off on CPU, "
                    "where there is nothing to overlap",
    )
    cuda_graph_batch_sizes: list[int] | None = Field(
        default=None, description="batch sizes to capture; None: 1, 2, 4, ... up to max_running_requests"
    )
    mixed_graph_tokens: list[int] | None = Field(
        default=None,
        description="prefill-token sizes of the CUDA graphs for steps that mix short prefill chunks into the "
                    "decode batch (a decode node's local prefill, a mixed node's short prompts), each captured "
                    "with decode batches of none and of 8 and more; None: 32, 64, 128, 192, 256, 320, 384 and "
                    "512, capped by max_num_batched_tokens; []: such steps run eagerly",
    )
    fused_decode_rows: int | None = Field(
        default=None, ge=0, le=8,
        description="decode steps of at most this many rows fold each RMSNorm and the SiLU gate into the projection "
                    "after it, a third fewer kernels a layer (Triton on CUDA); None: 4 for a model whose layer "
                    "inputs fit one block (hidden and intermediate sizes up to 2048, as the default model's), "
                    "else 1 (a lone stream's steps)",
    )
    side_prefill_max_tokens: int = Field(
        default=0, ge=0,
        description="a request a node prefills itself (a decode node's short miss, a mixed node's short prompt) "
                    "arriving while a pipelined step runs is prefilled at once on a second CUDA stream beside it "
                    "when it misses at most this many tokens (and has no penalties or grammar), instead of "
                    "joining the batch after that step; 0 (default): off, since with P and D sharing one GPU "
                    "the two streams' contention cost more than the step it saves (docs/benchmarks/README.md)",
    )
    late_launch: bool = Field(
        default=True,
        description="with overlap scheduling on a GPU, launch the next step just before the step in flight ends "
                    "(estimated from the recent steps' device times) rather than as soon as it starts, so a "
                    "request arriving meanwhile joins the next step instead of the one after it; steps under "
                    "2 ms launch at once; off: always at once",
    )
    draw_graphs: bool = Field(
        default=True,
        description="capture each decode CUDA graph a second time with its sampling draw after the argmax, replayed "
                    "by sampled batches with no logit bias, penalty or grammar (their settings copied in first): a "
                    "sampled step is one replay whose ids reach the host with it, as a greedy step's do; off: "
                    "sampled batches launch their kernels after the step's graph (docs/benchmarks/README.md)",
    )
    mixed_graph_prefills: int = Field(
        default=4, ge=1, description="most prefill chunks one mixed CUDA graph holds (more run eagerly)"
    )
    prefill_chunk_tokens: int | None = Field(
        default=None, gt=0,
        description="most prompt tokens one step prefills, over all its prompts (a longer prompt is prefilled "
                    "over several steps); None: where mixed step graphs are captured, the largest of their sizes, "
                    "so that every prefill step replays one (an eager step of a small model is bound by its "
                    "launches: the default model's 1024-token prompt took 28 ms, two 512-token graphs 3.3 ms, "
                    "on an H200), else max_num_batched_tokens",
    )

    @field_validator("mixed_graph_tokens")
    @classmethod
    def _positive_tokens(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and any(s <= 1 for s in sizes):
            raise ValueError("mixed_graph_tokens must be sizes above one token")
        return sizes

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _positive_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
            raise ValueError("cuda_graph_batch_sizes must be a non-empty list of positive sizes")
        return sizes

    def graph_batch_sizes(self) -> list[int]:
        """Sizes to capture, ascending, capped at (and always including) max_running_requests,
        so every decode batch pads to one of them."""
        cap = self.max_running_requests
        if self.cuda_graph_batch_sizes is not None:
            sizes = {min(s, cap) for s in self.cuda_graph_batch_sizes}
        else:
            sizes = {1 << i for i in range(cap.bit_length()) if 1 << i <= cap}
        sizes.add(cap)
        return sorted(sizes)

    def graph_prefill_tokens(self) -> list[int]:
        """Prefill-token sizes of the mixed step graphs, ascending, none above the step's token budget."""
        sizes = DEFAULT_MIXED_GRAPH_TOKENS if self.mixed_graph_tokens is None else self.mixed_graph_tokens
        return sorted({s for s in sizes if s <= self.max_num_batched_tokens})

    def resolved_device(self) -> str:
        """A concrete device name: ``auto`` and ``cuda`` become ``cuda:N`` (the process's current
        GPU) before anything touches CUDA, since ``torch.cuda.set_device`` refuses a bare "cuda"."""
        return resolve_device(self.device)

    def resolved_dtype(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda:N`` when a GPU is visible, else ``cpu``; ``cuda`` -> ``cuda:N``."""
    import torch

    name = device.strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but no CUDA device is visible")
        return f"cuda:{torch.cuda.current_device()}"
    if name.startswith("cuda:"):
        index = name.removeprefix("cuda:")
        if not index.isdigit():
            raise ValueError(f"device: {device!r} is not cuda:N")
        if torch.cuda.is_available() and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
        return name
    if name != "cpu":
        raise ValueError(f"device: {device!r}; expected auto, cpu, cuda or cuda:N")
    return name
