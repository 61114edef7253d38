"""A sweep of the fused MoE's parts at the Qwen3-30B-A3B layer shape (128 experts, top 8, hidden
2048, expert width 768), to choose the prompt-sized tiles and see where a layer's time goes.

For each token count (4096 and 1024 for a prompt, 64 for decode) on random routing (a random
router, as the MoE bench's random model routes) it times, each inside a CUDA graph of several
calls (no launch gaps; the median of several replays): the alignment, the gated GEMM and the down
GEMM over candidate configs (:data:`GATED_CANDIDATES`, :data:`DOWN_CANDIDATES`), the top-k sum, the
whole layer for the best pair of each row tile and the defaults, and torch's dense products of
the same FLOPs (``[pairs, 2048] @ [2048, 1536]`` and ``[pairs, 768] @ [768, 2048]``) as the rate
to compare with. Each whole-layer config's output is checked against the torch reference on the
same inputs. The JSON goes to ``$OUT/moe_sweep.json`` where ``OUT`` is set (``--json`` elsewhere).

    python -m pd_cluster.bench.gpu.moe_sweep [--tokens 4096,1024,64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kernels.fused_moe import (
    MoeGemmConfig,
    align_ref,
    fused_moe_triton,
    moe_config,
    moe_gemm,
    sum_top_k,
)
from kernels.head_norm import head_rms_norm
from kernels.moe_align import align, align_chunked
from kernels.moe_route import route_topk_ref, route_topk_triton
from kernels.rms_norm import rms_norm
from pd_cluster.bench.gpu.timing import cuda_ms
from pd_cluster.model.config import MoEConfig
from pd_cluster.model.moe import route, routed_experts_ref
from pd_cluster.model.weights import ExpertWeights

E, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
C = MoeGemmConfig

#: Gated (gate/up with SiLU) candidates for prompt-sized steps: block_n counts gate columns.
GATED_CANDIDATES = [
    C(64, 64, 64, 4, 4, group_m=8, interleaved=True, sorted_rows=True),
    C(64, 128, 64, 4, 4, group_m=8, interleaved=True, sorted_rows=True),
    C(128, 64, 64, 8, 4, group_m=8, interleaved=True, sorted_rows=True),
    C(128, 128, 64, 8, 4, group_m=16, interleaved=True, sorted_rows=True),
    C(128, 128, 64, 8, 4, group_m=16, sorted_rows=True),
    C(128, 128, 64, 8, 4, group_m=16, sorted_rows=True, tma=True),
    C(64, 128, 64, 4, 4, group_m=8, sorted_rows=True, tma=True),
]
#: Down-projection candidates (``sorted_rows``: reads the gated output in padded sorted order).
DOWN_CANDIDATES = [
    C(64, 128, 64, 4, 4, group_m=8, sorted_rows=True),
    C(64, 256, 64, 4, 4, group_m=8, sorted_rows=True),
    C(128, 128, 64, 8, 4, group_m=8, sorted_rows=True),
    C(128, 256, 64, 8, 4, group_m=16, sorted_rows=True),
    C(128, 256, 64, 8, 4, group_m=16, sorted_rows=True, tma=True),
    C(64, 256, 64, 4, 4, group_m=8, sorted_rows=True, tma=True),
    C(64, 128, 64, 4, 4, group_m=8, sorted_rows=True, tma=True),
]


def graph_ms(fn: Callable[[], object], calls: int = 10, replays: int = 7) -> float:
    """Median milliseconds a call of ``fn`` over ``replays`` replays of a graph of ``calls`` calls
    (eager CUDA events if ``fn`` cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError:
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(calls):
                fn()
    run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def compile_in_parallel(fns: list[Callable[[], object]]) -> None:
    """Call each of ``fns`` once from a pool of threads, so that their kernels compile side by side
    (a compile is mostly the assembler's process); a failure shows again when it is timed."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(fn) for fn in fns]:
            try:
                future.result()
            except Exception:  # reported by the timed call
                pass
    torch.cuda.synchronize()


def label(cfg: MoeGemmConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}s{cfg.num_stages} g{cfg.group_m}"
            f"{' il' if cfg.interleaved else ''}{' sorted' if cfg.sorted_rows else ''}{' tma' if cfg.tma else ''}")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def sweep_tokens(tokens: int, w: ExpertWeights, moe: MoEConfig, mm_tflops: float, rows: list[dict]) -> None:
    """Every part at ``tokens`` tokens, appended to ``rows``."""
    dev = w.router.device
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
    experts, weights = route(x, w.router, moe)
    pairs = tokens * TOP_K
    gated_flops, down_flops = 2 * pairs * HIDDEN * 2 * INTER, 2 * pairs * INTER * HIDDEN
    flops = gated_flops + down_flops

    def add(part: str, cfg: str, ms: float, part_flops: float = 0.0, **extra: object) -> None:
        row = {"tokens": tokens, "part": part, "config": cfg, "ms": ms, **extra}
        if part_flops:
            row.update(tflops=part_flops / ms / 1e9, of_mm=part_flops / ms / 1e9 / mm_tflops)
        rows.append(row)
        tail = f"  {row['tflops']:6.0f} TFLOP/s  {row['of_mm']:.3f} of mm" if part_flops else ""
        more = "".join(f"  {k} {v:.3g}" if isinstance(v, float) else f"  {k} {v}" for k, v in extra.items()
                       if k != "configs")
        print(f"T={tokens:5d} {part:8s} {cfg:36s} {ms:8.4f} ms{tail}{more}", flush=True)

    a_rows = torch.randn(pairs, HIDDEN, device=dev, dtype=torch.bfloat16)
    w_up = torch.randn(HIDDEN, 2 * INTER, device=dev, dtype=torch.bfloat16)
    h_rows = torch.randn(pairs, INTER, device=dev, dtype=torch.bfloat16)
    w_down = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    mm_up = graph_ms(lambda: a_rows @ w_up)
    mm_down = graph_ms(lambda: h_rows @ w_down)
    add("mm", "dense gate/up rows", mm_up, gated_flops)
    add("mm", "dense down rows", mm_down, down_flops)
    add("mm", "dense both", mm_up + mm_down, flops)
    del a_rows, h_rows
    logits = torch.nn.functional.linear(x, w.router)
    fused_route = route_topk_triton(logits, TOP_K, True, x.dtype)
    torch_route = route_topk_ref(logits, TOP_K, True, x.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    add("route", "torch softmax + topk", graph_ms(lambda: route_topk_ref(logits, TOP_K, True, x.dtype)))
    add("route", "fused softmax + top-k", graph_ms(lambda: route_topk_triton(logits, TOP_K, True, x.dtype)),
        same_experts=bool(torch.equal(fused_route[0], torch_route[0])),
        same_probs=bool(torch.equal(probs.gather(1, fused_route[0]), probs.gather(1, torch_route[0]))),
        weight_diff=float((fused_route[1].float() - torch_route[1].float()).abs().max()))
    ref = routed_experts_ref(x, w, moe, experts, weights)
    ref_ms = cuda_ms(lambda: routed_experts_ref(x, w, moe, experts, weights), x.device, warmup=1, reps=3)
    add("ref", "torch experts (eager)", ref_ms, flops)
    for bm in (16,) if pairs <= 1024 else (64, 128):
        want = align_ref(experts, E, bm)
        add("align", f"torch ops bm{bm}", graph_ms(lambda: align_ref(experts, E, bm)), padded_rows=int(want.num_padded))
        for name, fn in (("chunked", align_chunked),):
            got = fn(experts, E, bm)
            same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("pairs", "block_experts", "num_padded"))
            add("align", f"{name} bm{bm}", graph_ms(lambda: fn(experts, E, bm)), same=same)
    route_flat = weights.reshape(-1).contiguous()
    best: dict[tuple[str, int], tuple[float, MoeGemmConfig]] = {}
    gated = [moe_config(pairs, True)] + (GATED_CANDIDATES if pairs > 1024 else [])
    down = [moe_config(pairs, False)] + (DOWN_CANDIDATES if pairs > 1024 else [])
    launches = []
    for kind, cands in (("gated", gated), ("down", down)):
        for cfg in cands:
            alignment = align(experts, E, cfg.block_m)
            if kind == "gated":
                fn = partial(moe_gemm, x, w.gate_up, alignment, pairs, TOP_K, True, config=cfg,
                             out_sorted=cfg.sorted_rows)
            else:
                hidden = torch.randn(alignment.pairs.numel() if cfg.sorted_rows else pairs, INTER, device=dev,
                                     dtype=torch.bfloat16)
                fn = partial(moe_gemm, hidden, w.down, alignment, pairs, 1, False, route=route_flat, config=cfg,
                             a_sorted=cfg.sorted_rows)
            launches.append((kind, cfg, fn))
    compile_in_parallel([fn for _, _, fn in launches])
    for kind, cfg, fn in launches:
        try:
            ms = graph_ms(fn)
        except Exception as e:  # a config that does not compile or launch is a result too
            add(kind, label(cfg), float("nan"), error=str(e).splitlines()[-1][:120] if str(e) else type(e).__name__)
            continue
        add(kind, label(cfg), ms, gated_flops if kind == "gated" else down_flops)
        key = (kind, cfg.block_m)
        if key not in best or ms < best[key][0]:
            best[key] = (ms, cfg)
    outs = torch.randn(pairs, HIDDEN, device=dev, dtype=torch.bfloat16)
    add("sum", "top-k sum", graph_ms(lambda: sum_top_k(outs, TOP_K)))
    layer_cfgs: list[tuple[str, tuple[MoeGemmConfig, MoeGemmConfig] | None]] = [("default", None)]
    for bm in sorted({bm for _, bm in best}):
        if ("gated", bm) in best and ("down", bm) in best:
            up_cfg, down_cfg = best[("gated", bm)][1], best[("down", bm)][1]
            if not up_cfg.sorted_rows and down_cfg.sorted_rows:
                down_cfg = C(**{**asdict(down_cfg), "sorted_rows": False})
            if up_cfg.sorted_rows and not down_cfg.sorted_rows:
                up_cfg = C(**{**asdict(up_cfg), "sorted_rows": False})
            layer_cfgs.append((f"best bm{bm}: {label(up_cfg)} / {label(down_cfg)}", (up_cfg, down_cfg)))
    for name, cfgs in layer_cfgs:
        out = fused_moe_triton(x, w.gate_up, w.down, experts, weights, E, configs=cfgs)
        err = relative_error(out, ref)
        ms = graph_ms(lambda: fused_moe_triton(x, w.gate_up, w.down, experts, weights, E, configs=cfgs))
        add("layer", name, ms, flops, rel_err=err, ok=err <= 1.5e-2,
            configs=None if cfgs is None else [asdict(c) for c in cfgs])


def time_head_norms(tokens: int, rows: list[dict]) -> None:
    """Qwen3's q and k norms of a ``tokens``-token step (32 and 4 heads of 128, strided views of
    the qkv projection): a contiguous copy and the row norm, against the strided head norm."""
    qkv = torch.randn(tokens, 40 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:4608].view(tokens, 4, 128)
    weight = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5

    def rows_norm() -> list[torch.Tensor]:
        return [rms_norm(h.reshape(-1, 128).contiguous(), weight, 1e-6)[0].view(h.shape) for h in (q, k)]

    def heads_norm() -> list[torch.Tensor]:
        return [head_rms_norm(h, weight, 1e-6) for h in (q, k)]

    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(rows_norm(), heads_norm()))
    old, new = graph_ms(rows_norm), graph_ms(heads_norm)
    moved = 2 * 2 * tokens * 36 * 128 / new / 1e9
    rows.append({"tokens": tokens, "part": "qk_norm", "rows_ms": old, "heads_ms": new, "max_abs_diff": diff,
                 "heads_tb_per_s": moved})
    print(f"T={tokens:5d} q/k norm: copy + row norm {old:.4f} ms, strided head norm {new:.4f} ms ({old / new:.2f}x, "
          f"{moved:.2f} TB/s read + written), max |diff| {diff:.3g}", flush=True)


def summarize(rows: list[dict]) -> None:
    """The table to read: each part's fastest candidate and the whole layer's configs."""
    print("\nsummary: fastest of each part (ms; 'of mm': fraction of the 8192^3 matmul rate)")
    for tokens in sorted({r["tokens"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["tokens"] == tokens and r.get("ms") == r.get("ms")]
        for part in ("mm", "route", "align", "gated", "down", "sum"):
            cands = sorted((r for r in mine if r["part"] == part), key=lambda r: r["ms"])
            for r in cands[:3 if part in ("gated", "down", "align") else 2]:
                rate = f"  {r['of_mm']:.3f} of mm" if "of_mm" in r else ""
                print(f"T={tokens:5d} {part:6s} {r['config']:40s} {r['ms']:8.4f} ms{rate}")
        for r in (r for r in rows if r["tokens"] == tokens and r["part"] == "qk_norm"):
            print(f"T={tokens:5d} qk_norm rows {r['rows_ms']:.4f} ms -> heads {r['heads_ms']:.4f} ms")
        for r in (r for r in mine if r["part"] == "layer"):
            print(f"T={tokens:5d} layer  {r['config']:90s} {r['ms']:8.4f} ms  {r['of_mm']:.3f} of mm  "
                  f"err {r['rel_err']:.2e} {'ok' if r['ok'] else 'WRONG'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,1024,64")
    parser.add_argument("--json", type=Path, default=None, help="where the JSON goes (default $OUT/moe_sweep.json)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    w = ExpertWeights(torch.randn(E, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.05,
                      torch.randn(E, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
                      torch.randn(E, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02)
    moe = MoEConfig(E, TOP_K, INTER, True, frozenset({0}))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_tflops = 2 * 8192 ** 3 / graph_ms(lambda: a @ a, calls=5) / 1e9
    del a
    print(f"bf16 matmul 8192^3: {mm_tflops:.0f} TFLOP/s (the 'of mm' column's rate)", flush=True)
    rows: list[dict] = []
    path = args.json or (Path(os.environ["OUT"]) / "moe_sweep.json" if os.environ.get("OUT") else None)
    for tokens in (int(t) for t in args.tokens.split(",")):
        time_head_norms(tokens, rows)
        sweep_tokens(tokens, w, moe, mm_tflops, rows)
        if path:  # after each token count: a run cut short keeps what it measured
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "mm_tflops": mm_tflops, "rows": rows},
                                       indent=1))
    summarize(rows)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
