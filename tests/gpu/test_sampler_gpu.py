"""The sampler on a GPU against its CPU path: the counter-based stream gives the same bits on both,
so a seeded request draws the same tokens whichever device samples it; the cost of sampling over
greedy at a large vocabulary is printed for the benchmark's record.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sampler_gpu.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from pd_cluster.engine.penalties import PenaltyBook
from pd_cluster.engine.sampler import SamplingState, random_bits, sample, stream_key
from pd_cluster.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_stream_bits_are_identical_on_cpu_and_cuda() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (4096,), generator=gen).tolist() + [0, 2**63 - 1]
    keys = torch.tensor([stream_key(s) for s in seeds])
    positions = torch.randint(0, 2**20, (len(seeds),), generator=gen)
    cpu = random_bits(keys[:, 0], keys[:, 1], positions)
    cuda = random_bits(keys[:, 0].cuda(), keys[:, 1].cuda(), positions.cuda())
    assert torch.equal(cpu, cuda.cpu())


def _states(batch: int, **params) -> list[SamplingState]:
    return [SamplingState.create(SamplingParams(seed=i, **params), [1, 2, 3]) for i in range(batch)]


def test_seeded_tokens_are_the_same_on_cpu_and_cuda() -> None:
    # Well-separated logits: CPU and CUDA sums round differently only far below these margins.
    logits = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    logits = logits.float()
    params = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, frequency_penalty=0.2, logit_bias={3: 1.5})
    cpu = [t.token_id for t in sample(logits, _states(256, **params))]
    cuda = [t.token_id for t in sample(logits.cuda(), _states(256, **params))]
    agree = sum(a == b for a, b in zip(cpu, cuda)) / len(cpu)
    assert agree >= 0.99, agree


def test_sampling_kernel_draws_the_reference_tokens_at_a_full_vocabulary() -> None:
    from kernels.sampling import sample_filtered_ref, sample_filtered_triton

    batch, vocab = 64, 128256
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, vocab, generator=gen) * 4
    temperature = torch.rand(batch, generator=gen) + 0.3
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.3, torch.randint(1, 500, (batch,), generator=gen), vocab)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.7, torch.rand(batch, generator=gen) * 0.5 + 0.5, 1.0)
    min_p = torch.where(torch.rand(batch, generator=gen) < 0.2, 0.05, 0.0)
    u = torch.rand(batch, generator=gen)
    ref = sample_filtered_ref(x.double(), temperature.double(), top_k, top_p.double(), min_p.double(), u.double())
    cuda = sample_filtered_triton(x.cuda(), temperature.cuda(), top_k.cuda(), top_p.cuda(), min_p.cuda(), u.cuda())
    agree = (ref == cuda.cpu()).float().mean().item()
    assert agree >= 0.95, agree  # float32 sums against float64 may move a draw across a boundary


@pytest.mark.parametrize("batch", [1, 64])
def test_sampling_cost_over_greedy_is_reported(batch: int) -> None:
    vocab = 128256
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    greedy = _states(batch, temperature=0.0)
    sampled = _states(batch, temperature=0.8, top_p=0.95, frequency_penalty=0.5)
    for s in sampled:
        s.output_token_ids.extend(range(100, 228))

    # An engine's penalty rows persist across steps: one book for all the calls, as there.
    book = PenaltyBook(vocab, logits.device)

    def timed(states: list[SamplingState]) -> float:
        def step() -> None:
            for state, tok in zip(states, sample(logits, states, book)):
                state.output_token_ids.append(tok.token_id)  # as the engine does: rows stay in step

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    greedy_ms, sampled_ms = timed(greedy), timed(sampled)
    print(f"\nsampler batch {batch}, vocab {vocab}: greedy {greedy_ms:.3f} ms, "
          f"temperature 0.8 + top_p 0.95 + frequency penalty {sampled_ms:.3f} ms")
    assert sampled_ms > 0 and greedy_ms > 0
