"""Chat templates and tokenization for the master (nodes receive token ids, never text).

All encoding runs on one worker thread: it keeps long prompts off the event loop, and a fast
tokenizer must not be used by two threads at once (it raises "Already borrowed").
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from master.tool_calls import messages_without_tool_support, template_renders_tools

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class Tokenizer:
    """Async facade over a transformers tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the tokenizer thread (also used for other per-request CPU work)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return await self.run(self._encode_chat, messages, tools)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the model's chat template writes the tools (and tool calls) itself."""
        return template_renders_tools(getattr(self.hf, "chat_template", None) or "")

    async def encode_prompt(self, text: str) -> list[int]:
        return await self.run(self._encode_prompt, text)

    def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        from jinja2 import TemplateError

        extra: dict[str, Any] = {}
        if not self.renders_tools:
            if tools or any("tool_calls" in m or "tool_call_id" in m for m in messages):
                messages = messages_without_tool_support(messages, tools)
        elif tools:
            extra["tools"] = tools
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              **extra)
        except (TemplateError, ValueError) as exc:  # raise_exception() in templates, "no chat template"
            raise ChatTemplateError(f"could not apply the chat template: {exc}") from exc
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def _encode_prompt(self, text: str) -> list[int]:
        return [int(t) for t in self.hf(text, add_special_tokens=True)["input_ids"]]

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs show it."""
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
