"""How to pick tokens for one request, validated once at the edge."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pd_cluster.strict_schema import close_objects

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
#: Most entries a logit_bias map may hold (it travels with every prefill job and handover).
MAX_LOGIT_BIAS = 1024
#: OpenAI's range for one logit_bias value.
LOGIT_BIAS_LIMIT = 100.0
#: Longest grammar spec (a JSON schema's text) a request may carry: it travels with every prefill
#: job, handover and retry, and each node compiles it.
MAX_GRAMMAR_CHARS = 64 * 1024
#: Widest beam search: each beam is a running row of the batch.
MAX_BEAM_WIDTH = 16


class StructuredOutput(BaseModel):
    """The grammar a request's output must follow. It travels in the request's SamplingParams, so
    every node that samples for the request (P, D, a retry's pair) builds the same matcher and
    advances it over the output so far: nothing of the matcher's state is shipped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema"]
    #: The JSON schema's text (kind ``json_schema``), compact, so equal schemas share one compiled
    #: grammar (keys keep their order: it is the order properties are written in).
    json_schema: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _schema_matches_kind(self) -> "StructuredOutput":
        if (self.kind == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required for kind json_schema and only for it")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object")
        return self

    @classmethod
    def from_schema(cls, schema: object, strict: bool = False) -> "StructuredOutput":
        """A ``json_schema`` spec from a parsed schema (a dict), in compact text. ``strict`` closes
        its objects: one without ``additionalProperties`` holds only the keys it lists
        (:func:`pd_cluster.strict_schema.close_objects`)."""
        if strict:
            schema = close_objects(schema)
        return cls(kind="json_schema", json_schema=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


class SamplingParams(BaseModel):
    """Sampling settings of one request (the names and defaults users know from vLLM).

    Invalid values raise ``ValueError`` (pydantic's ``ValidationError``) naming the field.
    ``temperature == 0`` means greedy. ``seed`` names the request's random stream: a token's
    draw is a function of (seed, output position) only, so any node continues the same stream.
    ``logit_bias`` maps token ids to a value added to their logits before sampling (token ids
    are checked against the vocabulary by the engine and the master, which know it).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: no top-k cut")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="the logprob of each prompt token after the first (and the top k alternatives): computed "
                    "as the prompt is prefilled, never read from the prefix cache",
    )
    skip_special_tokens: bool = True
    logit_bias: dict[int, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )
    output_offset: int = Field(
        default=0, ge=0,
        description="how many of the prompt's last tokens are this request's own earlier output (a stream "
                    "that moved to another node): the random stream and the frequency/presence penalties "
                    "count them as output, so the stream goes on as if it had never moved",
    )
    structured: StructuredOutput | None = Field(
        default=None, description="a grammar the output must follow (JSON object, JSON schema, a tool call)"
    )

    use_beam_search: bool = Field(
        default=False, description="deterministic beam search: the best beams by length-penalized cumulative logprob"
    )
    beam_width: int = Field(default=1, ge=1, le=MAX_BEAM_WIDTH, description="beams searched at once")
    beam_outputs: int = Field(default=1, ge=1, le=MAX_BEAM_WIDTH, description="best beams returned (<= beam_width)")
    length_penalty: float = Field(
        default=1.0, ge=-10.0, le=10.0, description="a beam's score is its cumulative logprob / length ** this"
    )
    early_stopping: bool = Field(
        default=False, description="end a beam search once it has beam_width finished beams (transformers' rule)"
    )

    @model_validator(mode="after")
    def _beam_search_is_deterministic(self) -> "SamplingParams":
        if not self.use_beam_search:
            return self
        if self.beam_outputs > self.beam_width:
            raise ValueError("beam_outputs: must not exceed beam_width")
        refused = [name for name, ok in (
            ("temperature", self.temperature == 0.0), ("top_p", self.top_p == 1.0), ("top_k", self.top_k in (0, -1)),
            ("min_p", self.min_p == 0.0), ("repetition_penalty", self.repetition_penalty == 1.0),
            ("frequency_penalty", self.frequency_penalty == 0.0), ("presence_penalty", self.presence_penalty == 0.0),
            ("seed", self.seed is None), ("logit_bias", not self.logit_bias), ("stop", not self.stop),
            ("structured", self.structured is None), ("output_offset", self.output_offset == 0),
        ) if not ok]
        if refused:
            raise ValueError(f"use_beam_search: beam search is deterministic and scores raw logprobs; "
                             f"{refused[0]} must be left at its default (temperature 0)")
        return self

    def for_prefill(self) -> "SamplingParams":
        """How a prefill node runs the prompt: as asked; a beam search's as a greedy token that
        never ends the request, so its KV always goes to the decode node, which starts the search
        there (its first step computes the last prompt token again for its logits); that token
        is not output."""
        if not self.use_beam_search:
            return self
        return SamplingParams(temperature=0.0, max_tokens=max(self.max_tokens, 2), ignore_eos=True,
                              prompt_logprobs=self.prompt_logprobs)

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids_non_negative(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value or None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, value: object) -> object:
        return [] if value is None else value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
