"""The fused routed experts (:mod:`kernels.fused_moe`) against the torch reference, run by Triton's
interpreter; the pair alignment's layout; a tiny Qwen3-MoE engine greedy through the fused path.

As in ``test_kernels_triton.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported:
with it set the interpreted cases are collected, else one test runs this file in a child pytest
with the variable set. The alignment and the engine's settings need no Triton kernel and run
in both. The interpreter has no bfloat16 arithmetic, so the products run in float32 and float16
here; bfloat16 is covered by ``tests/gpu/test_fused_moe_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels._triton import HAS_TRITON
from kernels.fused_moe import MoeGemmConfig, align_chunked, align_ref, fused_moe_triton, max_padded_rows
from kernels.moe_route import route_topk_ref, route_topk_triton
from pd_cluster.config import EngineConfig
from pd_cluster.engine.engine_setup import sparse_config
from pd_cluster.model.config import MoEConfig
from pd_cluster.model.moe import route, routed_experts_ref
from pd_cluster.model.quant_linear import quantize
from pd_cluster.model.weights import ExpertWeights
from tests.kernels.interpreted import INTERPRETER, run_in_interpreter


#: The two sum in other orders (K blocks; a token's top_k outputs in k order, not expert order).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return ExpertWeights(normal(num_experts, hidden, scale=1.0), normal(num_experts, 2 * inter, hidden, scale=0.1),
                         normal(num_experts, hidden, inter, scale=0.1))


def _moe(num_experts: int, top_k: int, inter: int, norm: bool = True) -> MoEConfig:
    return MoEConfig(num_experts, top_k, inter, norm, frozenset({0}))


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_sorts_pairs_by_expert_and_pads_each_run_to_the_tile(block_m: int) -> None:
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 1], [5, 3]])  # expert 2 and 4 get nothing
    a = align_ref(experts, 6, block_m)
    flat = experts.flatten()
    rows = a.pairs.numel()
    assert rows == max_padded_rows(flat.numel(), 6, block_m) and rows % block_m == 0
    assert a.block_experts.numel() == rows // block_m
    used = int(a.num_padded)
    counts = torch.bincount(flat, minlength=6)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert (a.pairs[used:] == flat.numel()).all() and (a.block_experts[used // block_m:] == -1).all()
    seen = []
    for tile in range(used // block_m):
        expert = int(a.block_experts[tile])
        pairs = [int(p) for p in a.pairs[tile * block_m:(tile + 1) * block_m] if p < flat.numel()]
        assert pairs and all(int(flat[p]) == expert for p in pairs)
        seen += pairs
    assert seen == torch.argsort(flat, stable=True).tolist()  # each pair once, by expert, then token


def test_the_alignment_bound_holds_when_every_pair_takes_its_own_expert() -> None:
    experts = torch.arange(8).view(4, 2)
    a = align_ref(experts, 8, 16)
    assert int(a.num_padded) == 8 * 16 == a.pairs.numel()


def test_a_sparse_model_keeps_cuda_graphs_only_where_the_fused_experts_run() -> None:
    config = EngineConfig(model="unused", device="cpu", cuda_graphs=True)
    assert not sparse_config(config, torch.device("cpu")).cuda_graphs
    assert sparse_config(config, torch.device("cuda")).cuda_graphs == HAS_TRITON


class InterpretedCases:
    """Collected only where TRITON_INTERPRET=1 was set before Triton was imported."""

    @pytest.fixture(autouse=True)
    def nan_filled_outputs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Any row the kernels leave unwritten stays NaN."""
        real = torch.empty

        def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
            t = real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", poisoned)

    @pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "dtype"), [
        (1, 8, 2, 64, torch.float32),  # one decode row
        (5, 4, 2, 64, torch.float32),
        (37, 8, 3, 64, torch.float16),
        (9, 6, 1, 72, torch.float32),  # top 1; hidden not a multiple of the K step
        (300, 4, 4, 32, torch.float32),  # 1200 pairs: the 64-row tiles
    ])
    def test_fused_matches_the_reference(self, tokens, num_experts, top_k, hidden, dtype) -> None:
        w = _experts(num_experts, hidden, 48, dtype, seed=tokens)
        moe = _moe(num_experts, top_k, 48, norm=top_k != 3)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
        experts, weights = route(x, w.router, moe)
        got = fused_moe_triton(x, w.gate_up, w.down, experts, weights, num_experts)
        torch.testing.assert_close(got, routed_experts_ref(x, w, moe, experts, weights), **TOL[dtype])

    @pytest.mark.parametrize("method", [None, "int8"])
    @pytest.mark.parametrize("config", [
        MoeGemmConfig(16, 32, 32, group_m=2, sorted_rows=True),  # gated output kept in sorted order
        MoeGemmConfig(16, 32, 16, group_m=3, interleaved=True, sorted_rows=True),  # a group cut short
        MoeGemmConfig(8, 16, 32, interleaved=True),  # gate and up as one product of 32 columns
        MoeGemmConfig(16, 16, 16, group_m=2, sorted_rows=True, tma=True),  # descriptor loads
        MoeGemmConfig(16, 32, 32, tma=True),  # weights by descriptor, rows gathered
    ])
    def test_prompt_tile_options_match_the_reference(self, config: MoeGemmConfig, method: str | None) -> None:
        w = _experts(6, 64, 40, torch.float32, seed=7)  # 40 columns: the last column tile is cut short
        if method:
            w = ExpertWeights(w.router, quantize(w.gate_up, method), quantize(w.down, method))
        moe = _moe(6, 2, 40)
        x = torch.randn(45, 64, generator=torch.Generator().manual_seed(8))
        experts, weights = route(x, w.router, moe)
        got = fused_moe_triton(x, w.gate_up, w.down, experts, weights, 6, configs=(config, config))
        tol = TOL[torch.float32] if method is None else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, routed_experts_ref(x, w, moe, experts, weights), **tol)

    @pytest.mark.parametrize(("tokens", "num_experts", "top_k", "block_m"), [
        (1, 8, 2, 16), (5, 4, 2, 1), (64, 128, 8, 16), (3, 6, 1, 4), (128, 128, 8, 16), (50, 6, 2, 64)])
    def test_chunked_alignment_equals_the_torch_ops(self, tokens, num_experts, top_k, block_m) -> None:
        gen = torch.Generator().manual_seed(tokens)
        experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
        if tokens == 50:  # uneven: experts 2, 3 and 5 get nothing
            experts = torch.tensor([[4, 1]] * 47 + [[1, 4], [0, 4], [4, 0]])
        want, got = align_ref(experts, num_experts, block_m), align_chunked(experts, num_experts, block_m)
        for field in ("pairs", "block_experts", "num_padded"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field

    @pytest.mark.parametrize(("tokens", "num_experts", "top_k", "block_m"), [
        (300, 128, 8, 64), (257, 16, 2, 16), (1000, 4, 1, 128), (33, 128, 8, 128), (1100, 16, 8, 64)])  # 69 chunks
    def test_chunked_alignment_of_many_pairs_equals_the_torch_ops(self, tokens, num_experts, top_k, block_m) -> None:
        gen = torch.Generator().manual_seed(tokens)
        scores = torch.rand(tokens, num_experts, generator=gen) ** 3  # uneven: some experts get far more
        experts = torch.topk(scores, top_k, dim=-1).indices
        want, got = align_ref(experts, num_experts, block_m), align_chunked(experts, num_experts, block_m)
        for field in ("pairs", "block_experts", "num_padded"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field

    @pytest.mark.parametrize(("tokens", "num_experts", "top_k", "renormalize", "dtype"), [
        (1, 128, 8, True, torch.float32), (37, 128, 8, False, torch.float16), (300, 6, 2, True, torch.float32),
        (5, 60, 1, False, torch.float32)])
    def test_fused_router_top_k_matches_torch(self, tokens, num_experts, top_k, renormalize, dtype) -> None:
        logits = (torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(tokens)) * 2).to(dtype)
        experts, weights = route_topk_triton(logits, top_k, renormalize, dtype)
        want_experts, want_weights = route_topk_ref(logits, top_k, renormalize, dtype)
        assert experts.dtype == torch.int64
        if dtype == torch.float32:
            assert torch.equal(experts, want_experts)
        else:  # half-precision logits tie; any expert of the same probability, at the same rank
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            assert torch.equal(probs.gather(1, experts), probs.gather(1, want_experts))
        torch.testing.assert_close(weights, want_weights, **TOL[dtype])

    def test_fused_router_takes_the_lowest_expert_among_equal_probabilities(self) -> None:
        logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.5]])
        experts, weights = route_topk_triton(logits, 4, False, torch.float32)
        assert experts.tolist() == [[1, 2, 4, 3]]
        torch.testing.assert_close(weights, route_topk_ref(logits, 4, False, torch.float32)[1])

    def test_uneven_routing_with_experts_that_get_no_token(self) -> None:
        w = _experts(6, 64, 48, torch.float32, seed=3)
        x = torch.randn(20, 64, generator=torch.Generator().manual_seed(2))
        experts = torch.tensor([[4, 1]] * 17 + [[1, 4], [0, 4], [4, 0]])  # 2, 3 and 5 get nothing
        weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(4))
        got = fused_moe_triton(x, w.gate_up, w.down, experts, weights, 6)
        torch.testing.assert_close(got, routed_experts_ref(x, w, _moe(6, 2, 48), experts, weights), **TOL[torch.float32])

    @pytest.mark.parametrize("method", ["int8", "fp8"])
    def test_eight_bit_experts_match_the_reference(self, method: str) -> None:
        w = _experts(4, 64, 48, torch.float32, seed=5)
        q = ExpertWeights(w.router, quantize(w.gate_up, method), quantize(w.down, method))
        x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6))
        moe = _moe(4, 2, 48)
        experts, weights = route(x, q.router, moe)
        got = fused_moe_triton(x, q.gate_up, q.down, experts, weights, 4)
        torch.testing.assert_close(got, routed_experts_ref(x, q, moe, experts, weights), rtol=1e-4, atol=1e-4)

    def test_a_tiny_qwen3_moe_engine_decodes_the_same_tokens_through_the_fused_experts(
            self, tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from pd_cluster import LLM, SamplingParams
        from pd_cluster.model import moe
        from tests.family_models import write_family_model

        write_family_model("qwen3-moe", tmp_path, default_model_dir)
        prompts = [[1, 2, 3], list(range(300, 340)), [7] * 12]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        want = [o.token_ids for o in LLM(str(tmp_path), max_total_tokens=1024).generate(prompts, params)]
        calls = []
        monkeypatch.setattr(moe, "fused_available", lambda x: calls.append(x.shape[0]) or True)
        got = [o.token_ids for o in LLM(str(tmp_path), max_total_tokens=1024).generate(prompts, params)]
        assert calls and got == want


if INTERPRETER:
    TestFusedMoeInterpreted = InterpretedCases
else:

    def test_fused_moe_matches_the_reference_in_the_interpreter() -> None:
        run_in_interpreter(__file__)
