"""Grammar masks on a GPU: the batched path (masks of many rows filled by llguidance's thread pool
into pinned host memory, copied without blocking, applied on the device) allows exactly the
tokens the CPU path allows, and a constrained generation on CUDA ends in JSON its schema accepts.

    python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_grammar_gpu.py
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pd_cluster import LLM
from pd_cluster.engine.grammar import Grammars, GrammarState
from pd_cluster.sampling_params import SamplingParams, StructuredOutput
from pd_cluster.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "ok": {"type": "boolean"}},
        "required": ["color", "n", "ok"]}
#: (schema, a prefix of an answer it accepts): rows at every kind of position, strict and not.
ROWS: list[tuple[dict, bool, str]] = [
    (PERSON, True, ""),
    (PERSON, True, '{"name": "Al'),
    (PERSON, True, '{"name": "Alice", "age": 4'),
    (PERSON, False, '{"name": "Alice", "age": 42'),
    (PICK, True, '{"color": "'),
    (PICK, True, '{"color": "green", "n": 7, "ok": '),
    (PICK, False, '{"color": "blue"'),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 3}, False, "[1, 2"),
]


class _Row:
    """What :meth:`Grammars.apply_masks` reads of a request (a ``GrammarRow``)."""

    def __init__(self, grammar: GrammarState | None, output: list[int]) -> None:
        self.grammar = grammar
        self.output_token_ids = output


def _rows(grammars: Grammars, tokenizer, copies: int) -> list[_Row]:
    """``copies`` times every row of :data:`ROWS`, with a row without a grammar after each."""
    rows = []
    for _ in range(copies):
        for schema, strict, prefix in ROWS:
            params = SamplingParams(structured=StructuredOutput.from_schema(schema, strict=strict))
            output = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
            rows.append(_Row(grammars.state(params, [1]), output))
            rows.append(_Row(None, []))
    return rows


def _masked(logits: torch.Tensor, grammars: Grammars, rows: Sequence[_Row]) -> torch.Tensor:
    logits = logits.clone()
    grammars.apply_masks(logits, rows)
    return logits.cpu()


def test_batched_gpu_masks_allow_exactly_what_the_cpu_path_allows(small_model: Path):
    tokenizer = load_tokenizer(small_model)
    vocab = -(-len(tokenizer) // 64) * 64 + 64  # padded, as models' vocabularies are
    eos = {int(tokenizer.eos_token_id)}
    on_cpu, on_gpu = Grammars(tokenizer, vocab, eos), Grammars(tokenizer, vocab, eos)
    cpu_rows, gpu_rows = _rows(on_cpu, tokenizer, copies=5), _rows(on_gpu, tokenizer, copies=5)  # 80 rows
    logits = torch.randn(len(cpu_rows), vocab, generator=torch.Generator().manual_seed(0))
    expected = _masked(logits, on_cpu, cpu_rows)
    got = _masked(logits.cuda(), on_gpu, gpu_rows)
    assert on_gpu._executor is not None, "the GPU rows went through the batched (thread pool) path"
    assert on_gpu._host_mask is not None and on_gpu._host_mask.is_pinned()
    allowed_cpu, allowed_gpu = expected > float("-inf"), got > float("-inf")
    assert torch.equal(allowed_gpu, allowed_cpu)
    assert torch.equal(got[allowed_gpu], logits[allowed_gpu])  # allowed logits are left as they were
    for i, row in enumerate(cpu_rows):
        if row.grammar is None:
            assert bool(allowed_gpu[i].all()), f"row {i} has no grammar and lost tokens"
        else:
            assert 0 < int(allowed_gpu[i].sum()) < vocab, f"row {i} is masked"


def _follows(value: object, schema: dict) -> bool:
    """Whether ``value`` is an object of exactly ``schema``'s (required) keys, each of its type
    and range (jsonschema is not installed on every GPU machine)."""
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    for key, item in value.items():
        rule = schema["properties"][key]
        if "enum" in rule:
            ok = item in rule["enum"]
        elif rule["type"] == "integer":
            ok = isinstance(item, int) and not isinstance(item, bool) and rule["minimum"] <= item <= rule["maximum"]
        elif rule["type"] == "boolean":
            ok = isinstance(item, bool)
        else:
            ok = isinstance(item, str) and len(item) <= rule["maxLength"]
        if not ok:
            return False
    return True


def test_constrained_generation_on_cuda_yields_json_its_schema_accepts(small_model: Path):
    llm = LLM(str(small_model), device="cuda", max_total_tokens=8192)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Pick a colour and a number, as JSON."}])
    schemas = [PICK, PICK, PERSON, PERSON]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, seed=i, max_tokens=64,
                             structured=StructuredOutput.from_schema(schema, strict=True))
              for i, schema in enumerate(schemas)]
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([prompt] * (len(schemas) + 1), [*params, free])
    for schema, out in zip(schemas, outputs):
        assert out.finish_reason == "stop", out.text
        assert _follows(json.loads(out.text), schema), out.text
    assert len(outputs[-1].token_ids) == 8  # the row without a grammar ran beside them
