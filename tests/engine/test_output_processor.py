"""Output processing: incremental text, stop strings and tokens, EOS, length, multi-byte text."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pd_cluster.engine.output_processor import OutputProcessor, OutputUpdate
from pd_cluster.sampling_params import SamplingParams

EOS = "<|endoftext|>"
IM_END = "<|im_end|>"
CORPUS = [
    "hello world, the end of the world.",
    "the quick brown fox jumps over the lazy dog",
    "stop here and there, then stop again",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: trained on ASCII only, so CJK and emoji split into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def _processor(tok: Any, prompt: str = "", eos: set[int] | None = None, **kw: Any) -> OutputProcessor:
    kw.setdefault("max_tokens", 10_000)
    eos_ids = {tok.convert_tokens_to_ids(EOS)} if eos is None else eos
    return OutputProcessor(tok, SamplingParams(**kw), eos_ids, tok.encode(prompt))


def _feed(proc: OutputProcessor, ids: list[int]) -> list[OutputUpdate]:
    updates = []
    for token_id in ids:
        updates.append(proc.append(token_id))
        if updates[-1].finish_reason is not None:
            break
    return updates


def _joined(updates: list[OutputUpdate]) -> str:
    return "".join(u.text_delta for u in updates)


def _token_texts(tok: Any, ids: list[int]) -> list[str]:
    return [tok.decode([i]) for i in ids]


def test_deltas_concatenate_to_the_full_decode_with_multibyte_text(tokenizer) -> None:
    text = "hello 世界, the 😀 end 🎉 of the world."
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters really are split
    proc = _processor(tokenizer, prompt="the quick")
    updates = _feed(proc, ids)
    assert _joined(updates) == proc.text == text
    assert all("\ufffd" not in u.text_delta for u in updates)
    assert all(u.finish_reason is None for u in updates)


def test_split_character_is_withheld_until_its_last_byte(tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) == 4
    proc = _processor(tokenizer)
    assert [u.text_delta for u in _feed(proc, ids)] == ["", "", "", "😀"]


def test_unfinished_character_is_flushed_when_length_ends_it(tokenizer) -> None:
    ids = tokenizer.encode("ab世")[:-1]  # stop one byte short of the character
    proc = _processor(tokenizer, max_tokens=len(ids))
    updates = _feed(proc, ids)
    assert updates[-1].finish_reason == "length"
    assert _joined(updates) == proc.text == tokenizer.decode(ids)
    assert all(not u.text_delta.endswith("\ufffd") for u in updates[:-1])


def test_stop_string_across_token_boundaries_cuts_the_text(tokenizer) -> None:
    text = "hello world, the end of the world."
    stop = "d, th"
    ids = tokenizer.encode(text)
    assert not any(stop in piece for piece in _token_texts(tokenizer, ids))
    proc = _processor(tokenizer, stop=[stop])
    updates = _feed(proc, ids)
    assert updates[-1].finish_reason == "stop"
    assert updates[-1].stop_reason == stop
    assert proc.text == _joined(updates) == "hello worl"
    assert len(updates) < len(ids)  # it ended at the token that completed the stop string


def test_possible_stop_prefix_is_withheld_then_released(tokenizer) -> None:
    ids = tokenizer.encode("hello world, the end")
    proc = _processor(tokenizer, stop=["world peace"], max_tokens=len(ids))
    seen = ""
    for token_id in ids:
        seen += proc.append(token_id).text_delta
        assert proc.text.startswith(seen)
        if proc.text == "hello world":
            assert seen == "hello "  # "world" might start "world peace"
    assert proc.finish_reason == "length"
    assert seen == proc.text == "hello world, the end"


def test_withheld_prefix_of_a_real_stop_is_never_shown(tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox")
    proc = _processor(tokenizer, stop=["brown fox"])
    updates = _feed(proc, ids)
    assert all("br" not in u.text_delta for u in updates)
    assert _joined(updates) == proc.text == "the quick "
    assert proc.stop_reason == "brown fox"


def test_earliest_stop_string_wins(tokenizer) -> None:
    proc = _processor(tokenizer, stop=["world", "lo w"])
    updates = _feed(proc, tokenizer.encode("hello world"))
    assert updates[-1].stop_reason == "lo w"
    assert proc.text == _joined(updates) == "hel"


def test_stop_token_id_finishes_without_its_text(tokenizer) -> None:
    comma = tokenizer.convert_tokens_to_ids(",")
    ids = tokenizer.encode("hello world, the end")
    assert comma in ids
    proc = _processor(tokenizer, stop_token_ids=[comma])
    updates = _feed(proc, ids)
    assert updates[-1].finish_reason == "stop"
    assert updates[-1].stop_reason == comma
    assert proc.text == _joined(updates) == "hello world"
    assert proc.token_ids == ids[: ids.index(comma) + 1]


def test_eos_finishes_with_stop_and_no_text(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    proc = _processor(tokenizer, skip_special_tokens=False)
    updates = _feed(proc, tokenizer.encode("hello world") + [eos])
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", None)
    assert proc.text == _joined(updates) == "hello world"
    assert proc.token_ids[-1] == eos


def test_ignore_eos_keeps_going_and_skips_special_text(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("hello") + [eos, eos] + tokenizer.encode(" world")
    proc = _processor(tokenizer, ignore_eos=True, max_tokens=len(ids))
    updates = _feed(proc, ids)
    assert len(updates) == len(ids)
    assert updates[-1].finish_reason == "length"
    assert proc.text == _joined(updates) == "hello world"


def test_ignore_eos_shows_special_text_when_not_skipped(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("hello") + [eos] + tokenizer.encode(" world")
    proc = _processor(tokenizer, ignore_eos=True, skip_special_tokens=False, max_tokens=len(ids))
    updates = _feed(proc, ids)
    assert proc.text == _joined(updates) == f"hello{EOS} world"


def test_stop_token_ids_apply_even_with_ignore_eos(tokenizer) -> None:
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    proc = _processor(tokenizer, ignore_eos=True, stop_token_ids=[im_end])
    updates = _feed(proc, tokenizer.encode("hi") + [im_end])
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", im_end)


def test_max_tokens_finishes_with_length(tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    proc = _processor(tokenizer, max_tokens=3)
    updates = _feed(proc, ids)
    assert len(updates) == 3 and len(proc.token_ids) == 3
    assert [u.finish_reason for u in updates] == [None, None, "length"]
    assert _joined(updates) == proc.text == tokenizer.decode(ids[:3])


def test_stop_string_on_the_last_allowed_token_reports_stop(tokenizer) -> None:
    ids = tokenizer.encode("hello world")
    proc = _processor(tokenizer, stop=["world"], max_tokens=len(ids))
    updates = _feed(proc, ids)
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == ("stop", "world")
    assert proc.text == "hello "


def test_append_after_finish_raises(tokenizer) -> None:
    proc = _processor(tokenizer, max_tokens=1)
    proc.append(tokenizer.encode("hi")[0])
    with pytest.raises(RuntimeError):
        proc.append(tokenizer.encode("hi")[0])


class _WindowRecorder:
    """Wraps a tokenizer and records the longest id list any decode call received."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.longest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, **kw)


