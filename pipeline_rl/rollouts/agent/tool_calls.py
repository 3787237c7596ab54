"""The model's tool calls, parsed from its text in the Qwen2/Hermes format: each call is one
JSON object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, as Qwen2 and
Qwen2.5 chat templates render tool calls and their instruct models write them.

A block that is not such an object (bad JSON, no name, arguments not an object, no closing tag)
is not a call: it stays in the message's content and is counted as malformed, so an environment
sees exactly what the model wrote."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass
class ParsedReply:
    content: str | None
    """The text without its tool calls (stripped); None when only tool calls remain (as OpenAI)."""
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
    malformed: int = 0
    """<tool_call> openings that did not make a call."""


def _call(body: str) -> tuple[str, dict] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def parse_reply(text: str, id_prefix: str) -> ParsedReply:
    """Split `text` into content and tool calls; call ids are `id_prefix` + their index."""
    calls: list[dict] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        parsed = _call(match.group(1))
        if parsed is None:
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        name, arguments = parsed
        calls.append(
            {
                "id": f"{id_prefix}{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[end:])
    content = "".join(kept).strip()
    return ParsedReply(content or (None if calls else ""), calls, text.count(OPEN) - len(calls))
