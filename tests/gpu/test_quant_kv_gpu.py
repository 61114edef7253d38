"""Quantized KV (int8, fp8 e4m3) on a GPU: the Triton kernels compiled, and the engine's CUDA graphs.

The kernels (store, decode and context attention) run compiled against their torch references:
the store writes the reference's bytes, attention agrees to the rounding of the model dtype. The
engine with ``kv_cache_dtype`` int8 or fp8_e4m3 captures its graphs (decode and mixed steps),
replays them, and its greedy tokens are scored by the CPU path with the same KV dtype: each
token must be the CPU's greedy choice in the same context (a near tie can flip where the GPU's
float32 rounding moves a value across a quantization boundary; the rates are printed).

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_quant_kv_gpu.py -s
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from kernels.attention import (
    context_attention_ref,
    context_attention_triton,
    decode_attention_ref,
    decode_attention_triton,
)
from kernels.kv_quant import quantize_rows, row_bytes
from kernels.store_kv import store_kv_ref, store_kv_triton
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import count_replays
from tests.kernels.test_kernels import CTX_LENS, Q_LENS, make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: float8 e4m3 codes need compute capability 8.9 (below it the kernels are not used for fp8).
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
KINDS = ["int8", "fp8_e4m3"] if FP8 else ["int8"]

PROMPT_LENS = [5, 17, 64, 129, 250, 333]
MAX_TOKENS = [6, 9, 12, 16, 20, 24]
#: Least share of the GPU's greedy tokens that are the CPU path's greedy choice in their context.
#: float32 differs from the CPU only by rounding, but a value that rounding moves across a code
#: boundary moves by a whole code (1/16 of its size in e4m3): on CPU, the same engine with the
#: interpreted kernels against the torch path flipped one fp8 near tie (logprobs 0.015 apart) in
#: 12 tokens and no int8 token. bfloat16 adds its own drift from the float32 CPU path.
MIN_AGREEMENT = {("int8", "float32"): 0.95, ("fp8_e4m3", "float32"): 0.9, ("int8", "bfloat16"): 0.75,
                 ("fp8_e4m3", "bfloat16"): 0.75}


# ---------------------------------------------------------------------------------------------
# Kernels, compiled
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_reference_bytes(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = (torch.randn(300, 8, 128, device="cuda", generator=gen) * 3).to(dtype)
    v = (torch.randn(300, 8, 128, device="cuda", generator=gen) * 0.01).to(dtype)
    slots = torch.randperm(1000, device="cuda", generator=gen)[:300]
    caches = [torch.full((1000, 8, row_bytes(128)), 255, dtype=torch.uint8, device="cuda") for _ in range(4)]
    store_kv_triton(k, v, caches[0], caches[1], slots, kind)
    store_kv_ref(k, v, caches[2], caches[3], slots, kind)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _quantized_batch(kind: str, dtype: torch.dtype, ctx_lens: list[int], q_lens: list[int], heads: tuple[int, int],
                     head_dim: int):
    batch = make_paged_batch(ctx_lens, q_lens, *heads, head_dim, layout="shuffled", dtype=dtype,
                             num_slots=sum(ctx_lens) + 64, seed=3)
    k_cache = quantize_rows(batch.k_cache.float().nan_to_num(0.0), kind).cuda()
    v_cache = quantize_rows(batch.v_cache.float().nan_to_num(0.0), kind).cuda()
    return batch, k_cache, v_cache


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Both read the same bytes: float32 agrees to its rounding, bfloat16 to its probabilities' and
    output's rounding."""
    rel = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    assert not torch.isnan(out).any()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 64])
