"""A probe of what bounds the one-row 8-bit GEMV: one plain kernel (no prologue) over the 8B's
gate/up and down weights, its code -> float conversion in variants, cold weights in CUDA graphs.

Variants (same loop: the next block's codes loaded before this block's products, products added
elementwise into a wide accumulator, one reduction at the end):
  f32   codes .to(float32) (Triton's conversion), FFMA a code        (the float32 products)
  ipipe codes -> float32 bits on the integer pipes (inline asm), FFMA a code
  hf8   codes -> f16x2 (cvt / prmt), HFMA2 over runs of 8 codes, 2 f32 out per run
  hf16  as hf8 over runs of 16 codes (pack 4)
  read  the same bytes loaded and summed as integers (the ceiling)
Also the projection's fused op as chosen now (:mod:`kernels.gemv`). Each line: us, TB/s of codes,
the error against a float32 product, static SASS instructions a code (nvdisasm). Measured on an
H200 (``gemv8-probe-nvidia-h200-x1-2026-11-29.json``): gate/up's tile read its codes at the copy
rate whatever the conversion (f32 28.5 us, hf16 28.3, read 28.2) while the fused op took 40.8: its
prologue, not the conversion, bounds it; down's streamed tile gained from float16 pairs (f32 26.2,
hf8 22.9, read 22.6), whose words hold a quarter of float32's registers; ipipe was slower on both.

    python -m pd_cluster.bench.gpu.gemv8_probe   # GEMV8_PROBE_BUDGET=s, GEMV8_PROBE_INT8=1
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
import triton.language as tl

from pd_cluster.bench.gpu.fp8_sweep import copies, graph_us
from pd_cluster.model.quant_linear import quantize

OUT = os.environ.get("OUT", ".")
T0 = time.time()
BUDGET = float(os.environ.get("GEMV8_PROBE_BUDGET", "120"))


@triton.jit
def pack_f16x2(x, y):
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [x, y], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def act_words(a):
    """[BK] float32 -> ([BK/4], [BK/4]) int32: f16x2 of (a0, a1) and (a2, a3) of each 4 inputs."""
    BK: tl.constexpr = a.shape[0]
    e, o = tl.split(tl.reshape(a, (BK // 4, 2, 2)))
    e0, e2 = tl.split(e)
    o1, o3 = tl.split(o)
    return pack_f16x2(e0, o1), pack_f16x2(e2, o3)


@triton.jit
def fp8_f16_dot8(w, p01, p23):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 c0, c1, c2, c3; .reg .b32 h0, h1, h2, h3, acc; .reg .f16 l, h; "
        "mov.b32 {c0, c1}, $2; mov.b32 {c2, c3}, $3; "
        "cvt.rn.f16x2.e4m3x2 h0, c0; cvt.rn.f16x2.e4m3x2 h1, c1; cvt.rn.f16x2.e4m3x2 h2, c2; "
        "cvt.rn.f16x2.e4m3x2 h3, c3; "
        "mul.rn.f16x2 acc, h0, $4; fma.rn.f16x2 acc, h1, $6, acc; fma.rn.f16x2 acc, h2, $5, acc; "
        "fma.rn.f16x2 acc, h3, $7, acc; mov.b32 {l, h}, acc; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=f,=f,r,r,r,r,r,r", [w, p01, p23], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def fp8_f16_dot16(w, p01, p23):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 c<8>; .reg .b32 h<8>, acc, acd; .reg .f16 l, h, m, n; .reg .f32 x, y; "
        "mov.b32 {c0, c1}, $4; mov.b32 {c2, c3}, $5; mov.b32 {c4, c5}, $6; mov.b32 {c6, c7}, $7; "
        "cvt.rn.f16x2.e4m3x2 h0, c0; cvt.rn.f16x2.e4m3x2 h1, c1; cvt.rn.f16x2.e4m3x2 h2, c2; "
        "cvt.rn.f16x2.e4m3x2 h3, c3; cvt.rn.f16x2.e4m3x2 h4, c4; cvt.rn.f16x2.e4m3x2 h5, c5; "
        "cvt.rn.f16x2.e4m3x2 h6, c6; cvt.rn.f16x2.e4m3x2 h7, c7; "
        "mul.rn.f16x2 acc, h0, $8; fma.rn.f16x2 acc, h1, $12, acc; fma.rn.f16x2 acc, h2, $9, acc; "
        "fma.rn.f16x2 acc, h3, $13, acc; "
        "mul.rn.f16x2 acd, h4, $10; fma.rn.f16x2 acd, h5, $14, acd; fma.rn.f16x2 acd, h6, $11, acd; "
        "fma.rn.f16x2 acd, h7, $15, acd; "
        "mov.b32 {l, h}, acc; mov.b32 {m, n}, acd; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; cvt.f32.f16 $2, m; "
        "cvt.f32.f16 $3, n; }",
        "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r", [w, p01, p23], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def i8_f16_dot8(w, p01, p23):
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u, a, b, c, d, m, acc; .reg .f16 l, h; mov.b32 m, 0x64806480; "
        "xor.b32 t, $2, 0x80808080; xor.b32 u, $3, 0x80808080; "
        "prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342; "
        "prmt.b32 c, u, 0x64646464, 0x4140; prmt.b32 d, u, 0x64646464, 0x4342; "
        "sub.f16x2 a, a, m; sub.f16x2 b, b, m; sub.f16x2 c, c, m; sub.f16x2 d, d, m; "
        "mul.rn.f16x2 acc, a, $4; fma.rn.f16x2 acc, b, $6, acc; fma.rn.f16x2 acc, c, $5, acc; "
        "fma.rn.f16x2 acc, d, $7, acc; mov.b32 {l, h}, acc; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=f,=f,r,r,r,r,r,r", [w, p01, p23], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def act_split(a):
    """[BK] -> four [BK/4]: the inputs of each code word's bytes 0..3."""
    BK: tl.constexpr = a.shape[0]
    e, o = tl.split(tl.reshape(a, (BK // 4, 2, 2)))
    a0, a2 = tl.split(e)
    a1, a3 = tl.split(o)
    return a0, a1, a2, a3


@triton.jit
def fp8_f32_bits(w):
    """int32 words of 4 e4m3 codes -> 4 float32 of value * 2**-120 (sign to bit 31, 7 bits under the exponent)."""
    f0, f1, f2, f3 = tl.inline_asm_elementwise(
        "{ .reg .b32 p, q, r; prmt.b32 p, $4, 0, 0x9180; prmt.b32 q, $4, 0, 0xB3A2; "
        "shl.b32 r, p, 20; and.b32 $0, r, 0x87F00000; shl.b32 r, p, 4; and.b32 $1, r, 0x87F00000; "
        "shl.b32 r, q, 20; and.b32 $2, r, 0x87F00000; shl.b32 r, q, 4; and.b32 $3, r, 0x87F00000; }",
        "=f,=f,=f,=f,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return f0, f1, f2, f3


@triton.jit
def i8_f32(w):
    """int32 words of 4 int8 codes -> 4 float32: flipped to 128 + code under 2**23's exponent, one FADD."""
    f0, f1, f2, f3 = tl.inline_asm_elementwise(
        "{ .reg .b32 t, f; xor.b32 t, $4, 0x80808080; "
        "prmt.b32 f, t, 0x4B000000, 0x7654; sub.f32 $0, f, 0f4B000080; "
        "prmt.b32 f, t, 0x4B000000, 0x7651; sub.f32 $1, f, 0f4B000080; "
        "prmt.b32 f, t, 0x4B000000, 0x7652; sub.f32 $2, f, 0f4B000080; "
        "prmt.b32 f, t, 0x4B000000, 0x7653; sub.f32 $3, f, 0f4B000080; }",
        "=f,=f,=f,=f,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return f0, f1, f2, f3


@triton.jit
def word_products(w, a, inv_unit, MODE: tl.constexpr, IS_FP8: tl.constexpr):
    """[BN, BK/4] float32 partial sums of code words ``w`` with the inputs ``a`` [BK]."""
    if MODE == 1:
        a0, a1, a2, a3 = act_split(a)
        if IS_FP8:
            f0, f1, f2, f3 = fp8_f32_bits(w)
            s = 18446744073709551616.0  # 2**64 (times the 2**56 at the end: the codes' 2**-120)
            out = f0 * (a0 * s)[None, :] + f1 * (a1 * s)[None, :] + f2 * (a2 * s)[None, :] + f3 * (a3 * s)[None, :]
        else:
            f0, f1, f2, f3 = i8_f32(w)
            out = f0 * a0[None, :] + f1 * a1[None, :] + f2 * a2[None, :] + f3 * a3[None, :]
    else:
        p01, p23 = act_words(a * inv_unit)
        if MODE == 3:
            out = fp8_f16_dot16(w, p01[None, :], p23[None, :])
        elif IS_FP8:
            out = fp8_f16_dot8(w, p01[None, :], p23[None, :])
        else:
            out = i8_f16_dot8(w, p01[None, :], p23[None, :])
    return out


@triton.jit
def probe_kernel(w_ptr, x_ptr, s_ptr, o_ptr, N, K, unit, inv_unit, MODE: tl.constexpr, IS_FP8: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr, ONE: tl.constexpr):
    # MODE 0 f32, 1 ipipe, 2 hf8, 3 hf16, 4 read
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nm = rn < N
    if MODE >= 1:
        BW: tl.constexpr = BK // 4
        wp = w_ptr.to(tl.pointer_type(tl.int32))
        rw = tl.max_contiguous(tl.arange(0, BW), VEC // 4)
        w = tl.load(wp + rn[:, None] * (K // 4) + rw[None, :], mask=nm[:, None], other=0, eviction_policy="evict_first")
        if MODE == 4:
            if ONE:
                acc = tl.sum(w, axis=1).to(tl.float32)
            else:
                wide_i = tl.zeros((BN, BW), dtype=tl.int32)
                for k0 in range(0, K, BK):
                    w_next = tl.load(wp + rn[:, None] * (K // 4) + (k0 + BK) // 4 + rw[None, :],
                                     mask=nm[:, None] & (k0 + BK + rw[None, :] * 4 < K), other=0,
                                     eviction_policy="evict_first")
                    wide_i += w
                    w = w_next
                acc = tl.sum(wide_i, axis=1).to(tl.float32)
        else:
            if ONE:
                a = tl.load(x_ptr + tl.arange(0, BK)).to(tl.float32)
                acc = tl.sum(word_products(w, a, inv_unit, MODE, IS_FP8), axis=1)
            else:
                wide = tl.zeros((BN, BW), dtype=tl.float32)
                for k0 in range(0, K, BK):
                    w_next = tl.load(wp + rn[:, None] * (K // 4) + (k0 + BK) // 4 + rw[None, :],
                                     mask=nm[:, None] & (k0 + BK + rw[None, :] * 4 < K), other=0,
                                     eviction_policy="evict_first")
                    a = tl.load(x_ptr + k0 + tl.arange(0, BK)).to(tl.float32)
                    wide += word_products(w, a, inv_unit, MODE, IS_FP8)
                    w = w_next
                acc = tl.sum(wide, axis=1)
            if MODE == 1 and IS_FP8:
                acc = acc * 72057594037927936.0  # 2**56
            else:
                acc = acc * unit
    else:
        rk0 = tl.max_contiguous(tl.arange(0, BK), VEC)
        w = tl.load(w_ptr + rn[:, None] * K + rk0[None, :], mask=nm[:, None], other=0.0, eviction_policy="evict_first")
        if ONE:
            a = tl.load(x_ptr + tl.arange(0, BK)).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        else:
            wide = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(0, K, BK):
                w_next = tl.load(w_ptr + rn[:, None] * K + k0 + BK + rk0[None, :],
                                 mask=nm[:, None] & (k0 + BK + rk0[None, :] < K), other=0.0, eviction_policy="evict_first")
                a = tl.load(x_ptr + k0 + tl.arange(0, BK)).to(tl.float32)
                wide += w.to(tl.float32) * a[None, :]
                w = w_next
            acc = tl.sum(wide, axis=1)
    acc = acc * tl.load(s_ptr + rn, mask=nm, other=0.0)
    tl.store(o_ptr + rn, acc.to(o_ptr.dtype.element_ty), mask=nm)


MODES = {"f32": 0, "ipipe": 1, "hf8": 2, "hf16": 3, "read": 4}
NVD = None
for cand in [os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")]:
    if os.path.exists(cand):
        NVD = cand


def sass_per_code(kernel, codes_per_thread):
    if NVD is None or kernel is None:
        return {}
    try:
        f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
        f.write(kernel.asm["cubin"]); f.close()
        sass = subprocess.run([NVD, "-c", f.name], capture_output=True, text=True).stdout
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)[:100]}
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2)] += 1
    return {"total": sum(ops.values()), "top": dict(ops.most_common(12))}


results = []


def run(shape, n, k, method, mode, bn, bk, warps, vec, qs, x, outbuf, stages=1):
    label = f"{shape} {method} {mode} ({bn},{bk}) w{warps}"
    if time.time() - T0 > BUDGET:
        print("out of time:", label, flush=True)
        return
    grid = (triton.cdiv(n, bn),)
    kern = [None]

    def call(q):
        kern[0] = probe_kernel[grid](q.qweight, x, q.scale, outbuf, n, k, 1.0, 1.0, MODE=MODES[mode],
                                     IS_FP8=method == "fp8", BN=bn, BK=bk, VEC=vec, ONE=k <= bk, num_warps=warps, num_stages=stages)
    try:
        us = graph_us([lambda q=q: call(q) for q in qs])
    except Exception as exc:  # noqa: BLE001
        print(f"{label}: FAILED {str(exc)[:400]}", flush=True)
        torch.cuda.synchronize()
        return
    ref = (x.float() @ qs[0].qweight.float().t()) * qs[0].scale
    call(qs[0]); torch.cuda.synchronize()
    rel = float((outbuf.float() - ref).norm() / ref.norm()) if mode != "read" else float("nan")
    try:
        sass = sass_per_code(kern[0], bn * bk // (32 * warps))
    except Exception:  # noqa: BLE001
        sass = {}
    tb = n * k / us / 1e6
    per_code = (sass.get("total", 0) / (bn * min(bk, k) / (32 * warps))) if sass.get("total") else float("nan")
    results.append({"shape": shape, "method": method, "mode": mode, "bn": bn, "bk": bk, "warps": warps, "us": us,
                    "tb_per_s": tb, "rel": rel, "sass_static_per_code": per_code, "sass": sass})
    print(f"{label:40s} {us:8.2f} us {tb:5.2f} TB/s rel {rel:.1e} sass/code(static) {per_code:5.2f} "
          f"{sass.get('top', {})}", flush=True)


def real(shape, n, k, method, qs, prologue):
    from kernels.gemv import linear_triton, norm_linear_triton, silu_linear_triton
    from kernels.gemv import quant_projection_config, quant_projection_loads
    if prologue == 2:
        gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        call = lambda q: silu_linear_triton(gu, q.qweight, q.scale)  # noqa: E731
    else:
        xx = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        res, nw = torch.randn_like(xx), torch.ones(k, device="cuda", dtype=torch.bfloat16)
        call = lambda q: norm_linear_triton(xx, res, nw, 1e-5, q.qweight, weight_scale=q.scale)  # noqa: E731
    xx = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for name, c in (("real fused", call),):
        us = graph_us([lambda q=q: c(q) for q in qs])
        cfg = quant_projection_config(1, n, k, prologue if name == "real fused" else 0)
        loads = quant_projection_loads(1, n, k, prologue if name == "real fused" else 0)
        results.append({"shape": shape, "method": method, "mode": name, "us": us, "tb_per_s": n * k / us / 1e6,
                        "config": str(cfg) + str(loads)})
        print(f"{shape} {method} {name:10s} {str(cfg) + str(loads):40s} {us:8.2f} us {n * k / us / 1e6:5.2f} TB/s",
              flush=True)


def main():
    torch.manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
    cu = graph_us([lambda: dst.copy_(src)]); del src, dst
    print(f"device {torch.cuda.get_device_name()} copy {2 * (1 << 30) / cu / 1e6:.2f} TB/s (read+write)", flush=True)
    plan = [
        # shape, n, k, prologue, (bn, bk, warps, vec)
        ("gate_up", 28672, 4096, 1, (4, 4096, 8, 8)),
        ("down", 4096, 14336, 2, (16, 512, 4, 8)),
    ]
    for method in ("fp8", "int8") if os.environ.get("GEMV8_PROBE_INT8") == "1" else ("fp8",):
        data = {}
        for shape, n, k, prologue, tile in plan:
            w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            data[shape] = (copies(quantize(w16, method)), torch.randn(1, k, device="cuda", dtype=torch.bfloat16),
                           torch.empty(n, device="cuda", dtype=torch.float32))
            del w16
        modes = ["real", "f32", "hf8", "read", "hf16", "ipipe"] if method == "fp8" else ["real", "f32", "hf8", "ipipe"]
        for mode in modes:
            for shape, n, k, prologue, (bn, bk, warps, vec) in plan:
                qs, x, outbuf = data[shape]
                if mode == "real":
                    try:
                        real(shape, n, k, method, qs, prologue)
                    except Exception as exc:  # noqa: BLE001
                        print("real kernel failed:", str(exc)[:300], flush=True)
                    continue
                run(shape, n, k, method, mode, bn, bk, warps, 16 if mode == "hf16" else vec, qs, x, outbuf)
            json.dump(results, open(os.path.join(OUT, "gemv8_probe.json"), "w"), indent=1)
        del data
        torch.cuda.empty_cache()
    print("\n--- summary (us, TB/s of codes) ---")
    for r in results:
        print(f"{r['shape']:8s} {r['method']:5s} {r['mode']:11s} {str((r.get('bn'), r.get('bk'), r.get('warps'))):16s} "
              f"{r['us']:8.2f} {r['tb_per_s']:5.2f}  sass/code {r.get('sass_static_per_code', float('nan')):.2f}")
    json.dump(results, open(os.path.join(OUT, "gemv8_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
