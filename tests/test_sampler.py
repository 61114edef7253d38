"""Sampler: greedy, temperature, filters, penalties, seeds, logprobs, RNG handoff."""

from __future__ import annotations

import math

import pytest
import torch

from pd_cluster.engine.sampler import SamplingState, sample
from pd_cluster.sampling_params import SamplingParams


def _state(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingState:
    state = SamplingState.create(SamplingParams(**kw), prompt or [])
    state.output_token_ids.extend(output or [])
    return state


def _draw(logits_row: torch.Tensor, n: int, **kw) -> list[int]:
    """n independent draws from one row: a batch of n states seeded 0..n-1."""
    states = [_state(seed=i, **kw) for i in range(n)]
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return [t.token_id for t in sample(logits, states)]


def _generate(seed: int | None, steps: int = 20, vocab: int = 50) -> list[int]:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(99)).unsqueeze(0)
    state = _state(seed=seed)
    tokens = []
    for _ in range(steps):
        token = sample(logits, [state])[0].token_id
        state.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_same_seed_gives_same_tokens() -> None:
    assert _generate(seed=7) == _generate(seed=7)


def test_different_seeds_give_different_tokens() -> None:
    assert _generate(seed=1) != _generate(seed=2)
    assert _generate(seed=None) != _generate(seed=None)


def test_sampling_is_the_exponential_race_on_the_cpu_generator() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    states = [_state(seed=s, temperature=0.7) for s in (11, 12, 13)]
    got = [t.token_id for t in sample(logits, states)]
    expected = []
    for row, seed in zip(logits, (11, 12, 13)):
        q = torch.empty(40).exponential_(generator=torch.Generator().manual_seed(seed))
        expected.append(int((torch.softmax(row / 0.7, -1) / q).argmax()))
    assert got == expected


def test_greedy_equals_argmax_with_first_index_on_ties() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0
    tokens = [t.token_id for t in sample(logits, [_state(temperature=0.0) for _ in range(4)])]
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 10


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    greedy = sample(logits, [_state(temperature=0.0) for _ in range(8)])
    top1 = sample(logits, [_state(seed=i, temperature=1.5, top_k=1) for i in range(8)])
    assert [t.token_id for t in top1] == [t.token_id for t in greedy]


def test_sample_does_not_modify_logits_or_states() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    states = [_state(seed=1, output=[1, 2], repetition_penalty=1.5, frequency_penalty=1.0) for _ in range(2)]
    sample(logits, states)
    assert torch.equal(logits, before)
    assert all(s.output_token_ids == [1, 2] for s in states)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # Greedy picks whatever wins after penalties, so each check isolates one logit.
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    # Token 0 (prompt) is divided by 2 -> 1.5 < 2.0: token 1 wins.
    assert sample(logits, [_state(prompt=[0], temperature=0, repetition_penalty=2.0)])[0].token_id == 1
    # Token 0 (output) divided by 1.4 -> 2.14 > 2.0: still wins.
    assert sample(logits, [_state(output=[0], temperature=0, repetition_penalty=1.4)])[0].token_id == 0
    # Negative seen logit multiplied: -0.5 * 3 = -1.5 < -1.0 (dividing would make it win).
    negative = torch.tensor([[-1.0, -0.5]])
    assert sample(negative, [_state(prompt=[1], temperature=0, repetition_penalty=3.0)])[0].token_id == 0
    # A penalty below 1 rewards a seen token: -1.0 * 0.1 = -0.1 now beats -0.5.
    assert sample(negative, [_state(prompt=[0], temperature=0, repetition_penalty=0.1)])[0].token_id == 0


def _penalized_logits(state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    """The logits after penalties, read from the sampler's own penalty step."""
    from pd_cluster.engine.sampler import _apply_penalties

    x = logits.clone()
    _apply_penalties(x, [state])
    return x


def test_penalties_change_exactly_the_right_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 4.0]])
    state = _state(
        prompt=[0, 1],
        output=[2, 2, 3, 2],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    got = _penalized_logits(state, logits)[0]
    expected = torch.tensor(
        [
            2.0 / 2,  # prompt, positive: divided
            -2.0 * 2,  # prompt, negative: multiplied
            1.0 / 2 - 0.5 * 3 - 0.25,  # output x3: repetition, then frequency and presence
            -1.0 * 2 - 0.5 * 1 - 0.25,  # output x1
            0.5,  # unseen
            4.0,  # unseen
        ]
    )
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    state = _state(prompt=[0, 0, 1], output=[1], frequency_penalty=1.0, presence_penalty=1.0)
    torch.testing.assert_close(_penalized_logits(state, logits)[0], torch.tensor([1.0, -1.0, 1.0]))


def test_penalties_apply_before_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0]])
    state = _state(output=[0], temperature=0, presence_penalty=2.0)
    assert sample(logits, [state])[0].token_id == 1


def test_top_k_never_draws_outside_the_k_largest() -> None:
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0, 1.8, 0.0, 1.7, 1.0])
    tokens = _draw(logits, 2000, temperature=3.0, top_k=3)
    assert set(tokens) == {1, 2, 4}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    tokens = _draw(probs.log(), 2000, top_p=0.7)
    assert set(tokens) == {1, 3}