def test_decode_attention_reads_quantized_kv_as_the_reference(kind: str, dtype: torch.dtype,
                                                              batch_size: int) -> None:
    # The 8B model's heads (32 q over 8 kv, head_dim 128): batch 1 reads its first tile before the
    # kernel's wait, batch 64 walks all its tiles after it.
    gen = torch.Generator().manual_seed(batch_size)
    ctx_lens = torch.randint(1, 700, (batch_size,), generator=gen).tolist()
    batch, k_cache, v_cache = _quantized_batch(kind, dtype, ctx_lens, [1] * batch_size, (32, 8), 128)
    args = (batch.q.cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    out = decode_attention_triton(*args, quant=kind)
    ref = decode_attention_ref(*args, quant=kind).to(dtype)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_context_attention_reads_quantized_kv_as_the_reference(kind: str, dtype: torch.dtype,
                                                               num_splits: int | None) -> None:
    lens = [n * 9 for n in CTX_LENS]
    batch, k_cache, v_cache = _quantized_batch(kind, dtype, lens, [n * 9 for n in Q_LENS[:-1]] + [4], (9, 3), 64)
    args = (batch.q.cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), batch.q_lens.cuda(),
            batch.q_start_loc.cuda(), 64**-0.5)
    out = context_attention_triton(*args, quant=kind, num_splits=num_splits)
    ref = context_attention_ref(*args, quant=kind).to(dtype)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("float16_codes", [True, False], ids=["q-float16", "q-bfloat16"])
