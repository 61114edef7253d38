"""The grammar module on a tiny character vocabulary: masks allow exactly what the schema allows,
a decode node's rebuilt state equals the prefill node's, bad schemas are refused; and the engine
under a grammar (the default model), with and without overlap scheduling."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.grammar import GrammarError, Grammars, apply_token_bitmask, check_spec, token_bitmask_words
from pd_cluster.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutput
from pd_cluster.strict_schema import close_objects

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 {}[]\":,.-"
EOS = 2
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
ANSWER = '{"ok": true, "n": 42}'


@pytest.fixture(scope="module")
def tok():
    """A byte-level tokenizer of single characters holding JSON's (ids 3.. in CHARS order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {("\u0120" if ch == " " else ch): 3 + i for i, ch in enumerate(CHARS)}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def ids(text: str) -> list[int]:
    return [3 + CHARS.index(ch) for ch in text]


def allowed(grammars: Grammars, state) -> set[int]:
    mask = torch.full((1, token_bitmask_words(grammars.vocab_size)), -1, dtype=torch.int32)
    state.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
    return {t for t in range(grammars.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


class _Req:
    """What :meth:`Grammars.apply_masks` reads of a request (a ``GrammarRow``)."""

    def __init__(self, grammar, output: list[int]) -> None:
        self.grammar = grammar
        self.output_token_ids = output


def spec(schema: dict = SCHEMA) -> StructuredOutput:
    return StructuredOutput.from_schema(schema)


def test_mask_allows_exactly_the_next_characters_of_the_schema(tok):
    grammars = Grammars(tok, vocab_size=len(tok) + 5, eos_token_ids={EOS})  # padded vocabulary, as models have
    state = grammars.state(SamplingParams(structured=spec()), [1])
    output: list[int] = []
    for i, token in enumerate(ids(ANSWER)):
        assert allowed(grammars, state) == _next_chars(ANSWER[:i]), ANSWER[:i]
        output.append(token)
        state.sync(output)
        assert state.terminated == (i == len(ANSWER) - 1)


def _next_chars(prefix: str) -> set[int]:
    """What the schema allows after ``prefix`` of ANSWER (separators ", " and ": ", no other space)."""
    table = {"": "{", "{": '"', '{"': "o", '{"o': "k", '{"ok': '"', '{"ok"': ":", '{"ok":': " ", '{"ok": ': "tf",
             '{"ok": t': "r", '{"ok": tr': "u", '{"ok": tru': "e", '{"ok": true': ",", '{"ok": true,': " ",
             '{"ok": true, ': '"', '{"ok": true, "': "n", '{"ok": true, "n': '"', '{"ok": true, "n"': ":",
             '{"ok": true, "n":': " ", '{"ok": true, "n": ': "0123456789", '{"ok": true, "n": 4': "0123456789}",
             '{"ok": true, "n": 42': "}"}
    return set(ids(table[prefix]))


def test_masked_logits_pick_only_allowed_tokens_and_leave_other_rows(tok):
    grammars = Grammars(tok, vocab_size=len(tok), eos_token_ids={EOS})
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, len(tok), generator=gen)
    before = logits.clone()
    p = SamplingParams(structured=spec())
    reqs = [_Req(grammars.state(p, [1]), ids('{"ok": ')), _Req(None, []), _Req(grammars.state(p, [1]), [])]
    grammars.apply_masks(logits, reqs)
    assert torch.equal(logits[1], before[1])
    assert {i for i in range(len(tok)) if logits[0, i] > float("-inf")} == set(ids("tf"))
    assert {i for i in range(len(tok)) if logits[2, i] > float("-inf")} == set(ids("{"))
    assert torch.equal(logits[0][logits[0] > float("-inf")], before[0][logits[0] > float("-inf")])


def test_apply_token_bitmask_matches_a_loop():
    gen = torch.Generator().manual_seed(1)
    vocab = 77
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, token_bitmask_words(vocab)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    expected = logits.clone()
    for r in range(4):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_state_rebuilt_on_decode_equals_prefill_state(tok):
    """P samples the first token and D builds a fresh matcher from the spec; a migrated stream
    carries its earlier output in the prompt (``output_offset``). Every mask is the same."""
    answer = ids(ANSWER)
    prompt = [1, 5, 6]
    on_p = Grammars(tok, vocab_size=len(tok), eos_token_ids={EOS})
    on_d = Grammars(tok, vocab_size=len(tok), eos_token_ids={EOS})
    params = SamplingParams(structured=spec())
    p_state = on_p.state(params, prompt)
    p_state.sync(answer[:1])
    d_state = on_d.state(params, prompt)
    d_state.sync(answer[:1])  # D's request starts with P's first token
    assert allowed(on_p, p_state) == allowed(on_d, d_state)
    for k in range(2, len(answer)):
        p_state.sync(answer[:k])
        moved = on_d.state(params.model_copy(update={"output_offset": k - 1}), prompt + answer[: k - 1])
        moved.sync(answer[k - 1 : k])  # the new pair's first token, after the carried output
        assert allowed(on_p, p_state) == allowed(on_d, moved), k
    assert p_state.consumed == len(answer) - 1


def test_bad_schemas_are_refused():
    for schema in ({"type": "wrong"}, {"type": "string", "pattern": "(("}, {"$ref": "#/nowhere"},
                   {"type": "integer", "minimum": "x"}):
        with pytest.raises(GrammarError):
            check_spec(spec(schema))
    check_spec(spec())
    check_spec(StructuredOutput(kind="json_object"))
    with pytest.raises(ValidationError):
        StructuredOutput(kind="json_schema", json_schema="{not json")
    with pytest.raises(ValidationError):
        StructuredOutput(kind="json_object", json_schema="{}")
    with pytest.raises(ValidationError):
        StructuredOutput(kind="json_schema", json_schema=json.dumps({"enum": ["x" * MAX_GRAMMAR_CHARS]}))


def test_compiled_grammars_are_cached_per_spec_and_bounded(tok):
    grammars = Grammars(tok, vocab_size=len(tok), eos_token_ids={EOS}, cache_size=2)
    specs = [spec({"enum": [f"v{i}"]}) for i in range(3)]
    for s in specs:
        grammars.matcher(s)
    assert list(grammars._templates) == specs[1:]
    first = grammars._templates[specs[2]]
    grammars.matcher(spec({"enum": ["v2"]}))  # an equal spec reuses the compiled grammar
    assert grammars._templates[specs[2]] is first
    with pytest.raises(GrammarError):
        Grammars(None, vocab_size=10, eos_token_ids={EOS}).matcher(specs[0])


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM(str(default_model_dir), max_total_tokens=2048)


def test_engine_under_a_grammar_with_and_without_overlap(llm):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    prompt = llm.apply_chat_template([{"role": "user", "content": "Pick a colour, as JSON."}])
    structured = SamplingParams(temperature=0.0, max_tokens=40, structured=spec(schema))
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [alone] = llm.generate([prompt], plain)
    results = []
    for overlap in (False, True):
        llm.engine.config.overlap_schedule = overlap
        results.append(llm.generate([prompt, prompt], [structured, plain]))
    llm.engine.config.overlap_schedule = None
    for constrained, free in results:
        assert constrained.finish_reason == "stop"
        assert json.loads(constrained.text)["color"] in {"red", "green", "blue"}
        assert free.token_ids == alone.token_ids  # the other row of the batch is not masked
    assert results[0][0].token_ids == results[1][0].token_ids


def _object(props: dict, required: list[str] | None = None) -> dict:
    """An object schema that says nothing of additionalProperties."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


_INT = {"type": "integer"}
#: (schema without additionalProperties, a document it describes, the same with a key no object lists).
STRICT_CASES: list[tuple[dict, object, object]] = [
    (_object({"a": _INT, "b": {"type": "string"}}), {"a": 1, "b": "x"}, {"a": 1, "b": "x", "c": 2}),
    (_object({"inner": _object({"a": _INT})}), {"inner": {"a": 1}}, {"inner": {"a": 1, "z": 0}}),
    ({"type": "array", "items": _object({"a": _INT})}, [{"a": 1}], [{"a": 1}, {"a": 2, "z": 0}]),
    ({"$defs": {"P": _object({"a": _INT})}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}},
     {"p": {"a": 1}}, {"p": {"a": 1, "z": 0}}),
    ({"anyOf": [_object({"a": _INT}), _object({"b": _INT})]}, {"b": 1}, {"b": 1, "a": 1}),
    # Keys spread over allOf parts (one a reference) stay allowed; only unlisted ones are refused.
    ({"$defs": {"A": _object({"a": _INT})}, "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": _INT}}]},
     {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}),
    # Keys beside a union stay allowed in each branch.
    ({**_object({"kind": {"type": "string"}}), "oneOf": [_object({"x": _INT}, ["x"]), _object({"y": _INT}, ["y"])]},
     {"kind": "k", "x": 1}, {"kind": "k", "x": 1, "z": 0}),
]


@pytest.mark.parametrize("schema,listed,unlisted", STRICT_CASES)
def test_strict_closes_every_object_the_schema_does_not_open(schema, listed, unlisted):
    import jsonschema

    closed = close_objects(schema)
    jsonschema.validate(listed, schema)
    jsonschema.validate(unlisted, schema)  # JSON Schema itself allows the unlisted key
    jsonschema.validate(listed, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(unlisted, closed)
    check_spec(StructuredOutput.from_schema(schema, strict=True))


def test_strict_keeps_what_a_schema_says_of_extra_keys():
    free = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}},
                                             "meta": {"type": "object", "additionalProperties": True}}}
    closed = close_objects(free)
    assert closed["additionalProperties"] is False
    assert closed["properties"] == free["properties"]  # the objects that say it keep their word
    assert "additionalProperties" not in free  # the caller's schema is not changed
    assert close_objects({"type": "string"}) == {"type": "string"}
    assert StructuredOutput.from_schema(_object({"a": _INT})).json_schema == json.dumps(_object({"a": _INT}),
                                                                                        separators=(",", ":"))


def test_strict_mask_forbids_a_key_the_schema_does_not_list(tok):
    """After the last listed property only ``}`` may follow under strict; without strict, JSON
    Schema's default lets the object go on (``,`` and another key)."""
    schema = _object({"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}})
    grammars = Grammars(tok, vocab_size=len(tok), eos_token_ids={EOS})
    done = ids('{"ok": true, "n": 42')
    strict = grammars.state(SamplingParams(structured=StructuredOutput.from_schema(schema, strict=True)), [1])
    strict.sync(done)
    assert allowed(grammars, strict) == set(ids("}"))
    lax = grammars.state(SamplingParams(structured=StructuredOutput.from_schema(schema)), [1])
    lax.sync(done)
    assert set(ids("},")) <= allowed(grammars, lax)
    lax.sync(done + ids(', "'))
    assert set(ids("xyz")) <= allowed(grammars, lax)  # any key may follow
