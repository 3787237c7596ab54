"""Environments for the agent tests (actor.agent.environment), written as for openai.AsyncOpenAI:
`async def run(client, problem) -> float` on the tiny arithmetic model (tests/agent_tiny.jinja).
The tiny model writes no <tool_call>, so the tool environments make the call themselves, as a
model would, and show the model the result."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import urllib.error
import urllib.request

CYCLE = ["fails", "hangs", "garbage", "add"]
_episodes = itertools.count()


def operands(prompt: str) -> tuple[int, int]:
    a, b = re.fullmatch(r"Q: (\d+)\+(\d+)=", prompt).groups()  # pyright: ignore[reportOptionalMemberAccess]
    return int(a), int(b)


def swapped(prompt: str) -> str:
    a, b = operands(prompt)
    return f"\nQ: {b}+{a}="


async def two_questions(client, problem: dict) -> float:
    """The sum, then the same sum swapped; 1 when both answers are right. A problem's
    `between_turns` (tests only) is awaited between the two turns."""
    messages = [{"role": "user", "content": problem["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": swapped(problem["prompt"])}]
    if "between_turns" in problem:
        await problem["between_turns"]()
    second = await client.chat.completions.create(model="policy", messages=messages)
    answers = [first.choices[0].message.content, second.choices[0].message.content]
    return float(all(a == problem["answer"] for a in answers))


async def checked_by_tool(client, problem: dict, tool: str = "add") -> float:
    """An answer, a call of `tool` on the operands, the tool's result shown, a second answer."""
    a, b = operands(problem["prompt"])
    messages = [{"role": "user", "content": problem["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=client.tools)
    call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": json.dumps({"a": a, "b": b})}}
    messages += [first.choices[0].message, await client.call_tool(call)]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=client.tools)
    return float(second.choices[0].message.content == problem["answer"])


async def cycling_tools(client, problem: dict) -> float:
    """checked_by_tool with a failing, a hanging, a garbage-returning and the working tool in turn."""
    return await checked_by_tool(client, problem, CYCLE[next(_episodes) % len(CYCLE)])


async def over_openai_http(client, problem: dict) -> float:
    """two_questions through the HTTP endpoint with the openai package's own client."""
    from openai import AsyncOpenAI

    remote = AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
    try:
        messages: list = [{"role": "user", "content": problem["prompt"]}]
        first = await remote.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        messages += [reply, {"role": "user", "content": swapped(problem["prompt"])}]
        second = await remote.chat.completions.create(model="policy", messages=messages, temperature=0.5)
    finally:
        await remote.close()
    problem.setdefault("replies", []).append((first, second))
    answers = [first.choices[0].message.content, second.choices[0].message.content]
    return float(all(a == problem["answer"] for a in answers))


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def raw_http(client, problem: dict) -> float:
    """One turn as raw JSON over HTTP, a request the session refuses, one to no session; the
    replies go into problem["raw"]."""
    url = f"{client.base_url}/chat/completions"
    messages = [{"role": "user", "content": problem["prompt"]}]
    ok = await asyncio.to_thread(post, url, {"model": "policy", "messages": messages})
    refused = await asyncio.to_thread(post, url, {"model": "policy", "messages": [{"role": "user", "content": "?"}]})
    nowhere = await asyncio.to_thread(post, url.replace("/sessions/", "/sessions/x"), {"messages": messages})
    problem.setdefault("raw", []).append((ok, refused, nowhere))
    return float(ok[1]["choices"][0]["message"]["content"] == problem["answer"])
