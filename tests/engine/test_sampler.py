"""Sampler: greedy, temperature, filters, penalties, logit_bias, seeds, logprobs, the counter-based stream."""

from __future__ import annotations

import math

import pytest
import torch

from pd_cluster.engine.random_stream import random_bits, stream_key, uniform
from pd_cluster.engine.sampler import SamplingState, processed_logits, sample, target_probs
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


def test_sampling_is_the_inverse_transform_of_the_seeds_counter_stream() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    states = [_state(seed=s, temperature=0.7, output=[1] * s) for s in (11, 12, 13)]
    got = [t.token_id for t in sample(logits, states)]
    expected = []
    for row, seed in zip(logits, (11, 12, 13)):
        # Output position = tokens generated so far (here: the seed's value).
        u = (random_bits(*stream_key(seed), seed) >> 8) / 2**24
        cdf = torch.softmax(row.double() / 0.7, -1).cumsum(-1).tolist()
        expected.append(next(i for i, c in enumerate(cdf) if c > u * cdf[-1]))
    assert got == expected


def test_stream_bits_are_the_same_for_python_ints_and_int64_tensors() -> None:
    seeds = [0, 1, 2, 12345, 2**32 - 1, 2**32, 2**62 + 7, 2**63 - 1]
    positions = [0, 1, 2, 100, 4095, 2**31 - 1, 2**32 - 1]
    keys = [stream_key(s) for s in seeds]
    k0 = torch.tensor([k[0] for k in keys for _ in positions])
    k1 = torch.tensor([k[1] for k in keys for _ in positions])
    pos = torch.tensor(positions * len(seeds))
    as_tensor = random_bits(k0, k1, pos).tolist()
    as_int = [random_bits(*k, p) for k in keys for p in positions]
    assert as_tensor == as_int
    assert all(0 <= b < 2**32 for b in as_int)
    # Pinned values: a change of the stream (which would change every seeded output) fails here.
    assert stream_key(1234) == (2190147994, 2215584770)
    assert [random_bits(*stream_key(1234), p) for p in range(4)] == [3240560389, 821304957, 2456681152, 3662215685]


def test_stream_bits_are_uniform_and_uncorrelated_across_positions_and_seeds() -> None:
    # 64 seeds (consecutive, as choices of one request use) x 512 positions.
    k = torch.tensor([stream_key(s) for s in range(1000, 1064)])
    pos = torch.arange(512)
    bits = random_bits(k[:, :1], k[:, 1:], pos.unsqueeze(0))  # [64, 512]
    u = uniform(bits).double()
    # Each of 16 buckets holds 1/16 of the 32768 draws: chi-square with 15 degrees of freedom.
    counts = torch.bincount((u * 16).long().flatten(), minlength=16).double()
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7  # p = 0.001
    # Neighbouring positions and neighbouring seeds are not correlated.
    centered = u - 0.5
    assert abs((centered[:, 1:] * centered[:, :-1]).mean()) < 0.004
    assert abs((centered[1:] * centered[:-1]).mean()) < 0.004


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
    return processed_logits(logits, [state])


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


def test_a_state_on_another_node_continues_the_same_stream() -> None:
    """P samples position 0; D builds a fresh state from the same params and the first token."""
    logits = torch.randn(1, 80, generator=torch.Generator().manual_seed(9))
    params = dict(seed=123, temperature=0.9, frequency_penalty=0.3)
    original = _state(**params)
    tokens = []
    for _ in range(11):
        tokens.append(sample(logits, [original])[0].token_id)
        original.output_token_ids.append(tokens[-1])

    on_decode = _state(**params, output=tokens[:1])
    continued = []
    for _ in range(10):
        continued.append(sample(logits, [on_decode])[0].token_id)
        on_decode.output_token_ids.append(continued[-1])
    assert continued == tokens[1:]


def test_unseeded_states_get_distinct_random_seeds() -> None:
    assert len({_state().seed for _ in range(20)}) == 20


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


def test_large_batch_draws_match_each_row_alone() -> None:
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


# ---- each logits processor against a straightforward reference ------------------------------