def test_bfloat16_q_meets_the_codes_as_float16_or_bfloat16(kind: str, float16_codes: bool) -> None:
    # bfloat16 q taken as float16 in units of a power of two per row (the fp8 default) or kept, both
    # kernels, the 8B model's heads; q scaled far from 1 so a unit that went wrong shows.
    gen = torch.Generator().manual_seed(7)
    ctx_lens = torch.randint(1, 700, (16,), generator=gen).tolist()
    batch, k_cache, v_cache = _quantized_batch(kind, torch.bfloat16, ctx_lens, [1] * 16, (32, 8), 128)
    q = (batch.q.float() * torch.logspace(-3, 3, 32).view(1, 32, 1)).to(torch.bfloat16).cuda()
    args = (q, k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    out = decode_attention_triton(*args, quant=kind, float16_codes=float16_codes)
    _assert_close(out, decode_attention_ref(*args, quant=kind).to(torch.bfloat16), torch.bfloat16)
    ones = torch.ones(16, dtype=torch.int32, device="cuda")
    context_args = (*args[:5], ones, torch.arange(16, dtype=torch.int32, device="cuda"), args[5])
    out = context_attention_triton(*context_args, quant=kind, float16_codes=float16_codes)
    _assert_close(out, context_attention_ref(*context_args, quant=kind).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("values_float16", "ahead"), [(True, False), (False, False), (True, True)],
                         ids=["values-float16", "values-as-codes", "values-float16-read-ahead"])
def test_decode_values_float16_or_as_codes_and_read_ahead(kind: str, values_float16: bool, ahead: bool) -> None:
    # The decode kernel's value paths with q met as float16: codes converted as they load (PTX of
    # each kind) or met by the product as codes; a tile read ahead into registers; 8B heads.
    gen = torch.Generator().manual_seed(11)
    ctx_lens = torch.randint(1, 1500, (64,), generator=gen).tolist()
    batch, k_cache, v_cache = _quantized_batch(kind, torch.bfloat16, ctx_lens, [1] * 64, (32, 8), 128)
    args = (batch.q.cuda(), k_cache, v_cache, batch.slot_table.cuda(), batch.ctx_lens.cuda(), 128**-0.5)
    out = decode_attention_triton(*args, quant=kind, float16_codes=True, values_float16=values_float16,
                                  ahead=ahead, num_stages=1 if ahead else None, block_n=64 if ahead else None)
    _assert_close(out, decode_attention_ref(*args, quant=kind).to(torch.bfloat16), torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The engine, with CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _engine(model: Path, device: str, dtype: str, kind: str, **options) -> LLMEngine:
    config = EngineConfig(model=str(model), device=device, dtype=dtype, kv_cache_dtype=kind, max_total_tokens=8192,
                          max_running_requests=8, max_model_len=2048, **options)
    return LLMEngine(config)


def _generate_arriving(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers, each prompt arriving while the earlier ones decode: prefill chunks ride
    beside decode rows in mixed steps."""
    reqs = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reqs.append(eng.add_request(uuid.uuid4().hex, prompt, params))
        eng.step()
        eng.step()
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def _cpu_agreement(cpu: LLMEngine, prompts: list[list[int]], answers: list[list[int]]) -> tuple[int, int]:
    """How many answer tokens are the CPU engine's greedy choice given the prompt and the answer
    before them (each scored alone, so one flipped near tie costs one token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    reqs = [cpu.add_request(uuid.uuid4().hex, p + a, params) for p, a in zip(prompts, answers)]
    while cpu.has_unfinished():
        cpu.step()
    agree = total = 0
    for prompt, answer, req in zip(prompts, answers, reqs):
        ranks = req.prompt_logprobs.ranks[len(prompt) - 1:]  # entry i scores token i + 1
        assert len(ranks) == len(answer)
        agree += sum(r == 1 for r in ranks)
        total += len(answer)
    return agree, total


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_kv_runs_in_cuda_graphs_and_chooses_the_cpu_tokens(small_model, prompts, kind, dtype):
    eng = _engine(small_model, "cuda", dtype, kind)
    graphs = eng.runner.graphs
    assert graphs is not None, "CUDA graph capture failed with quantized KV"
    assert eng.pool.quant == kind and eng.pool.k_cache.dtype == torch.uint8
    replays = count_replays(eng)
    answers = _generate_arriving(eng, prompts)
    assert [len(a) for a in answers] == MAX_TOKENS
    mixed = [(s, rows) for s, rows in replays if s.tokens]
    decode = [s for s, _ in replays if not s.tokens]
    assert any(rows for _, rows in mixed), "no mixed step (decode rows beside a prefill chunk) replayed"
    assert len(decode) >= min(MAX_TOKENS) - 1
    agree, total = _cpu_agreement(_engine(small_model, "cpu", "float32", kind), prompts, answers)
    rate = agree / total
    print(f"--kv-cache-dtype {kind} {dtype} on the GPU with graphs: {agree}/{total} greedy tokens are the CPU "
          f"path's ({rate:.1%}); {len(decode)} decode and {len(mixed)} mixed replays")
    assert rate >= MIN_AGREEMENT[kind, dtype]


@pytest.fixture(scope="module")
def head128_model(tmp_path_factory, tokenizer_dir) -> Path:
    """Random weights of a small shape with heads of 128 (4 q heads over 1 kv head): the head size
    the direct fp8 decode kernel (:mod:`kernels.attention_decode_direct`) serves."""
    from pd_cluster.bench.random_model import write_random_model

    return write_random_model("tiny-head128", tmp_path_factory.mktemp("models") / "tiny-head128", tokenizer_dir)


@pytest.mark.skipif(not FP8, reason="fp8 KV needs compute capability 8.9")
def test_the_direct_fp8_decode_kernel_serves_the_engine_in_graphs_and_chooses_the_cpu_tokens(head128_model, prompts,
                                                                                            monkeypatch):
    import kernels.attention_decode as decode

    launches: list[int] = []
    direct = decode.decode_split_direct

    def counted(*args, **kwargs):
        launches.append(1)
        return direct(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_split_direct", counted)
    eng = _engine(head128_model, "cuda", "bfloat16", "fp8_e4m3")
    assert eng.runner.graphs is not None, "CUDA graph capture failed"
    answers = _generate_arriving(eng, prompts)
    assert [len(a) for a in answers] == MAX_TOKENS
    assert launches, "the direct kernel did not serve the decode steps"
    agree, total = _cpu_agreement(_engine(head128_model, "cpu", "float32", "fp8_e4m3"), prompts, answers)
    print(f"direct fp8 decode kernel in the engine (bfloat16, graphs): {agree}/{total} greedy tokens are the CPU "
          f"path's ({agree / total:.1%}); {len(launches)} launches captured or run")
    assert agree / total >= MIN_AGREEMENT["fp8_e4m3", "bfloat16"]
