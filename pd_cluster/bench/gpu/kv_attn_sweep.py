"""``python -m pd_cluster.bench.gpu.kv_attn_sweep``: decode attention alone over bfloat16 KV and
over int8 / fp8 e4m3 KV, each a few tilings, at one KV-heavy shape (default: batch 64 x 4096
tokens of context, Llama-3-8B's 32 q heads over 8 kv heads of 128).

A quantized tile reads half the bytes of a bfloat16 one, but its codes must become the products'
dtype; which conversions, tile width, pipeline depth and split count make the read the bound is
measured here, not guessed. Each line: microseconds a launch pair (median between CUDA events),
effective GB/s of KV read (values and scales: a quantized row's 132 bytes of head_dim 128, not
the padding to 144 that aligns stored rows to 16 bytes), the ratio to bfloat16's default, and the relative error against the
torch reference on the same bytes (a broken variant shows there). The short table of the best
tiling of each kind comes last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from kernels.attention import decode_attention_ref, decode_attention_triton
from kernels.kv_quant import packed_row_bytes, quantize_rows
from pd_cluster.bench.gpu.timing import cuda_ms


@dataclass(frozen=True)
class Variant:
    """One launch configuration; None: the launcher's default."""

    kind: str  # "bf16", "int8" or "fp8_e4m3"
    float16_codes: bool | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None
    values_float16: bool | None = None
    ahead: bool | None = None
    heads_together: bool | None = None
    values_in_shift: bool | None = None
    direct: bool | None = None

    @property
    def label(self) -> str:
        f16 = {None: "dflt", True: "q16", False: "qbf"}[self.float16_codes]
        v16 = {None: "", True: " v16", False: " v8"}[self.values_float16]
        v16 += {None: "", True: " vshift", False: " vmax"}[self.values_in_shift]
        return (f"{self.kind:8s} {f16}{v16} n={self.block_n or 'd'} w={self.num_warps or 'd'} "
                f"st={self.num_stages or 'd'} sp={self.num_splits or 'd'}{' ahead' if self.ahead else ''}"
                f"{ {None: '', True: ' heads', False: ' seqs'}[self.heads_together]}"
                f"{ {None: '', True: ' direct', False: ' triton'}[self.direct]}")


def variants() -> list[Variant]:
    """bfloat16 at its default and two variants; the quantized defaults; fp8 values met by the
    product as codes (the path before float16 values) at its former best; fp8 values converted to
    float16 as they load over tile widths, warps, pipeline depths and splits, value scales in the
    scores, a tile read ahead into registers (one stage), and the grid walking kv heads first;
    int8 values converted to float16 (q as float16) against int8 met as codes by a bfloat16 q."""
    fp8, int8 = "fp8_e4m3", "int8"
    out = [Variant("bf16"), Variant("bf16", block_n=64), Variant("bf16", num_splits=1),
           Variant("bf16", heads_together=True), Variant(fp8), Variant(int8),
           Variant(fp8, True, 128, 4, 2, 1, values_float16=False),
           Variant(fp8, True, 128, 4, 2, 1, values_float16=False, heads_together=True)]
    # Depth 5 and 7: the slot and code loads are a two-level chain, so Triton gives each load
    # (stages - 1) // 2 stages: 2 code buffers (3 at 7), a program's next tiles in flight.
    grid = [(128, 4, 2, 1), (128, 4, 2, 2), (128, 4, 2, 3), (64, 4, 2, 1), (64, 4, 2, 2), (64, 4, 2, 3),
            (64, 4, 5, 1), (64, 4, 5, 2), (64, 4, 5, 3), (32, 4, 5, 1), (32, 4, 5, 2), (128, 4, 5, 1),
            (128, 4, 5, 2), (64, 4, 7, 2), (32, 4, 7, 2),
            (64, 4, 1, 1), (64, 4, 1, 2), (32, 4, 2, 1), (32, 4, 2, 2), (32, 4, 1, 2), (128, 8, 2, 2),
            (128, 8, 1, 1), (128, 8, 1, 2), (64, 8, 2, 2), (128, 4, 3, 1), (128, 4, 3, 2)]
    out += [Variant(fp8, True, *config) for config in grid]
    few = [(128, 4, 2, 1), (64, 4, 5, 2), (64, 4, 2, 3), (64, 4, 1, 1), (32, 4, 5, 2), (128, 4, 2, 2),
           (64, 4, 1, 2)]
    out += [Variant(fp8, True, *config, values_in_shift=True) for config in few[:5]]
    out += [Variant(fp8, True, *config, heads_together=True) for config in few]
    out += [Variant(int8, True, *config) for config in ((128, 4, 2, 1), (64, 4, 2, 2), (64, 4, 1, 1))]
    out += [Variant(int8, True, 64, 4, 2, 2, heads_together=True), Variant(int8, False, 128, 4, 2, 1)]
    out += [Variant(fp8, True, *config, ahead=True) for config in ((64, 4, 1, 1), (32, 4, 1, 2), (128, 8, 1, 1))]
    return out