def test_top_p_always_keeps_the_top_token() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert set(_draw(probs.log(), 200, top_p=0.01)) == {1}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = torch.tensor([0.4, 0.05, 0.3, 0.09, 0.16])
    tokens = _draw(probs.log(), 2000, min_p=0.25)  # floor 0.1
    assert set(tokens) == {0, 2, 4}


def test_filters_combine_and_respect_temperature() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -5.0, 2.7])
    tokens = _draw(logits, 2000, temperature=0.5, top_k=4, top_p=0.9, min_p=0.3)
    allowed = {0, 1, 2, 5}
    assert set(tokens) <= allowed and len(set(tokens)) >= 2


def test_sampled_frequencies_match_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5])
    n = 6000
    tokens = torch.tensor(_draw(logits, n, temperature=1.3))
    observed = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.softmax(logits.double() / 1.3, dim=-1)
    # 5 standard errors per bucket: a wrong temperature or distribution fails by far more.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((observed - expected).abs() < tolerance), (observed, expected)


def test_logprobs_are_from_raw_logits_with_top_n() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(8))
    states = [
        _state(seed=0, logprobs=5, repetition_penalty=1.5, output=[1, 2], temperature=0.3),
        _state(logprobs=0, temperature=0),
        _state(seed=1),
    ]
    out = sample(logits, states)
    reference = torch.log_softmax(logits.float(), dim=-1)

    first = out[0].logprob
    assert first is not None and first.token_id == out[0].token_id
    assert first.logprob == pytest.approx(reference[0, out[0].token_id].item(), abs=1e-5)
    top_values, top_ids = reference[0].topk(5)
    assert list(first.top) == top_ids.tolist()
    assert list(first.top.values()) == pytest.approx(top_values.tolist(), abs=1e-5)

    second = out[1].logprob
    assert second is not None and second.top == {}
    assert second.token_id == int(logits[1].argmax())
    assert second.logprob == pytest.approx(reference[1].max().item(), abs=1e-5)

    assert out[2].logprob is None


def test_exported_rng_continues_the_same_stream() -> None:
    logits = torch.randn(1, 80, generator=torch.Generator().manual_seed(9))
    original = _state(seed=123, temperature=0.9)
    sample(logits, [original])
    saved = original.export_rng()
    assert isinstance(saved, str)
    expected = [sample(logits, [original])[0].token_id for _ in range(10)]

    handed_off = _state(seed=999, temperature=0.9)
    handed_off.restore_rng(saved)
    assert [sample(logits, [handed_off])[0].token_id for _ in range(10)] == expected


def test_restore_rng_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        _state().restore_rng("not base64!")
    with pytest.raises(ValueError):
        _state().restore_rng("AAAA")


def test_mixed_batch_equals_each_row_alone() -> None:
    vocab = 64
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(10)) * 3

    def states() -> list[SamplingState]:
        return [
            _state(seed=1, temperature=0.8, top_k=5),
            _state(temperature=0.0, prompt=[3, 4], repetition_penalty=1.3),
            _state(seed=2, temperature=1.2, top_p=0.8, logprobs=3),
            _state(seed=3, temperature=1.0, min_p=0.1, output=[7, 7, 8], frequency_penalty=0.7),
            _state(seed=4, top_k=-1, top_p=1.0, presence_penalty=-0.5, output=[1]),
            _state(seed=5, temperature=2.0, top_k=10, top_p=0.5, min_p=0.05, prompt=[1, 2, 9]),
        ]

    batched_states, single_states = states(), states()
    for _ in range(5):
        batched = sample(logits, batched_states)
        alone = [sample(logits[i : i + 1], [s])[0] for i, s in enumerate(single_states)]
        assert [t.token_id for t in batched] == [t.token_id for t in alone]
        assert batched[2].logprob == alone[2].logprob
        for s, t in zip(batched_states + single_states, batched + alone):
            s.output_token_ids.append(t.token_id)


def test_large_batch_noise_matches_per_row_generators() -> None:
    # Enough rows for the threaded noise path; each row must still follow its own seed.
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(12)).expand(16, -1)
    batched = [t.token_id for t in sample(logits, [_state(seed=i) for i in range(16)])]
    alone = [sample(logits[:1], [_state(seed=i)])[0].token_id for i in range(16)]
    assert batched == alone


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    out = sample(logits, [_state(temperature=0), _state(seed=0, logprobs=2)])
    assert out[0].token_id == int(logits[0].float().argmax())
    assert out[1].logprob is not None and math.isfinite(out[1].logprob.logprob)


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [_state()])


def test_tiny_top_p_still_keeps_the_top_token_despite_rounding() -> None:
    # With a large vocabulary the float32 cumulative sum can end below 1 - top_p.
    logits = torch.randn(32, 5000, generator=torch.Generator().manual_seed(14))
    out = sample(logits, [_state(seed=i, top_p=1e-9) for i in range(32)])
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
