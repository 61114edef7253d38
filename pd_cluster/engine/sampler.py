"""Turns a batch of next-token logits into tokens, one request's sampling settings per row.

Order of operations (vLLM's): logprobs from the raw logits; then repetition, frequency and
presence penalties; then greedy rows take the argmax, and the other rows are scaled by their
temperature, cut by top-k, top-p and min-p, and drawn with the exponential race
``argmax(probs / q)``, ``q ~ Exp(1)`` drawn from the request's own CPU generator. A CPU generator
makes a seeded request give the same tokens on any device and lets a prefill node hand the
generator's state to a decode node.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.protocol import TokenLogprob

logger = logging.getLogger(__name__)

#: Temperatures below this are treated as greedy (dividing by them would overflow).
_MIN_TEMPERATURE = 1e-5
#: Noise for fewer rows than this is drawn on the calling thread.
_PARALLEL_NOISE_MIN_ROWS = 4
_noise_pool: ThreadPoolExecutor | None = None


@dataclass
class SamplingState:
    """One request's sampling settings, its random stream and the tokens penalties look at."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Unique prompt ids as a tensor, built once: prompts do not change.
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: list[int]) -> "SamplingState":
        """A state seeded from ``params.seed``, or from a fresh random seed when it is None."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return cls(params=params, generator=generator, prompt_token_ids=list(prompt_token_ids))

    def export_rng(self) -> str:
        """The generator's state as base64 text, to continue the same stream elsewhere."""
        return base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii")

    def restore_rng(self, state: str) -> None:
        """Continue the stream that :meth:`export_rng` saved; raises ValueError if malformed."""
        try:
            raw = base64.b64decode(state.encode("ascii"), validate=True)
            self.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"invalid generator state: {exc}") from exc

    def prompt_ids_tensor(self) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(set(self.prompt_token_ids)), dtype=torch.int64)
        return self._prompt_ids


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampledToken]:
    """Pick one token per row of ``logits`` ``[B, V]`` (any float dtype, any device).

    Does not append the tokens to the states; the caller does once it accepts them.
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(states)} states")
    batch, vocab = logits.shape
    if batch == 0:
        return []
    device = logits.device
    x = logits.to(torch.float32, copy=True)

    logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    logprobs = torch.log_softmax(x[logprob_rows], dim=-1) if logprob_rows else None

    _apply_penalties(x, states)

    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    greedy_rows = [i for i, s in enumerate(states) if _is_greedy(s.params)]
    random_rows = [i for i, s in enumerate(states) if not _is_greedy(s.params)]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        tokens[rows] = x[rows].argmax(dim=-1)
    if random_rows:
        rows = torch.tensor(random_rows, device=device)
        tokens[rows] = _sample_random(x[rows], [states[i] for i in random_rows])

    if logprobs is None:
        return [SampledToken(token_id=t) for t in tokens.tolist()]
    return _with_logprobs(tokens, logprobs, logprob_rows, states)


def _is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < _MIN_TEMPERATURE


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Repetition (HF-style, prompt + output) and frequency/presence (OpenAI-style, output)."""
    vocab = x.shape[1]
    device = x.device
    rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = torch.zeros(len(rep_rows), vocab, dtype=torch.bool)
        for j, i in enumerate(rep_rows):
            seen[j, states[i].prompt_ids_tensor()] = True
            seen[j, torch.tensor(states[i].output_token_ids, dtype=torch.int64)] = True
        rows = torch.tensor(rep_rows, device=device)
        penalty = torch.tensor(
            [states[i].params.repetition_penalty for i in rep_rows], device=device
        ).unsqueeze(1)
        sub = x[rows]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        x[rows] = torch.where(seen.to(device), penalized, sub)

    count_rows = [
        i
        for i, s in enumerate(states)
        if (s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0)
        and s.output_token_ids
    ]
    if count_rows:
        ids = [torch.tensor(states[i].output_token_ids, dtype=torch.int64) for i in count_rows]
        flat = torch.cat([j * vocab + t for j, t in enumerate(ids)])
        counts = torch.bincount(flat.to(device), minlength=len(count_rows) * vocab)
        counts = counts.view(len(count_rows), vocab).to(torch.float32)
        freq = torch.tensor([states[i].params.frequency_penalty for i in count_rows], device=device)
        pres = torch.tensor([states[i].params.presence_penalty for i in count_rows], device=device)
        rows = torch.tensor(count_rows, device=device)
        x[rows] -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(torch.float32)


