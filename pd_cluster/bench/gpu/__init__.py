"""GPU benchmark in one run: every number is a ratio against a ceiling measured in the same run.

    python -m pd_cluster.bench.gpu --out docs/benchmarks          # needs 2 GPUs for (d) and (e)

(a) decode step at batch 1/16/64/128 with ~1k context vs the floor (weight bytes + KV bytes
    read) / device copy bandwidth; (b) prefill at 1k/4k/8k vs the bf16 matmul rate (MFU);
(c) transformers ``generate()`` on the same weights, batch and lengths; (d) KV of 1k/4k/16k
    tokens GPU0 -> GPU1 through our channel vs raw NCCL send/recv of the same bytes, and a
    75% prefix hit on D; (e) how much of the transfer stays visible with layer-wise sending;
(h) fp8 weights and fp8 KV against bf16: decode steps, the bytes a handover moves, an fp8
    prefill against the FP8 matmul rate; (i) a width-4 beam search step against a greedy step
    of 4 rows.
The models are Llama-3-8B-shaped (and the default model's shape) with random bf16 weights
made on the GPU from a config file: nothing is downloaded. Results go to
``<out>/gpu-<kind>-<date>.json`` and a markdown table beside it; a short table prints last.

One module a phase: ``plan`` (the shapes of a run), ``timing`` and ``ceilings`` (clocks and the
copy / matmul rates every figure is divided by), ``models`` (random-weight engines), ``decode``
(a), ``prefill`` (b), ``hf`` (c), ``pd_pair`` (a P engine here and a D node in a child process)
with ``transfer`` (d, e), ``quant`` (h), ``beam`` (i), ``report`` (headline keys, verdicts,
markdown) and ``__main__`` (the run).
"""

from __future__ import annotations

import os

# Two GPUs of one host: NVLink multicast stays off, also in threads and children. Set here, the
# package's first lines, so that it holds before any of its modules starts NCCL.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")
