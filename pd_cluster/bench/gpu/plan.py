"""The shapes of one benchmark run."""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class Plan:
    """Shapes of one run: the full one, or a quick one that exercises every path on a tiny model."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.big_config = CONFIGS / ("tiny.json" if quick else "llama3-8b.json")
        self.small_config = CONFIGS / ("tiny.json" if quick else "smollm2-135m.json")
        self.decode_batches = [1, 4, 16] if quick else [1, 16, 64, 128]
        self.decode_ctx = 256 if quick else 1024
        self.decode_steps = 8 if quick else 20
        self.key_batch = 16 if quick else 64  # the "b64" keys
        self.prefill_lens = [256, 512, 1024] if quick else [1024, 4096, 8192]
        self.key_len = 512 if quick else 4096  # the "4k" keys
        self.hf_batches = [1, 16] if quick else [1, 64]
        self.hf_new_tokens = 4 if quick else 12
        self.transfer_lens = [256, 512, 2048] if quick else [1024, 4096, 16384]
        self.ttft_lens = [512] if quick else [1024, 4096]
        self.output_path_lens = [256, 512] if quick else [1024, 4096, 8192]
        #: Which parts of the run to do (``--parts``).
        self.parts: list[str] = ["decode", "prefill", "hf", "pd", "same_gpu", "peer_ipc", "small_model"]
        self.max_model_len = 4096 if quick else 17408
        self.kv_tokens = 32768 if quick else 180_000
        self.d_kv_tokens = 16384 if quick else 72_000
        self.block_size = 16
        #: Context of the KV-heavy decode step of the quantized KV key (the "ctx4k").
        self.kv_heavy_ctx = 512 if quick else 4096
        #: Prompt of the handover whose bytes the quantized KV key counts.
        self.kv_bytes_len = 512 if quick else 4096
        #: Beam search: its prompt (and the greedy rows' context), the untimed first steps, the timed ones.
        self.beam_ctx = 128 if quick else 512
        self.beam_skip_steps = 3
        self.beam_steps = 6 if quick else 16
        #: Engines pipeline their steps (``--overlap-schedule``); None: the engines' default (on a GPU).
        self.overlap_schedule: bool | None = None