def test_long_output_decodes_a_bounded_window(tokenizer) -> None:
    text = "the quick brown 狐狸 jumps over the lazy 🐶, hello world. " * 90
    ids = tokenizer.encode(text)
    assert len(ids) > 2000
    recorder = _WindowRecorder(tokenizer)
    proc = _processor(recorder, prompt="hello world " * 50, stop=["never appears"])
    updates = _feed(proc, ids)
    assert recorder.longest <= 12
    assert proc.text == text and proc.finish_reason is None
    assert text.startswith(_joined(updates))


def test_random_texts_round_trip_through_deltas(tokenizer) -> None:
    rng = random.Random(0)
    alphabet = list("abc ,.the") + ["世", "界", "😀", "é", "🎉", " the", " world"]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text)
        stop = rng.choice([[], ["the"], ["😀 "], ["界,", "e w"]])
        proc = _processor(tokenizer, stop=stop)
        updates = _feed(proc, ids + [eos])
        expected = min((text[: text.find(s)] for s in stop if s in text), key=len, default=text)
        assert proc.finish_reason == "stop"
        assert _joined(updates) == proc.text == expected, (text, stop)


def test_runs_of_skipped_special_tokens_keep_the_window_small(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("hello") + [eos] * 200 + tokenizer.encode(" world")
    recorder = _WindowRecorder(tokenizer)
    proc = _processor(recorder, ignore_eos=True)
    updates = _feed(proc, ids)
    assert recorder.longest <= 12
    assert proc.text == _joined(updates) == "hello world"
