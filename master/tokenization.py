"""Chat templates and tokenization for the master (nodes receive token ids, never text).

Encoding runs on one worker thread: it keeps long prompts off the event loop, and a fast
tokenizer must not be used by two threads at once (it raises "Already borrowed"). A chat whose
uncached text is short (a later turn: the history's pieces are cached) is encoded on the loop
itself when the tokenizer is free: the trip to the thread and back, with the GIL taken in turn by
the loop's token streams, cost about a millisecond of a later turn's first token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, TypeVar

from master.tool_calls import messages_without_tool_support, template_renders_tools
from pd_cluster.block_hash import BlockHashMemo

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
# Most uncached characters of a chat encoded on the event loop (a few hundred tokens of text, well
# under a millisecond for common words); more go to the tokenizer thread.
INLINE_ENCODE_CHARS = 2048
# Most characters in all of texts encoded one at a time on the calling thread (the loop's inline
# encodes are all such). A batch call hands its texts to the tokenizer's own thread pool: waking it
# cost three short chat pieces ~4 ms at p99 on a busy host (16 us one at a time), and on the event
# loop every stream's next token waited for it. Longer batches (on the tokenizer thread) keep the pool.
SERIAL_ENCODE_CHARS = INLINE_ENCODE_CHARS
# Longest conversation (characters of its messages) rendered and split on the event loop: a few
# hundred microseconds; a longer one (up to the body limit) goes to the thread whole.
INLINE_RENDER_CHARS = 256 * 1024


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
        # Held while the fast tokenizer encodes (the loop takes it only if free) and while the
        # segment cache changes (both threads read and update it).
        self._hf_lock = threading.Lock()
        self._segments_lock = threading.Lock()
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)
        # Segment text -> ids, least recently used first.
        self._segments: OrderedDict[str, array[int]] = OrderedDict()
        self._segment_chars = 0
        self._segment_hits = 0
        self._segment_misses = 0
        # Recent prompts' block hashes: a later turn hashes only what its conversation added.
        self._hash_memo = BlockHashMemo()

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the tokenizer thread (also used for other per-request CPU work)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          block_size: int | None = None) -> Encoded:
        """The rendered chat's ids (and, given ``block_size``, their block hashes): rendered and
        looked up in the segment cache on the loop, the rest encoded there too when it is short
        and the tokenizer free, else on the tokenizer thread."""
        split = self.__dict__.get("_segment_split")  # set up once, on the thread (it probes the tokenizer)
        if split is None or _message_chars(messages) > INLINE_RENDER_CHARS:
            return await self.run(self._encoded, block_size, self._encode_chat, messages, tools)
        text = self._render(messages, tools)
        if not isinstance(text, str):
            return await self.run(self._encoded, block_size, self._encode_chat, messages, tools)
        pieces, todo = self._lookup_segments(text, split)
        if sum(len(part) for _, part in todo) <= INLINE_ENCODE_CHARS and self._hf_lock.acquire(blocking=False):
            try:
                return self._encoded(block_size, self._finish_segments, pieces, todo)
            finally:
                self._hf_lock.release()
        return await self.run(self._encoded, block_size, self._finish_segments_locked, pieces, todo)

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

    def _encoded(self, block_size: int | None, encode: Callable[..., list[int]], *args: Any) -> Encoded:
        ids = encode(*args)
        return Encoded(ids, self._hash_memo.block_hashes(ids, block_size) if block_size else None)

    def _template_args(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and extra arguments the template is rendered with: tools in the template
        where it writes them, else folded into the messages."""
        extra: dict[str, Any] = {}
        if not self.renders_tools:
            if tools or any("tool_calls" in m or "tool_call_id" in m for m in messages):
                messages = messages_without_tool_support(messages, tools)
        elif tools:
            extra["tools"] = tools
        return messages, extra

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        """The chat rendered as text (the template alone: no tokenizer call)."""
        from jinja2 import TemplateError

        messages, extra = self._template_args(messages, tools)
        try:
            return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except (TemplateError, ValueError) as exc:  # raise_exception() in templates, "no chat template"
            raise ChatTemplateError(f"could not apply the chat template: {exc}") from exc

    def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        from jinja2 import TemplateError

        split = self._segment_split
        if split is not None:
            text = self._render(messages, tools)
            if isinstance(text, str):
                return self._encode_segments(text, split)
        messages, extra = self._template_args(messages, tools)
        try:
            with self._hf_lock:
                ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **extra)
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
        pieces, todo = self._lookup_segments(text, split, cache)
        return self._finish_segments_locked(pieces, todo, cache)

    def _finish_segments_locked(self, pieces: list[Sequence[int]], todo: list[tuple[int, str]],
                                cache: bool = True) -> list[int]:
        """:meth:`_finish_segments`, taking the tokenizer first."""
        with self._hf_lock:
            return self._finish_segments(pieces, todo, cache)

    def _lookup_segments(self, text: str, split: _SegmentSplit,
                         cache: bool = True) -> tuple[list[Sequence[int]], list[tuple[int, str]]]:
        """The pieces of a rendered chat, the cached ones' ids filled in, and the (index, text)
        of those left to encode (their places hold ``()``)."""
        parts = split.pattern.split(text)
        pieces: list[Sequence[int]] = []
        todo: list[tuple[int, str]] = []
        segments = self._segments
        with self._segments_lock:
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
        return pieces, todo

    def _finish_segments(self, pieces: list[Sequence[int]], todo: list[tuple[int, str]],
                         cache: bool = True) -> list[int]:
        """Encode the pieces ``todo`` names (the caller holds the tokenizer: ``_hf_lock``), cache
        the long ones, and join every piece's ids."""
        if todo:
            # One batched call, as apply_chat_template calls the tokenizer (add_special_tokens=False).
            encoded = self._encode_texts([part for _, part in todo], add_special_tokens=False)
            for (index, part), ids in zip(todo, encoded):
                pieces[index] = ids
                if cache and len(part) >= _MIN_CACHED_SEGMENT_CHARS:
                    self._remember(part, ids)
        out: list[int] = []
        for piece in pieces:
            out.extend(piece)
        return out

    def _remember(self, segment: str, ids: Sequence[int]) -> None:
        with self._segments_lock:
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
        with self._hf_lock:
            return [int(t) for t in self._encode_texts([text], add_special_tokens=True)[0]]

    def _encode_texts(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids, as ``hf(texts)`` gives them (the caller holds ``_hf_lock``)."""
        backend = self._backend
        if backend is None:
            return [list(ids) for ids in self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"]]
        if sum(len(text) for text in texts) <= SERIAL_ENCODE_CHARS:
            return [backend.encode(text, add_special_tokens=add_special_tokens).ids for text in texts]
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    @functools.cached_property
    def _backend(self) -> Any | None:
        """The fast tokenizer's own (Rust) tokenizer, called directly where it gives what
        ``hf(texts)`` gives: transformers' call wraps it in about as much Python again (a later
        turn's two new messages: 2.0 against 1.0 ms) and computes offsets no one here reads. None
        (use ``hf``) for slow tokenizers, a backend with truncation or padding configured (the
        call turns them off), one without ``encode_batch_fast`` and ``encode``, or one whose ids
        differ on a probe (batched or one text at a time)."""
        backend = getattr(self.hf, "_tokenizer", None)
        if (not getattr(self.hf, "is_fast", False) or not hasattr(backend, "encode_batch_fast")
                or not hasattr(backend, "encode")):
            return None
        try:
            if backend.truncation is not None or backend.padding is not None:
                return None
            probe = ["  Hi there, 12345 tokens!\n\n\tcafé 😀", "x", ""]
            for special in (False, True):
                theirs = [list(ids) for ids in self.hf(probe, add_special_tokens=special)["input_ids"]]
                batched = [e.ids for e in backend.encode_batch_fast(probe, add_special_tokens=special)]
                serial = [backend.encode(text, add_special_tokens=special).ids for text in probe]
                if batched != theirs or serial != theirs:
                    return None
        except Exception:  # an unusual backend: keep the wrapper's path
            logger.warning("encoding through the tokenizer's wrapper: its backend could not be checked", exc_info=True)
            return None
        return backend

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs show it."""
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text contents (parts included), roughly what a render copies."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total
