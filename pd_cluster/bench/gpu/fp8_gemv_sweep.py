"""A sweep of the one-row 8-bit GEMV's load shapes over Llama-3-8B's projections, each as a decode
layer calls it (the norm before qkv and gate/up, the SiLU gate before down, o plain), bf16 beside.

What it varies is what sets a memory-bound kernel's rate: the bytes each SM keeps in flight. Per
config: the tile (BN output channels by BK inputs), warps, ``stream`` (the next block's load
issued before this block's products) and ``vec``, the codes a thread loads at once: 16 (one
16-byte load, but a layout the input's bf16 loads do not share, so the input goes through shared
memory every block) or 8 (8-byte loads in the input's own layout, as the bf16 GEMV runs); and
``f16``, the products in float16 pairs (the codes as words, converted where multiplied). Each
config is timed in a CUDA graph over weight copies three times L2 (as
:mod:`pd_cluster.bench.gpu.fp8_sweep`); a line gives us and TB/s of weight bytes read. A device
copy's rate is measured first, the ceiling the rates compare to. Last: the best config per shape
against bf16's and the configs chosen now, and one layer's four projections summed. The JSON goes
to ``$OUT/fp8_gemv_sweep.json`` (``--json`` elsewhere).

    python -m pd_cluster.bench.gpu.fp8_gemv_sweep [--shapes gate_up,down,qkv,o] [--budget S] [--wide]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.gemv import quant_projection_config, quant_projection_loads
from pd_cluster.bench.gpu.fp8_decode_sweep import PROLOGUE, fused_call
from pd_cluster.bench.gpu.fp8_sweep import SHAPES, copies, graph_us
from pd_cluster.model.quant_linear import quantize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gemv8Config:
    """One launch config of the one-row 8-bit GEMV."""

    bn: int
    bk: int
    warps: int = 4
    stream: bool = False
    vec: int = 8
    f16: bool = False

    def label(self) -> str:
        how = "s" if self.stream else "b"
        return f"({self.bn},{self.bk}) w{self.warps} {how} v{self.vec}{' f16' if self.f16 else ''}"

    def options(self, k: int) -> dict:
        return {"tiles": (1, self.bn, min(self.bk, k)), "num_warps": self.warps, "stream": self.stream,
                "vec": self.vec, "f16": self.f16}


C = Gemv8Config
#: Candidates by the row's length (4096 or longer), most likely first (should the run be cut short):
#: "b" blocks carried in registers, "s" streamed; "f16" products in float16 pairs.
CANDIDATES = {
    True: [C(4, 4096, 8, f16=True), C(8, 4096, 8, f16=True), C(16, 4096, 8, f16=True), C(4, 1024, f16=True),
           C(8, 4096, 16, f16=True), C(4, 1024, stream=True, f16=True), C(2, 4096, 8, f16=True),
           C(4, 2048, 8, f16=True), C(16, 4096, 16, f16=True), C(8, 1024, f16=True), C(4, 4096, 8, vec=16, f16=True),
           C(2, 4096, 4, f16=True), C(8, 2048, 8, f16=True)],
    False: [C(16, 512, 4, True, f16=True), C(32, 512, 8, True, f16=True), C(8, 512, 4, True, f16=True),
            C(16, 1024, 8, True, f16=True), C(32, 512, 4, True, f16=True), C(16, 512, 4, False, f16=True),
            C(8, 1024, 4, True, f16=True), C(16, 2048, 8, True, f16=True), C(16, 512, 4, True, 16, f16=True),
            C(4, 1024, 4, True, f16=True)],
}
#: More channels a program over more warps. One row's 8-bit products are bound by instructions
#: before bytes: the sm_90 builds' instructions per KB of weights order the sweep's times (norm +
#: gate/up: 260 warp instructions a KB on (4, 4096) over 8 warps, 40.0 us; 338 on (8, 512) streamed,
#: 47.4; 437 on (4, 1024), 54.2), and bf16's GEMV at 4 TB/s issues as many a cycle. A program's
#: prologue (the norm: the input read, summed and scaled; the SiLU gate) costs as many
#: instructions as its products at 4 channels: wider programs share it over more bytes, at fewer
#: programs an SM.
WIDE = {
    True: [C(8, 4096, 8), C(16, 4096, 16), C(8, 4096, 16)],
    False: [C(32, 512, 8, True), C(16, 512, 8, True)],
}
ORDER = ["gate_up", "down", "qkv", "o"]
#: Each shape's share of the time budget (qkv reuses gate_up's compiled kernels: the same prologue).
SHARE = {"gate_up": 0.35, "down": 0.3, "qkv": 0.1, "o": 0.25}


@dataclass
class Line:
    shape: str
    path: str
    config: str
    us: float
    tb_per_s: float


def copy_tb_per_s(nbytes: int = 1 << 30) -> float:
    """A device-to-device copy's rate, bytes read and written (the ceiling of a streaming kernel)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)])
    del src, dst
    return 2 * nbytes / us / 1e6


