"""The parts of OpenAI's chat-completion objects that environment code reads, as dataclasses
with attribute access (`reply.choices[0].message.tool_calls[0].function.arguments`) and
`model_dump()` (a plain dict, what the HTTP endpoint sends), so code written against
openai.AsyncOpenAI runs unchanged without the openai package."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class _Dumpable:
    def model_dump(self, exclude_none: bool = False) -> dict[str, Any]:
        data = dataclasses.asdict(self)  # pyright: ignore[reportArgumentType]  (every subclass is a dataclass)
        return _without_none(data) if exclude_none else data


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


@dataclass
class Function(_Dumpable):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


@dataclass
class ToolCall(_Dumpable):
    id: str
    function: Function
    type: str = "function"


@dataclass
class Message(_Dumpable):
    content: str | None
    tool_calls: list[ToolCall] | None = None
    role: str = "assistant"


@dataclass
class Choice(_Dumpable):
    message: Message
    finish_reason: str
    """stop, length or tool_calls."""
    index: int = 0
    logprobs: None = None


@dataclass
class Usage(_Dumpable):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion(_Dumpable):
    id: str
    model: str
    created: int
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


def as_dict(message: Any) -> dict:
    """A message as a plain dict without None values: a dict, one of these dataclasses, or an
    openai/pydantic object (anything with model_dump)."""
    if isinstance(message, dict):
        return _without_none(message)
    if hasattr(message, "model_dump"):
        return _without_none(message.model_dump())
    raise TypeError(f"a message must be a dict or have model_dump(), got {type(message).__name__}")