def default_variants() -> list[Variant]:
    """Each kind's default launch; fp8 by the Triton kernel (where the direct kernel is the
    default); fp8 at the Triton kernel's default launch with values met as codes, with the
    value scales' tile maximum, with the grid walking sequences first (all three: the former
    default), and each change alone."""
    fp8 = "fp8_e4m3"
    return [Variant("bf16"), Variant(fp8), Variant(fp8, direct=False), Variant("int8"),
            Variant(fp8, values_float16=False, values_in_shift=False, heads_together=False),
            Variant(fp8, values_float16=False), Variant(fp8, values_in_shift=False),
            Variant(fp8, heads_together=False), Variant("int8", heads_together=False)]


def kv_caches(batch: int, ctx: int, kv_heads: int, head_dim: int, device: torch.device,
              gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same keys and values as bfloat16 caches and as int8 and fp8 rows as a pool stores them."""
    slots = batch * ctx
    k = torch.randn(slots, kv_heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(slots, kv_heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    caches = {"bf16": (k, v)}
    for kind in ("int8", "fp8_e4m3"):
        caches[kind] = (quantize_rows(k, kind), quantize_rows(v, kind))
    return caches


def run_variant(variant: Variant, q: torch.Tensor, caches: dict, table: torch.Tensor, ctx_lens: torch.Tensor,
                refs: dict, device: torch.device, reps: int) -> dict:
    k_cache, v_cache = caches[variant.kind]
    quant = None if variant.kind == "bf16" else variant.kind
    kwargs = {"block_n": variant.block_n, "num_warps": variant.num_warps, "num_stages": variant.num_stages,
              "num_splits": variant.num_splits, "quant": quant}
    if quant is not None:
        kwargs["float16_codes"] = variant.float16_codes
        kwargs["values_float16"] = variant.values_float16
        kwargs["ahead"] = variant.ahead
        kwargs["values_in_shift"] = variant.values_in_shift
        kwargs["direct"] = variant.direct
    kwargs["heads_together"] = variant.heads_together
    sm_scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)

    def launch() -> None:
        decode_attention_triton(q, k_cache, v_cache, table, ctx_lens, sm_scale, out=out, **kwargs)

    launch()
    ref = refs[variant.kind]
    err = ((out.float() - ref).norm() / ref.norm()).item()
    max_abs = (out.float() - ref).abs().max().item()
    ms = cuda_ms(launch, device, warmup=3, reps=reps)
    row = q.shape[-1] * k_cache.element_size() if quant is None else packed_row_bytes(q.shape[-1])
    kv_bytes = 2 * int(ctx_lens.sum()) * k_cache.shape[1] * row
    return {"us": ms * 1e3, "gb_per_s": kv_bytes / (ms * 1e-3) / 1e9, "rel_err": err, "max_abs_err": max_abs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: the interpreter (TRITON_INTERPRET=1), a smoke run")
    parser.add_argument("--reps", type=int, default=20, help="timed launches a variant (after 3 untimed)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--slots", choices=("shuffled", "contiguous"), default="shuffled",
                        help="each sequence's slots: shuffled over the pool (after churn) or one run")
    parser.add_argument("--set", choices=("full", "defaults"), default="full",
                        help="defaults: each kind's default launch (and fp8 values as codes), --repeat times, "
                             "interleaved")
    parser.add_argument("--repeat", type=int, default=1, help="times each variant is measured (defaults)")
    parser.add_argument("--report", help="print the short table of this JSON (a sweep cut short) and exit")
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            summarize(json.load(f)["rows"])
        return
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    caches = kv_caches(args.batch, args.ctx, args.kv_heads, args.head_dim, device, gen)
    q = torch.randn(args.batch, args.q_heads, args.head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    # Shuffled slots, as a pool hands them out after some churn, or one run a sequence.
    if args.slots == "shuffled":
        table = torch.randperm(args.batch * args.ctx, device=device, generator=gen).view(args.batch, args.ctx)
    else:
        table = torch.arange(args.batch * args.ctx, device=device).view(args.batch, args.ctx)
    ctx_lens = torch.full((args.batch,), args.ctx, dtype=torch.int32, device=device)
    sm_scale = args.head_dim ** -0.5
    refs = {}
    for kind, (k_cache, v_cache) in caches.items():
        quant = None if kind == "bf16" else kind
        if quant is None:
            k_cache, v_cache = k_cache.float(), v_cache.float()
        refs[kind] = decode_attention_ref(q.float(), k_cache, v_cache, table, ctx_lens, sm_scale, quant)
    rows = []
    if args.set == "full":
        chosen = variants()
    else:  # interleaved repeats
        chosen = default_variants() * args.repeat
    for variant in chosen:
        try:
            result = run_variant(variant, q, caches, table, ctx_lens, refs, device, args.reps)
        except Exception as exc:  # a tiling that does not compile or fit is reported, not fatal
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        rows.append({**asdict(variant), "label": variant.label, **result})
        if args.json:  # after every row: a sweep cut short by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"shape": vars(args), "rows": rows}, f, indent=1)
        if "error" in result:
            print(f"{variant.label}  {result['error']}", flush=True)
        else:
            print(f"{variant.label}  {result['us']:8.1f} us  {result['gb_per_s']:7.0f} GB/s  "
                  f"err {result['rel_err']:.1e} max {result['max_abs_err']:.1e}", flush=True)
    summarize(rows)


def summarize(rows: list[dict]) -> None:
    """The short table: each variant measured more than once as its median and spread, then the
    default and the best of each kind, as ratios to bfloat16's default (its median)."""
    by_label: dict[str, list[dict]] = {}
    for r in rows:
        if "us" in r:
            by_label.setdefault(r["label"], []).append(r)
    bf16 = by_label.get(Variant("bf16").label)
    if not bf16:
        print("bf16 default did not run")
        return
    base = statistics.median(r["us"] for r in bf16)
    repeated = {label: rs for label, rs in by_label.items() if len(rs) > 1}
    if repeated:
        print(f"\nmedian (min-max) of repeats, ratio to bf16 default's median {base:.1f} us:")
        for label, rs in repeated.items():
            us = [r["us"] for r in rs]
            print(f"  {label}  {statistics.median(us):8.1f} us ({min(us):.1f}-{max(us):.1f})  "
                  f"ratio {statistics.median(us) / base:.3f}  err {rs[0]['rel_err']:.1e}")
    print("\nbest of each kind (ratio to bf16 default):")
    for kind in ("bf16", "int8", "fp8_e4m3"):
        ok = [r for r in rows if r["kind"] == kind and "us" in r and r["rel_err"] < 5e-2]
        if not ok:
            print(f"  {kind:8s} none ran")
            continue
        for name, pick in (("default", [r for r in ok if r["label"] == Variant(kind).label]),
                           ("best", [min(ok, key=lambda r: r["us"])])):
            if pick:
                r = pick[0]
                print(f"  {kind:8s} {name:7s} {r['us']:8.1f} us {r['gb_per_s']:7.0f} GB/s  "
                      f"ratio {r['us'] / base:.3f}  [{r['label']}]")


if __name__ == "__main__":
    main()
