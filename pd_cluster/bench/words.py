"""Token ids that stand for whole words, for benchmark text that tokenizes back to itself.

Text decoded from arbitrary token ids rarely encodes back to the same ids: merges change at the
seams, and partial UTF-8 bytes decode to replacement characters. A real model's answers mostly
do, so in a real chat the next turn's prompt repeats the ids the model generated and a decode
node's prefix cache holds them. Benchmarks with random-weight models keep that property by
speaking only in whole words: tokens that decode to a space and ASCII letters and encode back to
themselves. A run of them encodes to the same ids, since the tokenizer's pre-splitting cuts text
before each space-led word.
"""

from __future__ import annotations

import random
import re
from typing import Any

_WORD = re.compile(r" [A-Za-z]+")
#: How many random runs of words are checked to re-encode exactly before the set is trusted.
_CHECKS = 8
_CHECK_LEN = 64


def whole_word_ids(tokenizer: Any) -> list[int]:
    """Ids of ``tokenizer``'s ordinary tokens that are one space-led word each (ascending).

    Raises ``ValueError`` where there are none (tokenizers that do not keep a word's leading
    space in its token) or where runs of them do not encode back to themselves."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    size = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    candidates = [i for i, text in enumerate(texts) if i not in special and _WORD.fullmatch(text)]
    encoded = tokenizer([texts[i] for i in candidates], add_special_tokens=False)["input_ids"]
    words = [i for i, ids in zip(candidates, encoded) if list(ids) == [i]]
    if not words:
        raise ValueError("the tokenizer has no tokens that are one space-led word each")
    rng = random.Random(0)
    for _ in range(_CHECKS):
        run = rng.choices(words, k=_CHECK_LEN)
        if list(tokenizer.encode(tokenizer.decode(run), add_special_tokens=False)) != run:
            raise ValueError("runs of the tokenizer's word tokens do not encode back to themselves")
    return words
