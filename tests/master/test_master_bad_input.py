"""Nothing a client sends makes the master answer 5xx, and every answer is counted.

Types are strict (no string read as a number or a boolean), text that is not Unicode is refused,
JSON nesting is bounded, and each refusal shows in ``pdc_requests_total`` by status.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from master.server import create_app
from tests.master_fakes import CHAT_MESSAGES, MODEL, make_settings, tiny_tokenizer, write_model_dir

CHAT = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("model"))
    app = create_app(make_settings(model_dir, max_body_bytes=512 * 1024), tokenizer=tiny_tokenizer())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _counts(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'pdc_requests_total\{status="(\w+)"\} (\S+)', text)}


def _post(client: TestClient, path: str, body: bytes):
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


# Raw bodies (JSON escapes kept as written, so lone surrogates reach the parser as the client sent them).
BAD_BODIES: dict[str, tuple[str, bytes, str | None]] = {
    "lone high surrogate in content": (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "a\\ud800b"}]}', None),
    "lone low surrogate in prompt": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\\udfff"}', None),
    "lone surrogate in a prompt list": ("/v1/completions", b'{"model": "tiny-llama", "prompt": ["\\ud800"]}', None),
    "lone surrogate in an unknown field's key": (
        "/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "extra": {"\\ud800": 1}}', None),
    "100k-deep arrays": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    "50k-deep objects in an ignored field": (
        "/v1/chat/completions", b'{"model": "tiny-llama", "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001, None),
    "65-deep lists in response_format": (
        "/v1/chat/completions",
        _json({**CHAT, "response_format": {"type": "text", "x": json.loads("[" * 64 + "]" * 64)}}), None),
    "max_tokens as a string": ("/v1/chat/completions", _json({**CHAT, "max_tokens": "8"}), "max_tokens"),
    "max_tokens as a float": ("/v1/completions", _json({**COMPLETION, "max_tokens": 8.5}), "max_tokens"),
    "max_tokens as a boolean": ("/v1/completions", _json({**COMPLETION, "max_tokens": True}), "max_tokens"),
    "stream as a string": ("/v1/chat/completions", _json({**CHAT, "stream": "yes"}), "stream"),
    "stream as a number": ("/v1/completions", _json({**COMPLETION, "stream": 1}), "stream"),
    "temperature as a string": ("/v1/chat/completions", _json({**CHAT, "temperature": "0.5"}), "temperature"),
    "seed as a string": ("/v1/completions", _json({**COMPLETION, "seed": "7"}), "seed"),
    "logprobs as a string": ("/v1/chat/completions", _json({**CHAT, "logprobs": "true"}), "logprobs"),
    "include_usage as a string": (
        "/v1/chat/completions", _json({**CHAT, "stream": True, "stream_options": {"include_usage": "1"}}),
        "stream_options"),
    "prompt ids as strings": ("/v1/completions", _json({**COMPLETION, "prompt": [["1", "2"]]}), "prompt"),
    "model as a number": ("/v1/completions", _json({**COMPLETION, "model": 5}), "model"),
    "content as a number": ("/v1/chat/completions", _json({**CHAT, "messages": [{"role": "user", "content": 5}]}),
                            "messages"),
    "NaN temperature": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}', "temperature"),
    "huge max_tokens": ("/v1/completions", _json({**COMPLETION, "max_tokens": 10**30}), None),
    "huge seed": ("/v1/completions", _json({**COMPLETION, "seed": 2**70}), "seed"),
    "negative token id": ("/v1/completions", _json({**COMPLETION, "prompt": [-1]}), "prompt"),
    "echo of a token id past the vocabulary": (
        "/v1/completions", _json({**COMPLETION, "prompt": [5552480256], "echo": True}), "prompt"),
    "a batch of prompts holding strings where ids go": (
        "/v1/completions", _json({**COMPLETION, "prompt": [["a", "b"], [1]]}), "prompt"),
    "a batch with a lone surrogate": ("/v1/completions", b'{"model": "tiny-llama", "prompt": ["a", "\\ud800"]}', None),
    "body is a string": ("/v1/completions", b'"hello"', None),
    "body is null": ("/v1/completions", b"null", None),
    "invalid UTF-8": ("/v1/completions", b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', None),
    "trailing garbage": ("/v1/completions", _json(COMPLETION) + b"}}", None),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_input_is_a_4xx_in_openai_shape_and_counted(client, name):
    path, body, param = BAD_BODIES[name]
    before = _counts(client).get("invalid", 0.0)
    response = _post(client, path, body)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert _counts(client)["invalid"] == before + 1


def test_control_characters_and_astral_text_are_tokenized_not_refused(client):
    # Accepted up to admission: 503 says "no nodes", so the text passed validation and tokenization.
    text = "a\x00b\x1f\u2028\ufffe\U0001f600 \ud83d\ude00"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
    assert _post(client, "/v1/chat/completions", body).status_code == 503
    assert _post(client, "/v1/completions", _json({"model": MODEL, "prompt": text})).status_code == 503


def test_integral_numbers_are_accepted_where_floats_are_expected(client):
    assert _post(client, "/v1/completions", _json({**COMPLETION, "temperature": 1, "top_p": 1})).status_code == 503


def test_refused_bodies_and_server_errors_are_counted(client):
    before = _counts(client)
    response = _post(client, "/v1/completions", _json({**COMPLETION, "padding": "x" * (600 * 1024)}))
    assert response.status_code == 413
    assert _post(client, "/v1/completions", _json(COMPLETION)).status_code == 503
    after = _counts(client)
    assert after["too_large"] == before.get("too_large", 0.0) + 1
    assert after["unavailable"] == before.get("unavailable", 0.0) + 1


def test_an_internal_error_is_a_counted_500_and_the_server_keeps_serving():
    class BrokenTokenizer:
        def __init__(self) -> None:
            self.inner = tiny_tokenizer()

        def __len__(self) -> int:
            return len(self.inner)

        def apply_chat_template(self, *args, **kwargs):
            raise MemoryError("internal detail")

    app = create_app(make_settings(served_model_name=MODEL), tokenizer=BrokenTokenizer())
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 500
        assert _counts(c)["error"] == 1.0
        assert c.get("/livez").status_code == 200
