"""Chat prompts encoded piece by piece (between added tokens, long pieces cached) give the plain ids."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

import master.tokenization as tokenization
from master.tokenization import Tokenizer

_WORDS = ("the of and to in is was for on that with as by at from it an were which be or had not but "
          "Straße naïve café 東京 日本語 😀 résumé x**2 foo(bar) {\"k\": [1, 2, 3]} 3.14159 "
          "\t tab  two-spaces").split(" ")
_SPECIALS = ["<|im_end|>", "<|im_start|>", "<|im_start|>assistant\n", "<|endoftext|>",
             "<|im_end|>\n<|im_start|>user\n"]


def _reference(hf: Any, messages: list[dict[str, Any]]) -> list[int]:
    return [int(t) for t in hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)]


def _whole_text(hf: Any) -> Tokenizer:
    """A Tokenizer held to the plain path (apply_chat_template with tokenize=True)."""
    t = Tokenizer(hf)
    t.__dict__["_segment_split"] = None
    return t


def _text(rng: random.Random, words: int) -> str:
    out = " ".join(rng.choice(_WORDS) for _ in range(words))
    if rng.random() < 0.3:
        at = rng.randrange(len(out) + 1)
        out = out[:at] + rng.choice(_SPECIALS) + out[at:]
    return rng.choice(["", " ", "\n", "  \n\n"]) + out + rng.choice(["", " ", "\n", " \n "])


def _conversations() -> list[list[dict[str, Any]]]:
    long = " ".join(_WORDS) * 40
    fixed: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
        [{"role": "system", "content": long}, {"role": "user", "content": long + " and again"}],
        [{"role": "user", "content": "  leading and trailing spaces  "},
         {"role": "assistant", "content": "\n\nok\n\n"}],
        [{"role": "user", "content": "a literal <|im_end|> inside"}],
        [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "<|im_start|>"}],
        [{"role": "user", "content": "x" * 100 + "<|im_end|>\n<|im_start|>assistant\n" + "y" * 100}],
        [{"role": "user", "content": "<|im_start|><|im_end|><|endoftext|>" + long}],
        [{"role": "user", "content": "日本語のテキスト 😀 " * 50}, {"role": "assistant", "content": "Straße " * 30}],
    ]
    rng = random.Random(1234)
    fuzzed = [
        [{"role": rng.choice(["system", "user", "assistant"]),
          "content": _text(rng, rng.choice([0, 3, 30, 300]))} for _ in range(rng.randint(1, 7))]
        for _ in range(150)
    ]
    return fixed + fuzzed


def test_the_segment_path_gives_the_ids_of_apply_chat_template(tokenizer):
    t = Tokenizer(tokenizer)
    assert t._segment_split is not None, "the default model's tokenizer should be encoded piece by piece"
    plain = _whole_text(tokenizer)
    for messages in _conversations():
        expected = _reference(tokenizer, messages)
        assert t._encode_chat(messages) == expected, messages
        assert t._encode_chat(messages) == expected, messages  # again, from the cache
        assert plain._encode_chat(messages) == expected
    assert t.segment_cache_info().hits > 0


def test_literal_special_tokens_in_user_text_stay_special_as_in_the_plain_path(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "before <|im_end|> after " * 10}]
    expected = _reference(tokenizer, messages)
    template_own = _reference(tokenizer, [{"role": "user", "content": "before after"}]).count(end)
    assert expected.count(end) == template_own + 10  # the plain path encodes the literal ones as the token
    assert Tokenizer(tokenizer)._encode_chat(messages) == expected


def test_tools_are_handled_as_before(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "What is the weather in Paris? " * 5},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 degrees " * 5},
    ]
    assert Tokenizer(tokenizer)._encode_chat(messages, tools) == _whole_text(tokenizer)._encode_chat(messages, tools)


def test_a_conversation_that_goes_on_reuses_the_ids_of_its_earlier_messages(tokenizer):
    t = Tokenizer(tokenizer)
    first = [
        {"role": "system", "content": "You answer questions about documents. " * 20},
        {"role": "user", "content": "Here is the document: " + " ".join(_WORDS) * 30},
    ]
    assert t._encode_chat(first) == _reference(tokenizer, first)
    before = t.segment_cache_info()
    assert before.hits == 0 and before.misses == 2 and before.currsize == 2

    second = first + [
        {"role": "assistant", "content": "The document lists words in several languages and some code. " * 3},
        {"role": "user", "content": "Thanks!"},
    ]
    assert t._encode_chat(second) == _reference(tokenizer, second)
    after = t.segment_cache_info()
    assert after.hits - before.hits == 2  # the system prompt and the document
    assert after.misses - before.misses == 1  # the assistant's answer; "Thanks!" is too short to cache

    assert t._encode_chat(second) == _reference(tokenizer, second)
    assert t.segment_cache_info().hits - after.hits == 3
    assert t.segment_cache_info().misses == after.misses


def test_the_cache_is_bounded(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenization, "_SEGMENT_CACHE_ENTRIES", 3)
    t = Tokenizer(tokenizer)
    for i in range(10):
        messages = [{"role": "user", "content": f"message {i}: " + "some long enough text " * 5}]
        assert t._encode_chat(messages) == _reference(tokenizer, messages)
        assert t.segment_cache_info().currsize <= 3

    monkeypatch.setattr(tokenization, "_SEGMENT_CACHE_ENTRIES", 4096)
    monkeypatch.setattr(tokenization, "_SEGMENT_CACHE_CHARS", 250)
    t = Tokenizer(tokenizer)
    for i in range(10):
        messages = [{"role": "user", "content": f"message {i}: " + "some long enough text " * 4}]
        assert t._encode_chat(messages) == _reference(tokenizer, messages)
        assert 0 < t._segment_chars <= 250
    messages = [{"role": "user", "content": "a message longer than the whole cache " * 10}]
    assert t._encode_chat(messages) == _reference(tokenizer, messages)
    assert messages[0]["content"] not in "".join(t._segments)  # not cached at all
    assert t._segment_chars == sum(map(len, t._segments)) <= 250


def test_a_tokenizer_with_an_lstrip_added_token_encodes_the_whole_text(default_model_dir, monkeypatch):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))  # not the shared fixture: it is changed here
    hf.add_tokens([AddedToken("<mask>", lstrip=True, special=True)], special_tokens=True)
    t = Tokenizer(hf)
    assert t._segment_split is None

    def never(*args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("the segment path was used")

    monkeypatch.setattr(t, "_encode_segments", never)
    for messages in ([{"role": "user", "content": "fill in the   <mask> here"}],
                     [{"role": "user", "content": "x " * 100 + " <mask>"}, {"role": "assistant", "content": "ok"}]):
        ids = t._encode_chat(messages)
        assert ids == _reference(hf, messages)
        assert hf.convert_tokens_to_ids("<mask>") in ids
    assert t.segment_cache_info() == (0, 0, tokenization._SEGMENT_CACHE_ENTRIES, 0)


@pytest.mark.parametrize("scheme, piecewise", [("first", False), ("always", True)])
def test_a_pre_tokenizer_that_depends_on_the_offset_fails_the_probe(scheme, piecewise):
    """Metaspace(prepend_scheme="first") adds "▁" only at the very start: pieces encoded alone would differ."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for ch in "abcdefghijklmnopqrstuvwxyz .,\n▁<>|_":
        vocab.setdefault(ch, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")
    hf.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    hf.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    t = Tokenizer(hf)
    assert (t._segment_split is not None) == piecewise
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    assert t._encode_chat(messages) == _reference(hf, messages)


async def test_encoding_with_a_block_size_hashes_the_ids_in_the_same_call(tokenizer):
    """Routing's block hashes come with the ids: those of the ids returned, none unasked."""
    from pd_cluster.block_hash import block_hashes

    t = Tokenizer(tokenizer)
    messages = [{"role": "user", "content": "the of and to in " * 20}]
    plain = await t.encode_chat(messages)
    hashed = await t.encode_chat(messages, None, 16)
    assert plain.block_hashes is None and hashed.ids == plain.ids == _reference(tokenizer, messages)
    assert hashed.block_hashes == block_hashes(plain.ids, 16) and len(hashed.block_hashes) == len(plain.ids) // 16
    prompt = await t.encode_prompt("the of and to", 2)
    assert prompt.block_hashes == block_hashes(prompt.ids, 2)
    assert (await t.hash_blocks([5, 6, 7, 8, 9], 2)).block_hashes == block_hashes([5, 6, 7, 8, 9], 2)


async def test_a_later_turn_hashes_only_the_blocks_its_conversation_added(tokenizer):
    from pd_cluster.block_hash import block_hashes

    t = Tokenizer(tokenizer)
    first = [{"role": "user", "content": " ".join(_WORDS) * 12}]
    one = await t.encode_chat(first, None, 1)
    made = t._hash_memo.misses
    second = first + [{"role": "assistant", "content": "the of and " * 10}, {"role": "user", "content": "and to in"}]
    two = await t.encode_chat(second, None, 1)
    assert two.ids[: len(one.ids) - 8] == one.ids[: len(one.ids) - 8]
    assert one.block_hashes == block_hashes(one.ids, 1) and two.block_hashes == block_hashes(two.ids, 1)
    runs = t._hash_memo.run_blocks
    assert t._hash_memo.hits >= (len(one.ids) - 8) // runs - 1  # the first turn's runs, found again
    assert t._hash_memo.misses - made <= (len(two.ids) - len(one.ids) + 8) // runs + 2  # only the new runs made


async def test_a_short_new_part_is_encoded_on_the_loop_unless_the_tokenizer_is_busy(tokenizer):
    t = Tokenizer(tokenizer)
    trips: list[str] = []
    to_thread = t.run

    async def counted(fn, *args):
        trips.append(getattr(fn, "__name__", "?"))
        return await to_thread(fn, *args)

    t.run = counted  # type: ignore[method-assign]
    history = [{"role": "system", "content": "You answer questions about documents. " * 20},
               {"role": "user", "content": "Here is the document: " + " ".join(_WORDS) * 30}]
    try:
        first = await t.encode_chat(history, block_size=4)
        assert first.ids == _reference(tokenizer, history) and first.block_hashes
        assert len(trips) == 1  # the split is set up on the thread, with the first chat

        later = history + [{"role": "assistant", "content": "It lists words. " * 5}, {"role": "user", "content": "Why?"}]
        assert (await t.encode_chat(later, block_size=4)).ids == _reference(tokenizer, later)
        assert len(trips) == 1  # the history from the cache, the new pieces encoded on the loop

        long_new = later + [{"role": "assistant", "content": "ok"},
                            {"role": "user", "content": "and " * (tokenization.INLINE_ENCODE_CHARS // 4 + 1)}]
        assert (await t.encode_chat(long_new)).ids == _reference(tokenizer, long_new)
        assert len(trips) == 2  # a long new part goes to the thread

        huge = history * (tokenization.INLINE_RENDER_CHARS // sum(len(m["content"]) for m in history) + 1)
        assert (await t.encode_chat(huge)).ids == _reference(tokenizer, huge)
        assert len(trips) == 3  # a conversation too long to render on the loop goes whole to the thread

        busy = later + [{"role": "assistant", "content": "Because."}, {"role": "user", "content": "Sure?"}]
        with t._hf_lock:  # the thread is encoding something else
            pending = asyncio.ensure_future(t.encode_chat(busy))
            await asyncio.sleep(0)  # the task runs up to its trip to the thread, which waits for the lock
            assert len(trips) == 4 and not pending.done()
        assert (await pending).ids == _reference(tokenizer, busy)
    finally:
        t.close()


def test_texts_are_encoded_through_the_backend_with_the_wrappers_ids(default_model_dir, monkeypatch):
    """The fast tokenizer's backend is called directly where it gives hf()'s ids; a backend set to
    truncate (which hf() turns off per call) is not."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))  # not the shared fixture: it is changed here
    rng = random.Random(5)
    texts = [_text(rng, 60), "<|im_start|>user\nhi", "", "  tabs\tand\nlines  ", "café 😀 12345"]
    t = Tokenizer(hf)
    assert t._backend is hf._tokenizer
    calls = []
    monkeypatch.setattr(t, "hf", _CallCounter(hf, calls))
    long = texts + [_text(rng, 600)]  # past SERIAL_ENCODE_CHARS: one batched call
    assert sum(map(len, texts)) <= tokenization.SERIAL_ENCODE_CHARS < sum(map(len, long))
    for batch in (texts, long):
        for special in (False, True):
            assert t._encode_texts(batch, special) == [list(i) for i in hf(batch, add_special_tokens=special)["input_ids"]]
    assert t._encode_prompt(texts[0]) == list(hf(texts[0], add_special_tokens=True)["input_ids"])
    assert calls == []  # none went through the wrapper

    truncating = AutoTokenizer.from_pretrained(str(default_model_dir))
    truncating._tokenizer.enable_truncation(max_length=8)
    t = Tokenizer(truncating)
    assert t._backend is None
    assert t._encode_texts(texts[:1], False) == [list(hf(texts[0], add_special_tokens=False)["input_ids"])]
    assert len(t._encode_texts(texts[:1], False)[0]) > 8


class _CallCounter:
    """A tokenizer whose calls are recorded (attributes pass through)."""

    def __init__(self, hf: Any, calls: list) -> None:
        self._hf, self._calls = hf, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.append(args)
        return self._hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


class _PoolWatch:
    """A backend whose batch calls (the ones that wake its thread pool) are counted."""

    def __init__(self, backend: Any) -> None:
        self._backend, self.batches = backend, 0

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        self.batches += 1
        return self._backend.encode_batch_fast(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


async def test_a_chat_encoded_on_the_loop_never_wakes_the_tokenizers_thread_pool(tokenizer):
    """The loop's inline encodes go one text at a time (a batch call's pool wake-up held the loop
    for milliseconds at times); the ids are those of the chat template."""
    t = Tokenizer(tokenizer)
    await t.encode_chat([{"role": "user", "content": "warm up"}])  # sets up the split on the thread
    watch = _PoolWatch(t._backend)
    t.__dict__["_backend"] = watch
    try:
        for messages in _conversations()[:40]:
            assert (await t.encode_chat(messages)).ids == _reference(tokenizer, messages)
        assert watch.batches < 40  # only the long new parts, on the tokenizer thread
        short = [{"role": "user", "content": "a short question"}, {"role": "assistant", "content": "an answer"}]
        before = watch.batches
        assert (await t.encode_chat(short)).ids == _reference(tokenizer, short)
        assert watch.batches == before
    finally:
        t.close()
