"""One request's output: sampled token ids -> text deltas, and the decision to stop.

Detokenization is incremental (vLLM's prefix/read offsets): each step decodes only a few
tokens, so long outputs cost the same per token as short ones, and text is released only when it
does not end in U+FFFD (a multi-byte character split across tokens waits for its last byte).

A stream that moved to another node carries its earlier output at the end of its prompt
(``SamplingParams.output_offset``). The processor replays it first, from the original prompt's
context, so it holds exactly what the first node held when it stopped: the bytes of a character
that node never finished and a tail withheld for stop strings. The text deltas then go on as
an uninterrupted run's would, and a stop string spanning the move is found.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Prompt tokens decoded ahead of the first output token, so it gets its leading space right.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

OutputFinishReason = Literal["stop", "length"]


@dataclass
class OutputUpdate:
    text_delta: str
    finish_reason: OutputFinishReason | None
    stop_reason: str | int | None


class IncrementalDetokenizer:
    """Decodes a growing list of token ids a few tokens at a time.

    ``prefix_offset..read_offset`` is text already released (kept as context so the tokenizer
    joins words the same way it would in a full decode); ``read_offset..`` is new.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Ids that decode to nothing are left out, so they never widen the decode window.
        self._skipped_ids: frozenset[int] = (
            _special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        )
        context = [t for t in prompt_token_ids if t not in self._skipped_ids]
        self._ids: list[int] = context[-PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text it completes (may be empty)."""
        if token_id in self._skipped_ids:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text of tokens still held back (e.g. an unfinished character), as a full decode shows it."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


class OutputProcessor:
    """Turns one request's sampled token ids into text and decides when it ends."""

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: set[int],
        prompt_token_ids: list[int],
    ) -> None:
        self.params = params
        #: This node's output ids (carried output excluded: ``max_tokens`` counts only these).
        self.token_ids: list[int] = []
        #: Full output text so far, the carried output's included, with a tail still withheld
        #: from the deltas.
        self.text = ""
        self.finish_reason: OutputFinishReason | None = None
        self.stop_reason: str | int | None = None
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        split = max(len(prompt_token_ids) - params.output_offset, 0)
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids[:split], params.skip_special_tokens
        )
        self._emitted = 0  # characters of self.text already handed out as deltas
        self._replay(prompt_token_ids[split:])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def ends_with_token(self, token_id: int, num_tokens: int) -> bool:
        """Whether the output ends at this token (its ``num_tokens``-th) whatever its text: a stop
        or EOS token, or the length limit. Known before detokenizing; stop strings are not."""
        return token_id in self._stop_ids or token_id in self._eos_ids or num_tokens >= self.params.max_tokens

    def append(self, token_id: int, grammar_done: bool = False) -> OutputUpdate:
        """Accept one sampled token; returns the text now safe to show and whether it ended.
        ``grammar_done``: the request's grammar is complete with this token, so the output ends
        here ("stop"), as at a stop token, but the token's text is part of it."""
        if self.finished:
            raise RuntimeError("append after the output finished")
        self.token_ids.append(token_id)

        stop_token = token_id in self._stop_ids or token_id in self._eos_ids
        if stop_token:
            # The stop token's own text is never shown; anything held back before it is.
            new_text = self._detokenizer.flush()
        else:
            new_text = self._detokenizer.add(token_id)
            if grammar_done or len(self.token_ids) >= self.params.max_tokens:
                new_text += self._detokenizer.flush()

        old_len = len(self.text)
        self.text += new_text
        if new_text and self._stops and self._cut_at_stop_string(old_len):
            self.finish_reason = "stop"
        elif stop_token or grammar_done:
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in self._stop_ids else None
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return OutputUpdate(self._take_delta(), self.finish_reason, self.stop_reason)

    def _replay(self, carried: list[int]) -> None:
        """Take output an earlier node already streamed: its text, and how much of it that node
        handed out (those deltas reached the client, so none is returned here). The end of the
        text :meth:`_take_delta` hands out never moves back, so after any token it is the text
        less its longest possible start of a stop string; the carried output held no whole stop
        string (the stream would have ended there)."""
        for token_id in carried:
            self.text += self._detokenizer.add(token_id)
        self._emitted = len(self.text) - self._stop_prefix_len()

    def _cut_at_stop_string(self, old_len: int) -> bool:
        """Find the earliest stop string the new text completed; cut the text before it."""
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stop_reason = best[1]
        return True

    def _take_delta(self) -> str:
        end = len(self.text)
        if not self.finished:
            end -= self._stop_prefix_len()
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