def _sample_random(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race, for rows ``x`` ``[R, V]``."""
    rows, vocab = x.shape
    device = x.device
    temperature = torch.tensor([s.params.temperature for s in states], device=device)
    x = x / temperature.unsqueeze(1)

    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states]
    top_p = [s.params.top_p for s in states]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_p:
        x = _top_k_top_p(x, top_k if use_k else None, top_p)
    elif use_k:
        x = _top_k(x, top_k)

    min_p = [s.params.min_p for s in states]
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(x, dim=-1)
        floor = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))

    probs = torch.softmax(x, dim=-1)
    q = _exponential_noise(states, vocab).to(device, non_blocking=True)
    # Filtered tokens have probability exactly 0, so 0 / q = 0 never beats the kept top token.
    return (probs / q).argmax(dim=-1)


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep logits at least the k-th largest of their row (ties at the cut are kept)."""
    k = torch.tensor(top_k, device=x.device).unsqueeze(1)
    values = x.topk(max(top_k), dim=-1).values
    kth = values.gather(1, k - 1)
    return x.masked_fill(x < kth, float("-inf"))


def _top_k_top_p(x: torch.Tensor, top_k: list[int] | None, top_p: list[float]) -> torch.Tensor:
    """Top-k then nucleus over one ascending sort; the top token always survives."""
    vocab = x.shape[1]
    device = x.device
    sorted_x, order = x.sort(dim=-1)
    if top_k is not None:
        k = torch.tensor(top_k, device=device).unsqueeze(1)
        kth = sorted_x.gather(1, vocab - k)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    cumulative = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens above it already hold at least top_p of the mass.
    drop = (cumulative <= 1.0 - p) & (p < 1.0)
    drop[:, -1] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _exponential_noise(states: Sequence[SamplingState], vocab: int) -> torch.Tensor:
    """``[R, V]`` Exp(1) draws on the CPU, row r from ``states[r].generator``.

    Rows use separate generators, so large batches fill them on a few threads (torch releases
    the GIL), which keeps this off the critical path for big vocabularies.
    """
    noise = torch.empty(len(states), vocab, dtype=torch.float32)

    def fill(row: int) -> None:
        noise[row].exponential_(generator=states[row].generator)

    if len(states) < _PARALLEL_NOISE_MIN_ROWS:
        for row in range(len(states)):
            fill(row)
    else:
        list(_get_noise_pool().map(fill, range(len(states))))
    # exponential_ may return 0; keep the division finite (0 / 0 would be NaN and win argmax).
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def _get_noise_pool() -> ThreadPoolExecutor:
    global _noise_pool
    if _noise_pool is None:
        workers = max(1, min(8, (os.cpu_count() or 1) // 2))
        _noise_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sampler-noise")
    return _noise_pool


def _with_logprobs(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    logprob_rows: list[int],
    states: Sequence[SamplingState],
) -> list[SampledToken]:
    """Attach the chosen token's logprob and the row's top-N (N = params.logprobs)."""
    rows = torch.tensor(logprob_rows, device=tokens.device)
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)
    max_n = max(states[i].params.logprobs or 0 for i in logprob_rows)
    if max_n > 0:
        top = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)
        top_values, top_ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
    token_list = tokens.tolist()
    chosen_list = chosen.cpu().tolist()

    out = [SampledToken(token_id=t) for t in token_list]
    for j, i in enumerate(logprob_rows):
        n = states[i].params.logprobs or 0
        top_n = dict(zip(top_ids[j][:n], top_values[j][:n])) if n > 0 else {}
        out[i].logprob = TokenLogprob(token_id=token_list[i], logprob=chosen_list[j], top=top_n)
    return out
