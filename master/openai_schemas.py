"""OpenAI request bodies (plus vLLM's sampling extras) and the response documents built from them.

Unknown fields are ignored, as vLLM does; fields we understand but cannot honour are refused
with 400 rather than silently dropped. Types are strict: a string is never
read as a number or a boolean (``"max_tokens": "8"`` and ``"stream": "yes"`` are 400s).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from master import tool_calls
from master.errors import APIError, bad_request, validation_message
from pd_cluster import protocol
from pd_cluster.sampling_params import MAX_GRAMMAR_CHARS, MAX_LOGPROBS, SamplingParams, StructuredOutput

#: OpenAI's default max_tokens for the legacy completions API.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Most choices one request may ask for (n, best_of): each runs as a request of its own.
MAX_CHOICES = 16
#: Seeds live in [0, 2**63); choice i of a request with seed s samples with seed (s + i) mod 2**63.
SEED_MODULUS = 2**63


#: Values of the sampling knobs that leave a beam search's raw logprobs as they are.
_BEAM_NEUTRAL: dict[str, tuple[float, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    #: The output follows the schema either way; strict also reads a missing additionalProperties
    #: as false, as OpenAI's strict mode does (the model cannot wander into keys of its own).
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        """The grammar this format asks for (None: free text); 400 when it cannot be one."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(kind="json_object")
        if self.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema.", "response_format")
        spec = StructuredOutput.from_schema(self.json_schema.schema_, strict=bool(self.json_schema.strict))
        if len(spec.json_schema or "") > MAX_GRAMMAR_CHARS:
            raise bad_request(f"response_format.json_schema.schema is longer than {MAX_GRAMMAR_CHARS} characters.",
                              "response_format")
        return spec


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    #: vLLM's extra: the logprob of each prompt token after the first, with the top k.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    #: vLLM's extra: every token of the logprobs named ``token_id:N`` (its id), not by its text, so
    #: a client gets the exact ids a detokenized text cannot give back.
    return_tokens_as_token_ids: bool = False
    #: vLLM's beam search: width max(n, best_of), the best n returned (deterministic: temperature 0).
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of < self.choices_returned:
            raise bad_request("best_of must be greater than or equal to n.", "best_of")
        if self.stream and self.choice_count > self.choices_returned:
            raise bad_request("best_of greater than n cannot be streamed.", "best_of")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        if self.stream and self.choice_count > 1:
            raise bad_request("Streaming is not supported with use_beam_search and n > 1.", "stream")
        if self.temperature not in (None, 0, 0.0):
            raise bad_request("use_beam_search is deterministic: temperature must be 0 or unset.", "temperature")
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            neutral = _BEAM_NEUTRAL[name]
            if value is not None and value not in neutral:
                raise bad_request(f"use_beam_search scores raw logprobs: {name} must be unset or {neutral[0]}.", name)
        for name in ("seed", "logit_bias", "stop", "prompt_logprobs"):
            if getattr(self, name) not in (None, [], {}):
                raise bad_request(f"{name} cannot be combined with use_beam_search.", name)
        if self.structured() is not None:
            raise bad_request("A structured output (response_format, a forced tool_choice) cannot be combined "
                              "with use_beam_search.", "response_format")
        if self.length_penalty is not None and not -10.0 <= self.length_penalty <= 10.0:
            raise bad_request("length_penalty must be in [-10, 10].", "length_penalty")

    @property
    def choices_returned(self) -> int:
        """How many choices the answer holds (n)."""
        return self.n or 1

    @property
    def choice_count(self) -> int:
        """How many choices are generated (best_of, at least n); the best n are returned."""
        return max(self.choices_returned, self.best_of or 1)

    def structured(self) -> StructuredOutput | None:
        """The grammar the answer must follow (None: free text)."""
        return self.response_format.structured() if self.response_format is not None else None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutput | None = None,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Build validated SamplingParams; invalid values become 400 naming the field.
        ``defaults``: the model's sampling defaults, for the fields the request leaves unset (a
        beam search takes none: it is deterministic)."""
        values: dict[str, Any] = {
            **(defaults if defaults and not self.use_beam_search else {}),
            "structured": structured,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.logit_bias:
            values["logit_bias"] = self.logit_bias
        if self.use_beam_search:
            values.update(use_beam_search=True, temperature=0.0, beam_width=self.choice_count,
                          beam_outputs=self.choices_returned, early_stopping=bool(self.early_stopping))
            if self.length_penalty is not None:
                values["length_penalty"] = self.length_penalty
        for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
            "top_k", "min_p", "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        try:
            return SamplingParams(**values)
        except ValidationError as exc:
            message, param = validation_message(list(exc.errors()))
            raise bad_request(message, param) from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages.{index}.content: only text parts are supported", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request(f"messages.{index}.tool_calls: only assistant messages make tool calls", "messages")
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise bad_request(f"messages.{index}.tool_calls: arguments of {call.function.name!r} are not "
                                      "JSON", "messages") from None
                # Templates read the arguments as a mapping (Hugging Face's convention).
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if self.role == "tool":
            if not self.tool_call_id:
                raise bad_request(f"messages.{index}: a tool message needs the tool_call_id it answers", "messages")
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice needs tools.", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not one of the tools.",
                              "tool_choice")
        if self.forced_functions is not None and self.response_format and self.response_format.type != "text":
            raise bad_request("A forced tool_choice and a JSON response_format cannot be combined.", "response_format")
        if self.parses_tool_calls and self.stream and self.choice_count > 1:
            raise bad_request("Streaming several choices with tools is not supported.", "n")

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or ()}

    @property
    def renders_tools(self) -> bool:
        """Tools go into the prompt unless tool_choice is "none" (the model is then not told of them)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parses_tool_calls(self) -> bool:
        return self.renders_tools

    @property
    def forced_functions(self) -> list[dict[str, Any]] | None:
        """The functions one of which the answer must call ("required" or a named function)."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
        return functions

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's shape)."""
        if not self.renders_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def structured(self) -> StructuredOutput | None:
        functions = self.forced_functions
        if functions is not None:
            return tool_calls.forced_call_grammar(functions)
        return super().structured()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported.", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported.", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; a batch of several is refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        if isinstance(prompt[0], int):
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise bad_request("Batched prompts are not supported; send one prompt per request.", "prompt")
        return prompt[0]  # type: ignore[return-value]


def parse_request(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise bad_request(message, param) from None


# ---- responses --------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(entries: list[protocol.TokenLogprob], token_text: Any) -> dict[str, Any]:
    """OpenAI chat ``logprobs.content`` from per-token logprobs (``token_text``: id -> str)."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        top = sorted(entry.top.items(), key=lambda kv: -kv[1])
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


def completion_logprobs(entries: list[protocol.TokenLogprob], token_text: Any, text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        tops.append({token_text(t): lp for t, lp in sorted(entry.top.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def error_event(error: APIError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
