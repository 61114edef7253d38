"""``python -m pd_cluster.bench.gpu.kv_read_probe``: how fast the decode kernels' access pattern
reads a KV pool when nothing but the reads is done (default: batch 64 x 4096 tokens of context,
8 kv heads of 128, slots shuffled over the pool as after churn).

Decode attention over fp8 rows reads as many (token, head) rows a second as over bfloat16 rows,
whose rows are twice the bytes, so its time is not its bytes'. This probe walks the same slot
tables with the same two-level chain (the table's slots, then their rows, keys and values, with a
quantized row's scale) and only sums the words it read: per (sequence, split, group of kv heads)
programs of ``BLOCK_N`` slots a tile, one head a program (the per-head kernel's isolated rows) to
all 8 (a slot's whole run). Where the probe reads far faster than the attention kernels, their
bound is the work around the reads; where it reads no faster, the pattern itself. Each line:
microseconds, GB/s of the bytes the attention kernels count (132 a quantized row of 128 values,
256 a bfloat16 one), billions of rows a second, the ratio to the copy rate measured here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from kernels._triton import tl, triton
from kernels.kv_quant import packed_row_bytes, row_bytes, scale_offset
from pd_cluster.bench.gpu.timing import cuda_ms


@triton.jit
def _probe_kernel(k_ptr, v_ptr, table_ptr, out_ptr, split_len, stride_table, stride_s, stride_h,
                  HEADS: tl.constexpr, WORDS: tl.constexpr, SCALE_AT: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h = tl.program_id(2) * HEADS + tl.arange(0, HEADS)
    w = tl.arange(0, WORDS)
    n_offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros([HEADS, WORDS], dtype=tl.int32)
    lo = split * split_len
    for start in range(lo, lo + split_len, BLOCK_N):
        slots = tl.load(table_ptr + seq * stride_table + start + n_offs).to(tl.int64)
        rows = (slots[:, None] * (stride_s // 16) + h[None, :] * (stride_h // 16)) * 16  # [N, H] bytes
        k = tl.load((k_ptr + rows).to(tl.pointer_type(tl.int32))[:, :, None] + w[None, None, :])
        v = tl.load((v_ptr + rows).to(tl.pointer_type(tl.int32))[:, :, None] + w[None, None, :])
        acc += tl.sum(k ^ v, axis=0)
        if SCALE_AT:
            k_scale = tl.load((k_ptr + rows + SCALE_AT).to(tl.pointer_type(tl.int32)))
            v_scale = tl.load((v_ptr + rows + SCALE_AT).to(tl.pointer_type(tl.int32)))
            acc += tl.sum(k_scale ^ v_scale, axis=0)[:, None]
    base = ((seq * tl.num_programs(1) + split) * tl.num_programs(2) + tl.program_id(2)) * HEADS * WORDS
    tl.store(out_ptr + base + (tl.arange(0, HEADS)[:, None] * WORDS + w[None, :]), acc)


@dataclass(frozen=True)
class Probe:
    kind: str  # "bf16" or "fp8_e4m3"
    heads: int  # kv heads a program
    block_n: int
    splits: int
    num_warps: int = 4
    num_stages: int = 2
    slots: str = "shuffled"

    @property
    def label(self) -> str:
        return (f"{self.kind:8s} heads={self.heads} n={self.block_n:3d} sp={self.splits} w={self.num_warps} "
                f"st={self.num_stages} {self.slots}")


def probes() -> list[Probe]:
    """Per-head rows at the per-head kernels' tiles, slot runs of 4 and 8 heads at the slot-run
    kernel's, for fp8 and bfloat16 rows; deeper pipelines and wider tiles; contiguous slots."""
    out = []
    for kind in ("fp8_e4m3", "bf16"):
        out += [Probe(kind, 1, 128, 1), Probe(kind, 1, 128, 2), Probe(kind, 1, 64, 2), Probe(kind, 4, 16, 2),
                Probe(kind, 8, 16, 2), Probe(kind, 4, 32, 2), Probe(kind, 1, 128, 1, num_stages=3),
                Probe(kind, 4, 16, 2, num_stages=3), Probe(kind, 4, 64, 2, num_stages=3),
                Probe(kind, 1, 128, 1, slots="contiguous"), Probe(kind, 4, 16, 2, slots="contiguous")]
    return out


def run_probe(probe: Probe, caches: dict, tables: dict, batch: int, ctx: int, reps: int) -> dict:
    k_cache, v_cache = caches[probe.kind]
    table = tables[probe.slots]
    kv_heads = k_cache.shape[1]
    quantized = probe.kind != "bf16"
    head_dim = 128 if quantized else k_cache.shape[2] // 2
    words = head_dim // 4 if quantized else head_dim // 2
    groups = kv_heads // probe.heads
    out = torch.empty(batch * probe.splits * groups * probe.heads * words, dtype=torch.int32, device=k_cache.device)

    def launch() -> None:
        _probe_kernel[(batch, probe.splits, groups)](
            k_cache, v_cache, table, out, ctx // probe.splits, table.stride(0), k_cache.stride(0),
            k_cache.stride(1), HEADS=probe.heads, WORDS=words, SCALE_AT=scale_offset(head_dim) if quantized else 0,
            BLOCK_N=probe.block_n, num_warps=probe.num_warps, num_stages=probe.num_stages)

    ms = cuda_ms(launch, k_cache.device, warmup=3, reps=reps)
    row = packed_row_bytes(head_dim) if quantized else 2 * head_dim
    rows = 2 * batch * ctx * kv_heads
    return {"us": ms * 1e3, "gb_per_s": rows * row / (ms * 1e-3) / 1e9, "g_rows_per_s": rows / (ms * 1e-3) / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--device", default="cuda", help="cpu: the interpreter (TRITON_INTERPRET=1), a smoke run")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    slots = args.batch * args.ctx
    # The pool's bytes as the caches store them: fp8 rows of 144 bytes, bfloat16 rows of 256.
    caches = {"fp8_e4m3": tuple(torch.randint(0, 255, (slots, args.kv_heads, row_bytes(128)), dtype=torch.uint8,
                                              device=device, generator=gen) for _ in range(2)),
              "bf16": tuple(torch.randint(0, 255, (slots, args.kv_heads, 256), dtype=torch.uint8, device=device,
                                          generator=gen) for _ in range(2))}
    tables = {"shuffled": torch.randperm(slots, device=device, generator=gen).view(args.batch, args.ctx),
              "contiguous": torch.arange(slots, device=device).view(args.batch, args.ctx)}
    src = torch.empty(1 << (28 if device.type == "cuda" else 16), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), device, warmup=3, reps=10)
    copy_gb = 2 * src.numel() / (copy_ms * 1e-3) / 1e9
    print(f"device copy: {copy_gb:.0f} GB/s (bytes read + written)", flush=True)
    rows = []
    for probe in probes():
        try:
            result = run_probe(probe, caches, tables, args.batch, args.ctx, args.reps)
        except Exception as exc:  # a tiling that does not compile or fit is reported, not fatal
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        rows.append({**asdict(probe), "label": probe.label, **result})
        if "error" in result:
            print(f"{probe.label}  {result['error']}", flush=True)
        else:
            print(f"{probe.label}  {result['us']:7.1f} us  {result['gb_per_s']:6.0f} GB/s  "
                  f"{result['g_rows_per_s']:5.1f} G rows/s  {result['gb_per_s'] / copy_gb:.2f} of copy", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"shape": vars(args), "copy_gb_per_s": copy_gb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
