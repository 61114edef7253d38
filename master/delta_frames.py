"""The hot node frame, ``token_deltas``, read without building a pydantic model a delta.

A decode node sends one such frame a step, a delta for each of its running requests; validating
it into ``protocol.TokenDeltas`` cost the master more per token than writing the token to its
client. Most deltas are plain: a request id, its new token ids, their text, maybe a finish reason.
:func:`plain_deltas` reads a frame with ``orjson`` (strict JSON: no NaN, no half surrogate pairs)
and accepts it only when every delta is plain and each value has exactly the type the model would
hold (an ``int`` that is not a ``bool``, a ``str``, a known finish reason). Everything else, valid or not, answers None and goes
through ``protocol.parse_node_message`` as before: what this path takes is a strict subset of what
the model accepts, with the same values, so a malformed frame is rejected exactly as it was.

A request's first delta from a node that prefilled it itself also says what its prefix cache held
(``cached_tokens``, ``node_ttft_s``). Such a delta is checked the same way and handed on as its
model, built from the values read; the plain deltas beside it in the frame stay plain (a frame
with one used to go the model's way whole, every one of its deltas).
"""

from __future__ import annotations

from typing import get_args

import orjson

from pd_cluster import protocol

_FRAME_KEYS = frozenset({"type", "deltas"})
#: Keys a plain delta may carry; those but the first five only as null (but for the prefill report).
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


def _prefill_report(cached: object, ttft: object) -> bool:
    """A first delta's prefill report holds exactly what the model takes: a count and seconds, neither negative."""
    return ((cached is None or (type(cached) is int and cached >= 0))
            and (ttft is None or ((type(ttft) is float or type(ttft) is int) and ttft >= 0)))


def plain_deltas(frame: str | bytes) -> list[PlainDelta | protocol.TokenDelta] | None:
    """A ``token_deltas`` frame's deltas when all are plain, or plain but for a prefill report
    (those as their model); None otherwise (see the module's text)."""
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
    out: list[PlainDelta | protocol.TokenDelta] = []
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
        cached, ttft = get("cached_tokens"), get("node_ttft_s")
        if len(item) > 5 and not (get("logprobs") is None and get("prompt_logprobs") is None
                                  and get("beams") is None and _prefill_report(cached, ttft)):
            return None
        for token_id in token_ids:
            if type(token_id) is not int:
                return None
        if cached is None and ttft is None:
            append((request_id, token_ids, text, finish))
        else:
            try:
                append(protocol.TokenDelta(request_id=request_id, token_ids=token_ids, text=text,
                                           finish_reason=finish, cached_tokens=cached, node_ttft_s=ttft))
            except ValueError:  # not expected of values checked above; the model's way says why
                return None
    return out
