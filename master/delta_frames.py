"""The hot node frame, ``token_deltas``, read without building a pydantic model a delta.

A decode node sends one such frame a step, a delta for each of its running requests; validating
it into ``protocol.TokenDeltas`` cost the master more per token than writing the token to its
client. Most deltas are plain: a request id, its new token ids, their text, maybe a finish reason.
:func:`plain_deltas` reads a frame with ``orjson`` (strict JSON: no NaN, no half surrogate pairs)
and accepts it only when every delta is plain and each value has exactly the type the model would
hold (an ``int`` that is not a ``bool``, a ``str``, a known finish reason). Everything else, valid or not, answers None and goes
through ``protocol.parse_node_message`` as before: what this path takes is a strict subset of what
the model accepts, with the same values, so a malformed frame is rejected exactly as it was.
"""

from __future__ import annotations

from typing import get_args

import orjson

from pd_cluster import protocol

_FRAME_KEYS = frozenset({"type", "deltas"})
#: Keys a plain delta may carry; those but the first five only as null.
_DELTA_KEYS = frozenset({"type", "request_id", "token_ids", "text", "finish_reason", "logprobs", "prompt_logprobs",
                         "cached_tokens", "node_ttft_s", "beams"})
_FINISH_REASONS = frozenset(get_args(protocol.FinishReason))


#: A ``protocol.TokenDelta`` with no logprobs, beams or prefill report, as the fields that are set:
#: (request_id, token_ids, text, finish_reason). A plain tuple: built at the cost of one.
PlainDelta = tuple[str, list[int], str, "str | None"]


def delta_model(delta: PlainDelta) -> protocol.TokenDelta:
    """The same delta as the general path builds it (for the uncommon cases of its request)."""
    request_id, token_ids, text, finish_reason = delta
    return protocol.TokenDelta(request_id=request_id, token_ids=token_ids, text=text, finish_reason=finish_reason)


def plain_deltas(frame: str | bytes) -> list[PlainDelta] | None:
    """A ``token_deltas`` frame's deltas when all are plain (see the module's text); None otherwise."""
    if not isinstance(frame, str) or len(frame) > protocol.MAX_MESSAGE_BYTES:
        return None
    try:
        doc = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return None
    if type(doc) is not dict or doc.get("type") != "token_deltas" or not doc.keys() <= _FRAME_KEYS:
        return None
    items = doc.get("deltas")
    if type(items) is not list or not items:
        return None
    out: list[PlainDelta] = []
    append = out.append
    for item in items:
        if type(item) is not dict or not item.keys() <= _DELTA_KEYS:
            return None
        get = item.get
        request_id, token_ids, text, finish = get("request_id"), get("token_ids"), get("text", ""), get("finish_reason")
        if (type(request_id) is not str or type(token_ids) is not list or type(text) is not str
                or get("type", "token_delta") != "token_delta"):
            return None
        if finish is not None and (type(finish) is not str or finish not in _FINISH_REASONS):
            return None
        if len(item) > 5 and not (get("logprobs") is None and get("prompt_logprobs") is None
                                  and get("cached_tokens") is None and get("node_ttft_s") is None
                                  and get("beams") is None):
            return None
        for token_id in token_ids:
            if type(token_id) is not int:
                return None
        append((request_id, token_ids, text, finish))
    return out
