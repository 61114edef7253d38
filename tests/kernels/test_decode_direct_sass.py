"""The direct fp8 decode kernel compiled for sm_90 without a GPU (Triton's own ptxas and
cuobjdump): what its design rests on shows in the machine code of the key loop. Each tile's keys
and values arrive in 16-byte loads and meet the tensor cores with no shared memory between (the
relabelled ``head_dim`` makes the loaded registers the products' operands: a layout that was not
would compile to shared-memory stores and loads, or fail the trivial-conversion assertion), and
nothing spills. The numbers it computes are checked on a GPU (tests/gpu/test_decode_direct_gpu.py).
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import pytest

from kernels import attention_decode_direct as direct

pytestmark = pytest.mark.skipif(not direct.HAS_GLUON, reason="needs Triton with Gluon (3.6+)")

ARGS = ("q_ptr k_ptr v_ptr table_ptr ctx_lens_ptr rows_ptr part_out_ptr part_lse_ptr scale_log2 stride_qb "
        "stride_qh stride_s stride_h stride_table stride_pb stride_ph stride_ps stride_lb stride_lh").split()
TYPES = ["*bf16", "*u8", "*u8", "*i32", "*i32", "*i32", "*fp32", "*fp32", "fp32"] + ["i32"] * 10
ALIGNED = {"q_ptr", "k_ptr", "v_ptr", "table_ptr", "ctx_lens_ptr", "rows_ptr", "part_out_ptr", "part_lse_ptr",
           "stride_qb", "stride_qh", "stride_s", "stride_h", "stride_table", "stride_pb", "stride_ph", "stride_ps",
           "stride_lb"}


def _sass(tmp_path: Path, group: int) -> tuple[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = {"GROUP": group, "NUM_SPLITS": 4, "BLOCK": direct.BLOCK_N, "HAS_ROWS": True, "USE_PDL": True,
                 "DEPENDENTS_EARLY": direct.DEPENDENTS_EARLY}
    signature = dict(zip(ARGS, TYPES)) | {name: "constexpr" for name in constants}
    attrs = {(ARGS.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    source = GluonASTSource(direct._decode_split_direct_kernel, signature, constants, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return sass, usage


def _loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (with their width suffixes) of the kernel's one backward branch's body: the key loop."""
    code = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*([^;]*);", sass)]
    at = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) < address:
            loops.append(code[at[int(branch[1], 16)]:i + 1])
    assert len(loops) == 1, f"expected one loop, found {len(loops)}"
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for _, text in loops[0])


@pytest.mark.parametrize("group", [1, 4, 8])
def test_the_key_loop_loads_16_bytes_at_a_time_into_the_products_registers(tmp_path: Path, group: int) -> None:
    sass, usage = _sass(tmp_path, group)
    ops = _loop_opcodes(sass)
    keys = direct.BLOCK_N
    # keys x 128 bytes of keys and of values over 32 threads, 16 bytes a load.
    assert ops["LDG.E.128"] == 2 * keys * 128 // 32 // 16, ops
    assert not [op for op in ops if op.startswith(("STS", "LDS", "LDSM", "BAR"))], ops
    # Scores (16 x keys over 128: 8 x keys / 8 products of 16 x 8 x 16) and values (128 x 8 over
    # keys: 8 x keys / 16).
    assert sum(n for op, n in ops.items() if op.startswith("HMMA.16816")) == keys + keys // 2, ops
    # The codes convert in pairs: 2 x keys x 128 codes over 32 threads, two a conversion.
    assert ops["F2FP.F16.E4M3.UNPACK_B"] == 2 * keys * 128 // 32 // 2, ops
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
