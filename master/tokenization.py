"""Chat templates and tokenization for the master (nodes receive token ids, never text).

All encoding runs on one worker thread: it keeps long prompts off the event loop, and a fast
tokenizer must not be used by two threads at once (it raises "Already borrowed").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, TypeVar

from master.tool_calls import messages_without_tool_support, template_renders_tools
from pd_cluster.block_hash import block_hashes

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Chat encoding caches the ids of the text between added tokens (see `Tokenizer._encode_segments`).
# Only pieces of at least this many characters are cached: shorter ones (role headers, "\n", one-line
# messages) cost next to nothing to encode, all in one batched call, and caching them would fill the LRU
# with one-off strings that push out the long pieces (system prompts, documents, earlier turns) whose
# re-encoding is what a multi-turn conversation pays for on every turn.
_MIN_CACHED_SEGMENT_CHARS = 64
# Bounds on the cache: entries, and characters in all keys together (ids are kept as int32 arrays, about
# a token per 4 characters), so a few huge documents cannot pin gigabytes: about 32 MiB at most.
_SEGMENT_CACHE_ENTRIES = 4096
_SEGMENT_CACHE_CHARS = 16 * 1024 * 1024


class Encoded(NamedTuple):
    """A prompt's ids and, when routing asked for them, its blocks' chained hashes (computed in
    the same trip to the tokenizer thread: each trip costs the event loop a wake-up and the
    thread a wait for the GIL, about as much as hashing a long prompt)."""

    ids: list[int]
    block_hashes: list[int] | None = None


class SegmentCacheInfo(NamedTuple):
    """Counters of the chat segment cache, like ``functools.lru_cache``'s ``cache_info()``."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class _SegmentSplit(NamedTuple):
    """How to cut rendered chat text at the tokenizer's added tokens."""

    pattern: re.Pattern[str]  # one capturing group: re.split returns text, token, text, token, ...
    token_ids: dict[str, int]


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class Tokenizer:
    """Async facade over a transformers tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)
        # Segment text -> ids, least recently used first. Only the tokenizer thread touches it: no lock.
        self._segments: OrderedDict[str, array[int]] = OrderedDict()
        self._segment_chars = 0
        self._segment_hits = 0
        self._segment_misses = 0

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the tokenizer thread (also used for other per-request CPU work)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          block_size: int | None = None) -> Encoded:
        """The rendered chat's ids (and, given ``block_size``, their block hashes)."""
        return await self.run(self._encoded, block_size, self._encode_chat, messages, tools)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the model's chat template writes the tools (and tool calls) itself."""
        return template_renders_tools(getattr(self.hf, "chat_template", None) or "")

    async def encode_prompt(self, text: str, block_size: int | None = None) -> Encoded:
        """A completion prompt's ids (and, given ``block_size``, their block hashes)."""
        return await self.run(self._encoded, block_size, self._encode_prompt, text)

    async def hash_blocks(self, ids: list[int], block_size: int) -> Encoded:
        """Block hashes of a prompt given as ids."""
        return await self.run(self._encoded, block_size, list, ids)

    @staticmethod
    def _encoded(block_size: int | None, encode: Callable[..., list[int]], *args: Any) -> Encoded:
        ids = encode(*args)
        return Encoded(ids, block_hashes(ids, block_size) if block_size else None)

    def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        from jinja2 import TemplateError

        extra: dict[str, Any] = {}
        if not self.renders_tools:
            if tools or any("tool_calls" in m or "tool_call_id" in m for m in messages):
                messages = messages_without_tool_support(messages, tools)
        elif tools:
            extra["tools"] = tools
        split = self._segment_split
        try:
            if split is not None:
                text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
                if isinstance(text, str):
                    return self._encode_segments(text, split)
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              **extra)
        except (TemplateError, ValueError) as exc:  # raise_exception() in templates, "no chat template"
            raise ChatTemplateError(f"could not apply the chat template: {exc}") from exc
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    @functools.cached_property
    def _segment_split(self) -> _SegmentSplit | None:
        """How to encode rendered chats piece by piece, or None to encode them whole.

        A fast tokenizer cuts text at its (non-normalized) added tokens before normalizing and
        pre-tokenizing, so the ids of a text are the ids of the pieces between added tokens, each
        encoded alone, with the added tokens' ids between them. That no longer holds where an added
        token strips the whitespace around it or only matches whole words, where special tokens are
        encoded as text (``split_special_tokens``), or for slow tokenizers: those encode whole.
        A probe text checks the equivalence once for the rest (it catches, e.g., a Metaspace
        pre-tokenizer that adds "▁" only at the start of the text).
        """
        hf = self.hf
        if not getattr(hf, "is_fast", False) or getattr(hf, "split_special_tokens", False):
            return None
        try:
            added = list(hf.added_tokens_decoder.values())
            if any(t.lstrip or t.rstrip or t.single_word for t in added):
                logger.info("chat prompts are encoded whole: an added token strips spaces or matches words only")
                return None
            # Normalized added tokens are matched inside each piece after normalizing, as in a whole text.
            contents = sorted({t.content for t in added if t.content and not t.normalized}, key=len, reverse=True)
            if not contents:
                return None
            split = _SegmentSplit(re.compile("(" + "|".join(map(re.escape, contents)) + ")"),
                                  {c: int(hf.convert_tokens_to_ids(c)) for c in contents})
            probe = "  Hi there." + "".join(f"a{c}b {c} c\n{c}\n  d{c}" for c in contents[:64]) + "end \n"
            pieces = self._encode_segments(probe, split, cache=False)
            if pieces != list(hf(probe, add_special_tokens=False)["input_ids"]):
                logger.info("chat prompts are encoded whole: the tokenizer does not encode pieces as it does a text")
                return None
        except Exception:  # an unusual tokenizer: keep the plain path rather than fail every chat request
            logger.warning("chat prompts are encoded whole: could not set up piecewise encoding", exc_info=True)
            return None
        return split

    def _encode_segments(self, text: str, split: _SegmentSplit, cache: bool = True) -> list[int]:
        """The ids of a rendered chat, reusing those of long pieces seen before.

        Every turn of a conversation re-sends its whole history: cutting at the template's special
        tokens gives one piece per message, and only the new ones need encoding.
        """
        parts = split.pattern.split(text)
        pieces: list[Sequence[int]] = []
        todo: list[tuple[int, str]] = []
        segments = self._segments
        for i, part in enumerate(parts):
            if i % 2:
                pieces.append((split.token_ids[part],))
            elif part:
                if cache and len(part) >= _MIN_CACHED_SEGMENT_CHARS:
                    hit = segments.get(part)
                    if hit is not None:
                        segments.move_to_end(part)
                        self._segment_hits += 1
                        pieces.append(hit)
                        continue
                    self._segment_misses += 1
                todo.append((len(pieces), part))
                pieces.append(())
        if todo:
            # One batched call, as apply_chat_template calls the tokenizer (add_special_tokens=False).
            encoded = self.hf([part for _, part in todo], add_special_tokens=False)["input_ids"]
            for (index, part), ids in zip(todo, encoded):
                pieces[index] = ids
                if cache and len(part) >= _MIN_CACHED_SEGMENT_CHARS:
                    self._remember(part, ids)
        out: list[int] = []
        for piece in pieces:
            out.extend(piece)
        return out

    def _remember(self, segment: str, ids: Sequence[int]) -> None:
        if segment in self._segments or len(segment) > _SEGMENT_CACHE_CHARS:
            return
        self._segments[segment] = array("i", ids)
        self._segment_chars += len(segment)
        while len(self._segments) > _SEGMENT_CACHE_ENTRIES or self._segment_chars > _SEGMENT_CACHE_CHARS:
            old, _ = self._segments.popitem(last=False)
            self._segment_chars -= len(old)

    def segment_cache_info(self) -> SegmentCacheInfo:
        """Hits and misses of the chat segment cache (pieces too short to cache are not counted)."""
        return SegmentCacheInfo(self._segment_hits, self._segment_misses, _SEGMENT_CACHE_ENTRIES,
                                len(self._segments))

    def _encode_prompt(self, text: str) -> list[int]:
        return [int(t) for t in self.hf(text, add_special_tokens=True)["input_ids"]]

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs show it."""
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