def time_line(out: list[Line], shape: str, path: str, config: str, calls: list, nbytes: int) -> None:
    try:
        us = graph_us(calls)
    except Exception as exc:  # noqa: BLE001  # a config past the device's resources: shown, not fatal
        logger.warning("%s %s %s failed: %s", shape, path, config, str(exc)[:300])
        torch.cuda.synchronize()
        return
    out.append(Line(shape, path, config, us, nbytes / us / 1e6))
    print(f"{shape:8s} {path:10s} {config:28s} {us:8.2f} us {nbytes / us / 1e6:6.2f} TB/s", flush=True)


def sweep_shape(out: list[Line], name: str, n: int, k: int, budget_s: float, wide: bool = False) -> None:
    """bf16 as the layer calls it, fp8 as chosen now, then each candidate while ``budget_s`` lasts."""
    deadline = time.monotonic() + budget_s
    w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    fp8, bf16 = copies(quantize(w16, "fp8")), copies(w16)
    del w16
    call = fused_call(name, n, k)
    time_line(out, name, "bf16", "default", [lambda w=w: call(w) for w in bf16], 2 * n * k)
    del bf16
    (_, bn, bk), warps = quant_projection_config(1, n, k, PROLOGUE[name])
    loads = quant_projection_loads(1, n, k, PROLOGUE[name])
    stream = loads.get("stream", True) and k > bk
    now = [Gemv8Config(bn, bk, warps, stream, loads.get("vec", 16), bool(loads.get("f16", False)))]
    for cfg in now + [c for c in (WIDE if wide else CANDIDATES)[k <= 4096] if c not in now]:
        if cfg not in now and time.monotonic() > deadline:  # the chosen config always runs
            print(f"{name}: out of time before {cfg.label()} and the rest", flush=True)
            break
        path = "fp8 now" if cfg in now else "fp8"
        time_line(out, name, path, cfg.label(), [lambda q=q, c=cfg: call(q.qweight, q.scale, **c.options(k))
                                                 for q in fp8], n * k)
    del fp8
    torch.cuda.empty_cache()


def summary(lines: list[Line]) -> dict:
    """Per shape: bf16, the config chosen now and the best; then one layer's sums."""
    table = {}
    for name in ORDER:
        here = [t for t in lines if t.shape == name]
        if not here:
            continue
        pick = {p: min((t for t in here if t.path.startswith(p)), key=lambda t: t.us, default=None)
                for p in ("bf16", "fp8 now", "fp8")}
        table[name] = {p: asdict(t) for p, t in pick.items() if t is not None}
    layer = {p: round(sum(row[p]["us"] for row in table.values()), 2) for p in ("bf16", "fp8 now", "fp8")
             if all(p in row for row in table.values())}
    return {"shapes": table, "layer_us": layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(ORDER))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds for all shapes' candidates")
    parser.add_argument("--wide", action="store_true", help="the wide programs (WIDE) instead of the candidates")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    path = args.json or (Path(os.environ["OUT"]) / "fp8_gemv_sweep.json" if os.environ.get("OUT") else None)
    copy_rate = copy_tb_per_s()
    print(f"device: {torch.cuda.get_device_name()}  copy {copy_rate:.2f} TB/s (read + written)", flush=True)
    dims = {name: (n, k) for name, n, k in SHAPES}
    lines: list[Line] = []
    for name in args.shapes.split(","):
        sweep_shape(lines, name, *dims[name], args.budget * SHARE[name], args.wide)
        if path is not None:
            path.write_text(json.dumps({"partial": True, "copy_tb_per_s": copy_rate,
                                        "lines": [asdict(t) for t in lines]}))
    result = summary(lines)
    print(f"\n{'shape':8s} {'bf16 us':>8s} {'now us':>8s} {'best us':>8s} {'best/bf16':>9s} {'best/now':>8s} "
          f"{'TB/s':>5s} (copy {copy_rate:.2f})  best config")
    for name, row in result["shapes"].items():
        b, now, top = row.get("bf16"), row.get("fp8 now"), row.get("fp8")
        if not (b and now and top):
            continue
        top = min(top, now, key=lambda t: t["us"])
        print(f"{name:8s} {b['us']:8.2f} {now['us']:8.2f} {top['us']:8.2f} {top['us'] / b['us']:9.3f} "
              f"{top['us'] / now['us']:8.3f} {top['tb_per_s']:5.2f}  {top['config']}")
    print("layer (us):", result["layer_us"])
    if path is not None:
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_tb_per_s": copy_rate,
                                    "timing": "cuda graph, cold weights", "lines": [asdict(t) for t in lines],
                                    **result}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
