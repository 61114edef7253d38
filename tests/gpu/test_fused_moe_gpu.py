"""The fused routed experts compiled on the GPU: bfloat16 (and 8-bit) against the torch reference
at the Qwen3-30B-A3B layer shape, a captured CUDA graph replaying new inputs, and a tiny Qwen3-MoE
engine's greedy tokens with CUDA graphs equal to its tokens without.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py -s
"""

from __future__ import annotations

import uuid

import pytest
import torch

from kernels.fused_moe import MoeGemmConfig, align_ref, fused_moe_triton
from kernels.moe_align import align_chunked
from kernels.moe_route import route_topk_ref, route_topk_triton
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.model.config import MoEConfig
from pd_cluster.model.moe import route, routed_experts, routed_experts_ref
from pd_cluster.model.quant_linear import quantize
from pd_cluster.model.weights import ExpertWeights
from pd_cluster.sampling_params import SamplingParams
from tests.family_models import write_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: bfloat16: the reference rounds each expert's output and adds them in bfloat16; the kernel sums
#: a token's outputs in float32 (relative error of the whole output, by its norm).
BF16_REL = 1.5e-2


def _experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").mul_(scale).to(torch.bfloat16)

    return ExpertWeights(normal(num_experts, hidden, scale=0.05), normal(num_experts, 2 * inter, hidden, scale=0.02),
                         normal(num_experts, hidden, inter, scale=0.02))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 4096])
def test_bf16_fused_matches_the_reference_at_the_qwen3_30b_layer_shape(tokens: int) -> None:
    w = _experts(128, 2048, 768)
    moe = MoEConfig(128, 8, 768, True, frozenset({0}))
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    experts, weights = route(x, w.router, moe)
    got = fused_moe_triton(x, w.gate_up, w.down, experts, weights, 128)
    assert _rel(got, routed_experts_ref(x, w, moe, experts, weights)) <= BF16_REL


@pytest.mark.parametrize("config", [
    MoeGemmConfig(64, 128, 64, 4, 4, group_m=8, interleaved=True, sorted_rows=True),
    MoeGemmConfig(128, 128, 64, 8, 4, group_m=16, sorted_rows=True, tma=True),
    MoeGemmConfig(64, 64, 64, 4, 3),
])
def test_prompt_tile_configs_match_the_reference(config: MoeGemmConfig) -> None:
    w = _experts(128, 2048, 768, seed=3)
    moe = MoEConfig(128, 8, 768, True, frozenset({0}))
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    experts, weights = route(x, w.router, moe)
    got = fused_moe_triton(x, w.gate_up, w.down, experts, weights, 128, configs=(config, config))
    assert _rel(got, routed_experts_ref(x, w, moe, experts, weights)) <= BF16_REL


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fused_router_picks_the_experts_torch_picks(tokens: int) -> None:
    w = _experts(128, 2048, 768, seed=4)
    logits = torch.nn.functional.linear(torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16), w.router)
    experts, weights = route_topk_triton(logits, 8, True, torch.bfloat16)
    want_experts, want_weights = route_topk_ref(logits, 8, True, torch.bfloat16)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # bfloat16 logits tie: an expert of the same probability at each rank is the same choice.
    assert torch.equal(probs.gather(1, experts), probs.gather(1, want_experts))
    torch.testing.assert_close(weights, want_weights, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("tokens", [64, 4096])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_triton_alignment_equals_the_torch_ops(tokens: int, block_m: int) -> None:
    probs = torch.rand(tokens, 128, device="cuda") ** 4  # uneven loads
    experts = torch.topk(probs, 8, dim=-1).indices
    want = align_ref(experts, 128, block_m)
    got = align_chunked(experts, 128, block_m)
    for field in ("pairs", "block_experts", "num_padded"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [5, 2048])  # 2048 x top 4: the long-prompt tiles
def test_eight_bit_experts_match_the_reference(method: str, tokens: int) -> None:
    w = _experts(16, 1024, 512, seed=1)
    q = ExpertWeights(w.router, quantize(w.gate_up, method), quantize(w.down, method))
    moe = MoEConfig(16, 4, 512, False, frozenset({0}))
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    experts, weights = route(x, q.router, moe)
    got = fused_moe_triton(x, q.gate_up, q.down, experts, weights, 16)
    # The fused kernels multiply bf16 activations by the 8-bit weights; the reference gets the
    # same weights dequantized (the 8-bit reference path of many rows would quantize the
    # activations too, an error of its own).
    exact = ExpertWeights(w.router, q.gate_up.dequantize(torch.float32).to(torch.bfloat16),
                          q.down.dequantize(torch.float32).to(torch.bfloat16))
    assert _rel(got, routed_experts_ref(x, exact, moe, experts, weights)) <= BF16_REL


def test_a_captured_graph_replays_new_routing() -> None:
    w = _experts(32, 512, 256, seed=2)
    moe = MoEConfig(32, 4, 256, True, frozenset({0}))
    x = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16)
    routed_experts(x, w, moe)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(x, w, moe)
    for seed in range(3):
        x.copy_(torch.randn(48, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(out, routed_experts(x.clone(), w, moe), rtol=0, atol=0)


def _greedy(model_dir, cuda_graphs: bool) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="float32", max_total_tokens=8192,
                          max_running_requests=32, max_model_len=512, cuda_graphs=cuda_graphs)
    eng = LLMEngine(config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in [3, 17, 64, 150] * 5]
    reqs = [eng.add_request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs], eng


def test_a_tiny_qwen3_moe_engine_decodes_the_same_with_cuda_graphs(tmp_path, tokenizer_dir) -> None:
    write_family_model("qwen3-moe", tmp_path, tokenizer_dir, embed_scale=4.0)
    eager, eng = _greedy(tmp_path, cuda_graphs=False)
    assert eng.runner.graphs is None
    graphed, eng = _greedy(tmp_path, cuda_graphs=True)
    assert eng.runner.graphs is not None
    assert graphed == eager
