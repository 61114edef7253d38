"""A ``POST /v1/responses`` body (OpenAI's Responses API) read as the chat completion it asks for:
``input`` (text, or a list of messages, function calls and their outputs) and ``instructions``
become messages; ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (a JSON schema
through the grammar path), function ``tools`` and ``tool_choice`` their chat fields. The chat
route's validation then applies as it is.

The master keeps no responses: a request that needs server-side state (``previous_response_id``,
a ``conversation``, ``store: true``, ``background``) is refused with a 400 that says so.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from master import openai_schemas as oa
from master.errors import bad_request

#: Roles a Responses message may have, as chat names them (``developer`` is a system message).
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequest(BaseModel):
    """What the master reads of a Responses request; the rest is ignored, as on the other routes."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check_stateless(self) -> None:
        needs = [name for name, value in (("previous_response_id", self.previous_response_id),
                                          ("conversation", self.conversation), ("background", self.background))
                 if value]
        if self.store:
            needs.append("store")
        if needs:
            raise bad_request(f"{needs[0]}: this server keeps no responses (stateless); send the whole conversation "
                              "in `input` and set `store` to false.", needs[0], "unsupported_parameter")

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this asks for."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("response_format", self._response_format()),
                            ("tools", self._tools()), ("tool_choice", self._tool_choice())):
            if value is not None:
                body[name] = value
        return body

    def format(self) -> dict[str, Any]:
        """``text.format`` as the answer repeats it."""
        return (self.text or {}).get("format") or {"type": "text"}

    def _messages(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            messages.append(_message(item, f"input[{i}]"))
        return _merge_calls(messages)

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.format()
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise bad_request(f"text.format: type {kind!r} is not one of text, json_object, json_schema.", "text")

    def _tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: only function tools are supported (not {tool.get('type')!r}).",
                                  "tools")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request("tool_choice: only auto, none, required or {\"type\": \"function\", \"name\": ...}.",
                          "tool_choice")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item as a chat message (a function call as an assistant's tool call)."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else _text(output, where)}
    if kind != "message" or item.get("role") not in _ROLES:
        raise bad_request(f"{where}: expected a message (role user, assistant, system or developer), a "
                          f"function_call or a function_call_output.", "input")
    content = item.get("content")
    return {"role": _ROLES[item["role"]], "content": content if isinstance(content, str) else _text(content, where)}


def _text(parts: Any, where: str) -> str:
    """The text of a content list; other parts (images, files) cannot be read by this model."""
    if not isinstance(parts, list):
        raise bad_request(f"{where}.content: expected text or a list of text parts.", "input")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content: only text parts are supported (not {kind!r}).", "input")
        texts.append(part["text"])
    return "".join(texts)


def _merge_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function calls as one assistant message (how chat lists parallel calls)."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        last = merged[-1] if merged else None
        if message.get("tool_calls") and last is not None and last.get("tool_calls") and last["content"] is None:
            last["tool_calls"] = last["tool_calls"] + message["tool_calls"]
        else:
            merged.append(message)
    return merged


def parse(body: Any) -> ResponsesRequest:
    req = oa.parse_request(ResponsesRequest, body)
    req.check_stateless()
    return req
