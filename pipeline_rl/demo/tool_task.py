"""The tool-use task of `conf=tiny_tools`: multi-step arithmetic ("Q: 12+34+56=", the multistep
demo's problems) where the model may call a calculator tool, `add(a, b)`, and must end with the
final number. Its policy, tools_policy, is built by pipeline_rl/demo/tools_policy.py.

One episode (`solve`, the agent domain's environment) is a conversation in the policy's own chat
template (TEMPLATE, saved with its tokenizer): the model either works the sum out in one turn,
"12+34=46\\n46+56=102", or calls the tool, one call a turn, and reads each result, shown as
"\\n[46]", until it answers with a number:

    Q: 12+34+56=<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call><EOS>
    [46]<tool_call>{"name":"add","arguments":{"a":46,"b":56}}</tool_call><EOS>
    [102]102<EOS>

Reward 1 when the last turn stops by EOS and its text after the last "=" (the whole text when
it has none) is the answer, else 0. Without tools (actor.domain_settings.tools: []) a call ends the episode
with an error (the session's), which scores the domain settings' error_reward and is counted.

This module is imported by the tool workers: it needs nothing heavier than the standard library.
"""

from __future__ import annotations

import json
from typing import Any

TEMPLATE = (
    "{#- tools_policy's chat: the question as it is, each assistant turn (its text, then its tool calls)"
    " closed by EOS, a tool's result in brackets on a new line; the tools are not listed, the model knows"
    " its one tool from training. No generation prompt: the answer follows the question. -#}\n"
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'assistant' -%}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    '<tool_call>{"name":{{ c.function.name | tojson }},"arguments":{{ c.function.arguments }}}</tool_call>'
    "{%- endfor -%}<|endoftext|>\n"
    "{%- elif m.role == 'tool' -%}{{ '\\n[' + m.content + ']' }}\n"
    "{%- else -%}{{ m.content }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
)


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(int(a) + int(b))


def call_text(a: int, b: int) -> str:
    """How the policy writes a call of `add` (compact JSON in the Qwen2/Hermes tags)."""
    return (
        "<tool_call>"
        + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
        + "</tool_call>"
    )


def final_number(text: str) -> str:
    """What a last turn answers: the text after its last "=" (all of it when it has none)."""
    return text.strip().rpartition("=")[2].strip()


async def solve(client: Any, problem: dict) -> float:
    """One episode of `problem` (the agent domain's environment): the model's turns, each tool call run
    and its result shown, until a turn calls no tool; its max_turns setting bounds the loop."""
    messages: list[Any] = [{"role": "user", "content": problem["prompt"]}]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=client.tools)
        choice = reply.choices[0]
        messages.append(choice.message)
        if not choice.message.tool_calls:
            answered = final_number(choice.message.content or "") == problem["answer"]
            return float(choice.finish_reason == "stop" and answered)
        for call in choice.message.tool_calls:
            messages.append(await client.call_tool(call))
