"""Grammar masks: which tokens a request's grammar allows next, applied to a step's logits.

The grammar engine is llguidance, chosen by measurement against xgrammar (docs/architecture.md,
"Structured outputs"): at the default model's 49k vocabulary its masks cost tens of microseconds
per token, as xgrammar's do, and a schema compiles in about a millisecond where xgrammar took up
to 0.4 s (strings with maxLength), which a request would pay before its first token.

A request's grammar spec (``SamplingParams.structured``) travels with it; its matcher does not.
Each engine that samples for the request builds the matcher from the spec (compiled grammars are
cached per spec, LRU) and advances it over the request's output so far before each mask: the
earlier output a migrated stream carries in its prompt (``output_offset``), then the tokens of
this engine's request, which on a decode node start with the prefill node's first token. So the
mask is the same on P, on D and after a retry, with nothing to ship.

Per step, the host fills one bitmask (32 tokens per int32) for the rows with a grammar, every
other row's bits set; the device applies it to the logits in one batched ``masked_fill`` before
the sampler runs.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any, Protocol, Sequence

import torch

from pd_cluster.grammar_spec import JSON_OPTIONS, GrammarError, check_spec, grammar_text
from pd_cluster.sampling_params import SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["JSON_OPTIONS", "GrammarError", "GrammarState", "Grammars", "apply_token_bitmask", "check_spec",
           "grammar_text", "token_bitmask_words"]

#: Compiled grammars an engine keeps (LRU): a matcher template per spec.
GRAMMAR_CACHE_SIZE = 128
_ALL_ALLOWED = -1  # an int32 with every bit set


def mask_threads() -> int:
    """Threads that fill a step's masks: a quarter of this process's cores, 2 to 8. More only
    contend with the engine's own threads (measured on 16 cores: 4 threads 0.41 ms for 64 rows,
    12 threads 0.56 ms)."""
    return max(2, min(8, len(os.sched_getaffinity(0)) // 4))


def token_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, each logit whose bit in ``bitmask`` ``[B, ceil(V/32)]`` (int32, on the
    logits' device) is 0: bit ``t % 32`` of word ``t // 32`` stands for token ``t``."""
    batch, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1] * 32} tokens for logits of {vocab}")
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(batch, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class GrammarState:
    """One request's matcher and how much of its output it has consumed: earlier output carried in
    the prompt first, then the request's own tokens."""

    def __init__(self, matcher: Any, carried: list[int]) -> None:
        self.matcher = matcher
        self._carried = carried
        self.consumed = 0
        self._failed = False

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consume the tokens of ``carried + output_token_ids`` not yet consumed."""
        carried = self._carried
        while self.consumed < len(carried) + len(output_token_ids) and not self._failed:
            i = self.consumed
            token = carried[i] if i < len(carried) else output_token_ids[i - len(carried)]
            if not self.matcher.consume_token(token):
                # Only a bug gets here (every sampled token passed the mask): end the output.
                logger.error("grammar refused token %d at output position %d: %s", token, i, self.matcher.get_error())
                self._failed = True
            self.consumed += 1

    @property
    def terminated(self) -> bool:
        """No token but EOS can follow: the output is complete (or the matcher failed)."""
        return self._failed or self.matcher.is_stopped()

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Take the output's newest tokens into the matcher; True when the grammar is complete."""
        self.sync(output_token_ids)
        return self.terminated


class GrammarRow(Protocol):
    """What a step's mask reads of the request of one row: its grammar and its output so far."""

    @property
    def grammar(self) -> GrammarState | None: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


class Grammars:
    """An engine's grammar side: the vocabulary as llguidance sees it (built on first use), the
    compiled grammars per spec, and the host bitmask of a step."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._templates: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._cache_size = cache_size
        self._executor: Any = None
        self._host_mask: torch.Tensor | None = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer")
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            except ValueError as exc:  # e.g. a tokenizer larger than the model's vocabulary
                raise GrammarError(f"structured output is not available for this tokenizer: {exc}") from None
        return self._tokenizer

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for ``spec`` (a copy of the cached compiled one); raises :class:`GrammarError`."""
        import llguidance

        template = self._templates.get(spec)
        if template is None:
            template = llguidance.LLMatcher(self._ll_tokenizer(), grammar_text(spec))
            if template.is_error():
                raise GrammarError(f"invalid JSON schema: {template.get_error()}")
            self._templates[spec] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(spec)
        return template.deep_copy()

    def state(self, params: SamplingParams, prompt_token_ids: list[int]) -> GrammarState | None:
        """The grammar state of a new request (None without a grammar); raises :class:`GrammarError`."""
        if params.structured is None:
            return None
        offset = params.output_offset
        carried = list(prompt_token_ids[len(prompt_token_ids) - offset:]) if offset else []
        return GrammarState(self.matcher(params.structured), carried)

    def apply_masks(self, logits: torch.Tensor, reqs: Sequence[GrammarRow]) -> None:
        """Mask row i of ``logits`` ``[B, V]`` by ``reqs[i]``'s grammar, in place (rows without one
        are left as they are); nothing happens when no row has a grammar."""
        rows = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return
        import llguidance

        batch = logits.shape[0]
        # Sized by the grammar's vocabulary: llguidance writes that many bits per row.
        words = token_bitmask_words(self.vocab_size)
        host = self._host_mask
        if host is None or host.shape[0] < batch or host.shape[1] != words:
            host = torch.empty((max(batch, 64), words), dtype=torch.int32,
                               pin_memory=logits.device.type == "cuda")
            self._host_mask = host
        mask = host[:batch]
        # Only the rows without a grammar are filled here (llguidance writes the others whole): a
        # fill of the whole mask runs on torch's CPU thread pool, whose threads then spin and
        # starve llguidance's.
        with_grammar = {i for i, _ in rows}
        for i in range(batch):
            if i not in with_grammar:
                mask[i].fill_(_ALL_ALLOWED)
        matchers = []
        for i, grammar in rows:
            grammar.sync(reqs[i].output_token_ids)
            matchers.append((grammar.matcher, i))
        # llguidance writes each row's words straight into the (contiguous) host mask; its torch
        # helpers are not used: importing them compiles a kernel with torch.compile.
        row_bytes = words * 4
        if len(matchers) == 1 or logits.device.type == "cpu":
            # On CPU the executor's threads would compete with the model's own for the cores.
            for matcher, i in matchers:
                matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * row_bytes, row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=mask_threads())
            self._executor.unsafe_compute_mask_ptr(matchers, mask.data_ptr(), row_bytes, batch)
        with torch.inference_mode():  # the logits are the runner's inference tensors
            apply_token_bitmask(logits, mask.to(logits.device, non_blocking=True))