def _reference_logits(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """logit_bias, then repetition, frequency and presence penalties, one token at a time."""
    p = state.params
    x = row.double().clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for token in set(state.prompt_token_ids) | set(state.output_token_ids):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(state.output_token_ids):
        x[token] -= p.frequency_penalty * state.output_token_ids.count(token) + p.presence_penalty
    return x


def _reference_probs(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Temperature, top-k (ties at the cut kept), top-p (the smallest set of the most likely
    tokens holding at least top_p), min-p, written out with sorted Python lists."""
    p = state.params
    x = _reference_logits(row, state) / p.temperature
    vocab = x.numel()
    keep = set(range(vocab))
    if 0 < p.top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1]
        keep = {t for t in keep if x[t] >= kth}
    if p.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~_mask(keep, vocab), float("-inf")), -1)
        mass, kept = 0.0, set()
        for t in sorted(keep, key=lambda t: -probs[t].item()):
            if mass >= p.top_p:
                break
            kept.add(t)
            mass += probs[t].item()
        keep = kept
    probs = torch.softmax(x.masked_fill(~_mask(keep, vocab), float("-inf")), -1)
    if p.min_p > 0.0:
        floor = p.min_p * probs.max().item()
        keep = {t for t in keep if probs[t] >= floor}
        probs = torch.softmax(x.masked_fill(~_mask(keep, vocab), float("-inf")), -1)
    return probs


def _mask(keep: set[int], vocab: int) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(keep)] = True
    return mask


_PROCESSOR_CASES = [
    dict(logit_bias={0: 5.0, 7: -100.0, 31: 0.5}),
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.8),
    dict(frequency_penalty=-1.5),
    dict(presence_penalty=1.2),
    dict(presence_penalty=-0.7),
    dict(temperature=0.35),
    dict(temperature=2.5),
    dict(top_k=5),
    dict(top_k=1),
    dict(top_p=0.6),
    dict(top_p=0.05),
    dict(min_p=0.2),
    dict(top_k=12, top_p=0.8, min_p=0.05, temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
         presence_penalty=0.3, logit_bias={3: 2.0, 4: -3.0}),
]


@pytest.mark.parametrize("settings", _PROCESSOR_CASES, ids=lambda s: "+".join(s))
def test_each_processor_matches_the_reference(settings: dict) -> None:
    vocab = 32
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(21)) * 2
    gen = torch.Generator().manual_seed(22)
    states = []
    for i in range(6):
        prompt = torch.randint(vocab, (5,), generator=gen).tolist()
        output = torch.randint(vocab, (i * 2,), generator=gen).tolist()
        states.append(_state(prompt=prompt, output=output, seed=i, **settings))
    # Every row in one batch, next to rows with other settings, as the engine batches them.
    neighbours = [_state(seed=9, temperature=0.0, output=[1, 1]), _state(seed=8, top_k=3, output=[2])]
    batch = torch.cat([logits, torch.randn(2, vocab, generator=gen)])
    processed = processed_logits(batch, states + neighbours)
    probs = target_probs(batch, states + neighbours)
    for i, state in enumerate(states):
        torch.testing.assert_close(processed[i].double(), _reference_logits(logits[i], state), atol=1e-5, rtol=1e-5)
        if state.params.greedy:
            continue
        reference = _reference_probs(logits[i], state)
        # The same support (a -100 bias leaves float64 a mass float32 rounds to zero).
        assert torch.equal(probs[i] > 1e-30, reference > 1e-30), (i, probs[i], reference)
        torch.testing.assert_close(probs[i].double(), reference, atol=1e-5, rtol=1e-4)


def test_logit_bias_steers_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert sample(logits, [_state(temperature=0, logit_bias={3: 3.5})])[0].token_id == 3
    # -100 makes a token practically impossible, +100 practically certain.
    assert set(_draw(logits[0], 500, logit_bias={0: -100.0})) == {1, 2, 3}
    assert set(_draw(logits[0], 500, logit_bias={2: 100.0})) == {2}
    # Logprobs stay those of the raw logits (the bias changes the choice, not the report).
    out = sample(logits, [_state(temperature=0, logit_bias={3: 3.5}, logprobs=1)])[0]
    assert out.logprob.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item(), abs=1e-6)


# ---- sampling statistics ----------------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (zero-probability
    tokens must not occur at all)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was drawn"
    n = counts.sum()
    expected = probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


_DISTRIBUTION_CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=1.0)),
    "top_k": (dict(temperature=1.5, top_k=4), dict(temperature=1.5)),
    "top_p": (dict(top_p=0.8), dict(top_p=1.0)),
    "min_p": (dict(min_p=0.15), dict()),
    "penalties": (dict(frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.3),
                  dict(frequency_penalty=0.9, presence_penalty=0.4)),
    "logit_bias": (dict(logit_bias={2: 1.0, 5: -2.0}), dict(logit_bias={2: 1.0})),
}


@pytest.mark.parametrize("case", list(_DISTRIBUTION_CASES))
def test_sampled_frequencies_pass_a_chi_square_test_that_a_wrong_target_fails(case: str) -> None:
    """20,000 draws over 8 tokens: each from its own seed and position, as requests draw them.
    The counts fit the target distribution (p > 0.001) and fail a nearby wrong one (p < 1e-6)."""
    settings, wrong = _DISTRIBUTION_CASES[case]
    vocab, seeds, positions = 8, 400, 50
    logits = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.0, 0.1, 0.6, -0.2])
    prompt, history = [3, 6], [0, 0, 3, 1]

    def states(params: dict, seed: int, position: int) -> SamplingState:
        # The output so far: the same penalized history, then padding to reach the position.
        return _state(prompt=prompt, output=history + [7] * position, seed=seed, **params)

    counts = torch.zeros(vocab, dtype=torch.float64)
    for position in range(positions):
        batch = [states(settings, seed, position) for seed in range(seeds)]
        tokens = torch.tensor([t.token_id for t in sample(logits.expand(seeds, -1), batch)])
        counts += torch.bincount(tokens, minlength=vocab).double()
    # The penalties see the padding tokens too, so the target changes with the position: average it.
    target = torch.stack([target_probs(logits.unsqueeze(0), [states(settings, 0, p)])[0] for p in range(positions)])
    target = target.double().mean(0)
    reference = torch.stack([_reference_probs(logits, states(settings, 0, p)) for p in range(positions)]).mean(0)
    torch.testing.assert_close(target, reference, atol=1e-6, rtol=1e-5)
    assert _chi_square_p_value(counts, target) > 1e-3
    wrong_target = torch.stack([_reference_probs(logits, states(wrong, 0, p)) for p in range(positions)]).mean(0)
    assert _chi_square_p_value(counts, wrong_target) < 1e-6


def test_a_moved_stream_with_its_output_in_the_prompt_goes_on_unchanged() -> None:
    """A stream re-prefilled elsewhere after k tokens (prompt + those k tokens as the new prompt,
    output_offset=k) draws what the unmoved request draws at positions k, k+1, ..."""
    logits = torch.randn(1, 60, generator=torch.Generator().manual_seed(31))
    params = dict(seed=77, temperature=1.1, frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.2)
    prompt = [4, 5, 6]
    unmoved = _state(prompt=prompt, **params)
    tokens = []
    for _ in range(12):
        tokens.append(sample(logits, [unmoved])[0].token_id)
        unmoved.output_token_ids.append(tokens[-1])

    k = 5
    moved = _state(prompt=prompt + tokens[:k], output_offset=k, **params)
    assert moved.position == k
    went_on = []
    for _ in range(12 - k):
        went_on.append(sample(logits, [moved])[0].token_id)
        moved.output_token_ids.append(went_on[-1])
    assert went_on == tokens[k:]
    # Without the offset the penalties would not count the carried tokens as output.
    restarted = _state(prompt=prompt + tokens[:k], **params)
    fresh = _state(prompt=prompt + tokens[:k], output_offset=k, **params)
    assert restarted.position == 0
    assert not torch.equal(processed_logits(logits, [restarted]), processed_logits(logits, [fresh]))


def test_overflowed_logits_still_give_a_token_inside_the_vocabulary() -> None:
    """inf or NaN logits (an overflowing model) must not draw an id past the vocabulary."""
    vocab = 50
    logits = torch.randn(4, vocab)
    logits[0, 7] = float("inf")
    logits[1] = float("nan")
    logits[2, :] = float("-inf")
    states = [SamplingState.create(SamplingParams(temperature=0.8, seed=i, max_tokens=4), [1, 2]) for i in range(4)]
    tokens = [t.token_id for t in sample(logits, states)]
    assert all(0 <= t < vocab for t in tokens), tokens
    assert tokens[0] == 7


def test_draw_inputs_stage_floats_and_ints_in_one_buffer():
    """A batch's settings go out as one copy of one packed buffer: float rows and int rows (64-bit
    stream keys whole) land in the first rows of their tables (the int rows after them are not
    copied; the float table goes whole, its later rows unread)."""
    from pd_cluster.engine.sampler import DrawInputs

    inputs = DrawInputs(4, torch.device("cpu"))
    inputs.floats.fill_(-1.0)
    inputs.ints.fill_(-1)
    floats = [(0.8, 0.95, 0.0, 1.0, 0.5, 0.0), (1.0, 1.0, 0.05, 1.1, 0.0, 0.25)]
    ints = [(2**62 + 5, -(2**63) + 7, 12, 40, 0), (3, 4, 5, 49152, 1)]
    for _ in range(6):  # around the staging ring and back
        float_rows, int_rows = inputs.write(floats, ints)
    assert float_rows.data_ptr() == inputs.floats.data_ptr() and float_rows.shape == (2, 6)
    assert torch.equal(float_rows, torch.tensor(floats, dtype=torch.float32))
    assert int_rows.tolist() == [list(r) for r in ints]
    assert (inputs.ints[2:] == -1).all()
    float_rows, int_rows = inputs.write(floats[1:], ints[1:])
    assert int_rows.tolist() == [list(ints[1])] and inputs.ints[1].tolist() == list(ints[1])
