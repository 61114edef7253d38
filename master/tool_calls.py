"""Llama-3-style tool calls: the tools in the prompt, the grammar of a forced call, and the model's
output read back as OpenAI ``tool_calls`` (whole, or streamed as OpenAI streams them).

A call is written as Llama 3.1 writes one: ``{"name": "get_weather", "parameters": {...}}``
(``arguments`` is read too; several calls as a JSON list or separated by ``;``). A chat template
that renders ``tools`` itself gets them through ``apply_chat_template(tools=...)``; for one that
ignores them (the default model's), the master writes Llama 3.1's JSON tool prompt into the
system message and renders earlier calls as their JSON text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pd_cluster.sampling_params import StructuredOutput
from pd_cluster.strict_schema import close_objects

#: Llama 3.1's prompt for JSON tool calls (its chat template's wording).
TOOL_PROMPT = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
)
_PYTHON_TAG = "<|python_tag|>"
#: The start of one call, up to its arguments' first character.
_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of ``function`` (an OpenAI function definition); a ``strict``
    function's parameters hold only the keys they list."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if function.get("strict"):
        parameters = close_objects(parameters)
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def forced_call_grammar(functions: list[dict[str, Any]]) -> StructuredOutput:
    """The grammar of ``tool_choice`` "required" (a call of any of ``functions``) or a named
    function (``functions`` holds that one)."""
    schemas = [call_schema(f) for f in functions]
    return StructuredOutput.from_schema(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})


def template_renders_tools(chat_template: Any) -> bool:
    """Whether a chat template uses the ``tools`` it is given (a template that does not would
    silently drop them)."""
    source = json.dumps(chat_template) if not isinstance(chat_template, str) else chat_template
    return bool(re.search(r"\btools\b", source or ""))


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it."""
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def messages_without_tool_support(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` for a template that knows nothing of tools: the tool prompt (when ``tools``) in
    the system message, each earlier call as its JSON text, tool results as plain ``tool`` turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if calls:
            texts = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message["content"] = "; ".join(texts) if not message.get("content") else message["content"] + "\n" + "; ".join(texts)
        out.append(message)
    if tools:
        prompt = TOOL_PROMPT + "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(item: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("parameters", item.get("arguments"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, names: set[str]) -> list[ParsedCall] | None:
    """The calls ``text`` holds, or None when it is not (only) calls of the named functions. One
    call keeps the model's own arguments text (as it was streamed)."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body or body[0] not in "{[":
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        try:
            doc = [json.loads(part) for part in body.split(";") if part.strip()]
        except ValueError:
            return None
    items = doc if isinstance(doc, list) else [doc]
    calls = [_call_of(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    if isinstance(doc, dict) and (head := _HEAD.match(body)) is not None:
        raw = body[head.end():].rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
        try:
            if json.loads(raw) == json.loads(calls[0].arguments):  # type: ignore[union-attr]
                calls[0].arguments = raw  # type: ignore[union-attr]
        except ValueError:
            pass
    return calls  # type: ignore[return-value]


class ToolCallStream:
    """Turns an answer's text pieces into OpenAI chat deltas when the answer may be a tool call.

    Text that cannot start a call is passed on as ``content`` at once. Text that may (it starts
    with ``{``, ``[`` or the python tag) is held until the call's head shows the function's name:
    then one delta carries the call's id and name, and the arguments follow in pieces as they
    arrive (the last ``}`` held back: it may close the call rather than the arguments). Held text
    that never becomes a call is read whole at the end (a list of calls) or sent as content.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.state = "undecided"  # -> "content" | "call"
        self._args_start = 0
        self._sent = 0
        self.calls = 0

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.state == "content":
            return [{"content": piece}] if piece else []
        if self.state == "call":
            return self._arguments(final=False)
        stripped = self.text.lstrip()
        if not stripped:
            return []
        if not (stripped[0] in "{[" or stripped.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(stripped)):
            self.state = "content"
            return [{"content": self.text}]
        head = _HEAD.match(self.text)
        if head is None:
            return []
        if head["name"] not in self.names:
            self.state = "content"
            return [{"content": self.text}]
        self.state, self._args_start, self.calls = "call", head.end(), 1
        opening = {"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                   "function": {"name": head["name"], "arguments": ""}}]}
        return [opening, *self._arguments(final=False)]

    def _arguments(self, final: bool) -> list[dict[str, Any]]:
        args = self.text[self._args_start:]
        end = len(args.rstrip())
        if args[:end].endswith("}"):
            end -= 1
        if final:
            end = len(args[:end].rstrip())
        piece = args[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the answer ended."""
        if self.state == "call":
            return self._arguments(final=True)
        if self.state == "content":
            return []
        calls = parse_tool_calls(self.text, self.names)
        if calls is None:
            self.state = "content"
            return [{"content": self.text}] if self.text else []
        self.state, self.calls = "call", len(calls)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas
