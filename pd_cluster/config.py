"""Engine configuration: one place for the knobs, their defaults and their command-line flags.

A field marked ``Annotated[T, Flag()]`` is a flag of every command that builds an engine (``pd-cluster
prefill|decode|mixed|generate``), of the launchers that hand it to their nodes (``pd-cluster local``,
``pd-cluster ray start``) and of the Helm chart's ``engine`` values: its ``description`` is the help
text users read, so it says what the setting does and what its default means.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pd_cluster.flag import Flag

#: Prefill chunks a decode node's local prefill (cut to its step budget, 512 tokens by default)
#: falls in: a chunk pads to the next size, and from about 256 tokens an 8B-shape step
#: is bound by its compute, so the sizes there are close together.
DEFAULT_MIXED_GRAPH_TOKENS = (32, 64, 128, 192, 256, 320, 384, 512)


class EngineConfig(BaseModel):
    """How one engine (a node's, or the offline ``LLM``'s) is sized and run."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Flag(passed_on=False)] = Field(
        default="default", description='"default" (SmolLM2-135M-Instruct) or a Hugging Face model directory'
    )
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Flag()] = Field(
        default="auto", description="weights and KV dtype (auto: bfloat16 on a GPU, float32 on CPU)"
    )
    kv_cache_dtype: Annotated[Literal["auto", "fp8_e4m3", "int8"], Flag()] = Field(
        default="auto",
        description="what the KV cache stores: auto (the model dtype), or int8 / fp8_e4m3 values with a float32 scale "
                    "per token and KV head (a quarter of float32 KV's bytes, about half of bfloat16's, plus the "
                    "scales); a P and a D may differ, P converts its KV into D's on the way",
    )
    device: Annotated[str, Flag(passed_on=False)] = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    # pd-cluster local sets it per role (--prefill-tp, --decode-tp, --mixed-tp).
    tp: Annotated[int, Flag(metavar="N", passed_on=False)] = Field(
        default=1, ge=1, le=64,
        description="tensor parallelism: the node runs on N devices (cuda:i to cuda:i+N-1 from its device cuda:i; "
                    "on CPU N processes), each holding its share of the attention heads, of the MLP and of the KV "
                    "heads (replicated when N exceeds them); one registration with the master (default 1)",
    )
    # Picked where it measured faster: NCCL's ring costs tens of microseconds even for a decode
    # step's few kilobytes, which one kernel reading the peers' memory sums in a few.
    tp_allreduce: Annotated[Literal["auto", "nccl", "oneshot"], Flag()] = Field(
        default="auto",
        description="how a tensor-parallel node sums its ranks' partial outputs: auto (a one-shot all-reduce over "
                    "the peers' memory for a decode step's small messages where the node's GPUs share one host with "
                    "peer access, NCCL otherwise and for large ones), nccl (always NCCL; gloo on CPU) or oneshot "
                    "(as auto, refusing to start where the one-shot cannot run) (default auto)",
    )
    load_format: Annotated[Literal["safetensors", "dummy"], Flag()] = Field(
        default="safetensors",
        description="where the weights come from: safetensors (the model directory's files) or dummy (seeded random "
                    "values of the model's shape made on each device, the same on every node: for benchmarks of "
                    "shapes too large to write out, from a directory with only config.json and a tokenizer) "
                    "(default safetensors)",
    )
    quantization: Annotated[Literal["none", "int8", "fp8", "fp8_mixed"], Flag()] = Field(
        default="none",
        description="the linear projections' weights (q/k/v, o, gate/up, down, the experts'): none (as the checkpoint "
                    "holds them; an FP8 checkpoint is dequantized into the model dtype), int8 or fp8 (8-bit, one scale "
                    "an output channel, quantized at load; an FP8 checkpoint keeps its own scales with fp8), or "
                    "fp8_mixed (fp8 but the MLP's gate/up int8: perplexity 1.009x the unquantized where fp8 costs "
                    "1.041x on the default model, at the same bytes); the embedding, the norms and the vocabulary "
                    "head stay in the model dtype (default none)",
    )
    max_total_tokens: Annotated[int | None, Flag()] = Field(
        default=None, gt=0, description="KV slots in the pool (default: a fraction of the free GPU memory, or 16384 "
                                        "on CPU)"
    )
    kv_memory_fraction: float = Field(default=0.85, gt=0.0, lt=1.0)
    gpu_memory_fraction: Annotated[float | None, Flag(passed_on=False)] = Field(
        default=None, gt=0.0, le=1.0,
        description="share of the GPU's total memory this engine may use (weights, headroom and KV), for engines "
                    "sharing a GPU (default: the KV pool takes a fraction of the memory free at start)",
    )
    block_size: Annotated[int, Flag()] = Field(default=1, gt=0, description="tokens per prefix-cache and transfer block")
    enable_prefix_cache: Annotated[bool, Flag(name="prefix-cache")] = Field(
        default=True, description="reuse the KV of an earlier prompt that shares a prefix (default: on)"
    )
    # A node command's default depends on its role (pd_cluster.cli.AUTO_ROWS_ROLES); "auto" is
    # resolved by the engine once its KV pool is sized (pd_cluster.engine.batch_rows).
    max_running_requests: Annotated[Annotated[int, Field(gt=0)] | Literal["auto"], Flag(metavar="{N,auto}")] = Field(
        default=64,
        description="requests in one batch at most; auto: sized for decoding, as many as the KV pool holds at "
                    "--typical-context tokens each, at least 16 and at most the largest decode CUDA graph, captured "
                    "to match (512; 32 on CPU) (default 64, on decode and mixed nodes auto)",
    )
    typical_context: Annotated[int | None, Flag(metavar="TOKENS")] = Field(
        default=None, gt=0,
        description="tokens (prompt and output) a request typically holds, which --max-running-requests auto sizes "
                    "the batch for (default: an eighth of the context length, between 256 and 2048)",
    )
    # A node command's default depends on its role (pd_cluster.cli.DECODE_STEP_TOKENS).
    max_num_batched_tokens: Annotated[int, Flag()] = Field(
        default=2048, gt=0,
        description="tokens in one forward pass at most (chunked prefill splits longer prompts; default 2048, on a "
                    "decode node 512: its own prefills of short misses then hold its running streams up by about "
                    "one step)",
    )
    max_model_len: int | None = Field(default=None, gt=0, description="context length; None: the model's")
    max_waiting_requests: int = Field(default=4096, gt=0)
    seed: int = 0
    cuda_graphs: bool = Field(default=True, description="replay decode steps as CUDA graphs (CUDA devices only)")
    # Its inputs take step N's tokens on the device; accepting and detokenizing them runs while
    # step N+1 does, and a request found finished drops what later steps drew for it. Off on CPU,
    # where there is nothing to overlap.
    overlap_schedule: Annotated[bool | None, Flag()] = Field(
        default=None,
        description="launch each step before the last one's tokens are read back, so the host prepares the next "
                    "step while the device runs (default: on a GPU, not on CPU)",
    )
    cuda_graph_batch_sizes: list[int] | None = Field(
        default=None, description="batch sizes to capture; None: 1, 2, 4, ... up to max_running_requests"
    )
    # Each size is captured with decode batches of none and of 8 and more.
    mixed_graph_tokens: Annotated[list[int] | None, Flag()] = Field(
        default=None,
        description="prefill-token sizes of the CUDA graphs for steps mixing short prefill chunks (a decode node's "
                    "local prefill, a mixed node's short prompts) into the decode batch (default "
                    f"{','.join(map(str, DEFAULT_MIXED_GRAPH_TOKENS))}, capped by the step budget); none (an empty "
                    "list): such steps run eagerly",
    )
    # A third fewer kernels a layer (Triton on CUDA).
    fused_decode_rows: Annotated[int | None, Flag()] = Field(
        default=None, ge=0, le=8,
        description="decode steps of at most this many rows fold each RMSNorm and the SiLU gate into the projection "
                    "after it (default: 4 for a model whose layer inputs fit one block, hidden and intermediate "
                    "sizes up to 2048 as in the default model, else 1)",
    )
    # Only requests with no penalties or grammar; off by default since with P and D sharing one
    # GPU the two streams' contention cost more than the step it saves (docs/benchmarks/README.md).
    side_prefill_max_tokens: Annotated[int, Flag(metavar="N")] = Field(
        default=0, ge=0,
        description="a request this node prefills itself (a decode node's short miss, a mixed node's short prompt) "
                    "arriving while a pipelined step runs is prefilled at once on a second CUDA stream beside it "
                    "when it misses at most N tokens, instead of joining the batch after that step (default 0: off)",
    )
    # The launch time is estimated from the recent steps' device times; steps under 2 ms launch at once.
    late_launch: Annotated[bool, Flag()] = Field(
        default=True,
        description="with overlap scheduling on a GPU, launch the next step just before the one in flight ends, "
                    "so a request arriving meanwhile joins it instead of the one after (default: on; off: as soon "
                    "as the one before starts)",
    )
    # Replayed by sampled batches with no logit bias, penalty or grammar (their settings copied in
    # first): a sampled step is one replay whose ids reach the host with it, as a greedy step's do
    # (docs/benchmarks/README.md).
    draw_graphs: Annotated[bool, Flag()] = Field(
        default=True,
        description="capture each decode CUDA graph a second time with its sampling draw after the argmax, so a "
                    "sampled batch's step is one replay too (default: on; off: the draw's kernels launch after the "
                    "step's graph)",
    )
    mixed_graph_prefills: int = Field(
        default=4, ge=1, description="most prefill chunks one mixed CUDA graph holds (more run eagerly)"
    )
    # An eager step of a small model is bound by its launches: the default model's 1024-token
    # prompt took 28 ms eagerly, as two 512-token graphs 3.3 ms, on an H200.
    prefill_chunk_tokens: Annotated[int | None, Flag(metavar="N")] = Field(
        default=None, gt=0,
        description="prompt tokens one step prefills at most, over all its prompts; a longer prompt takes several "
                    "steps (default: where mixed step graphs are captured, the largest --mixed-graph-tokens size, "
                    "so that each chunk replays a CUDA graph; elsewhere the step budget)",
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
        if cap == "auto":
            raise ValueError("max_running_requests is resolved by the engine before graphs are sized")
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

    def resolved_kv_dtype(self, device: str) -> str:
        """What the KV cache stores: the model dtype for ``auto``, else the quantized kind."""
        return self.resolved_dtype(device) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

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
