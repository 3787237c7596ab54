"""ChatSession: one episode's OpenAI-style client (see pipeline_rl/rollouts/agent/__init__.py).

`create` takes the whole conversation each time, as the OpenAI API does. The first call renders
it with the chat template into the prompt; every later call must repeat the conversation so far
(the messages sent and the assistant replies received, in order; assistant replies are compared
by content, so an environment may pass them back as dicts or as the returned objects) and add
messages of other roles after the last reply. Those new messages alone are rendered and
appended to the transcript (template.py). Sampling is the run's: temperature and top_p are
shared.temperature and actor.top_p whatever a request asks (the trainer computes logprobs at
them), max_tokens is capped at actor.max_new_tokens, n must be 1 (a group's attempts are
separate episodes), stream must be false, other OpenAI options are ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from pipeline_rl.config.pool_sections import ActorConfig
from pipeline_rl.rollouts.agent.openai_types import ChatCompletion, Choice, Function, Message, ToolCall, Usage, as_dict
from pipeline_rl.rollouts.agent.template import ChatTemplate
from pipeline_rl.rollouts.agent.tool_calls import parse_reply
from pipeline_rl.rollouts.agent.tools import ToolError, Tools
from pipeline_rl.rollouts.agent.transcript import Transcript
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS
from pipeline_rl.streams.records import Rollout

_sessions = itertools.count()


class AgentError(RuntimeError):
    """Ends the episode: the rollout keeps its tokens and gets the domain's error_reward."""


class _Completions:
    def __init__(self, session: ChatSession):
        self.create = session.create


class _Chat:
    def __init__(self, session: ChatSession):
        self.completions = _Completions(session)


def _same_turn(sent: dict, known: dict) -> bool:
    keys = ("role", "content") if known.get("role") == "assistant" else ("role", "content", "tool_call_id")
    return all(sent.get(k) == known.get(k) for k in keys)


class ChatSession:
    def __init__(
        self,
        llm: Any,
        actor: ActorConfig,
        temperature: float,
        max_turns: int,
        template: str | None,
        tools: Tools | None,
    ):
        self.llm, self.actor, self.template_text, self.tool_box = llm, actor, template, tools
        self.temperature, self.max_turns = temperature, max_turns
        self.id = f"s{next(_sessions)}"
        self.loop = asyncio.get_running_loop()
        """The loop the engine requests run on (the HTTP endpoint's threads submit to it)."""
        self.chat = _Chat(self)
        self.served_at: str | None = None
        """Where the HTTP endpoint serves this session (set by it), or None."""
        self.transcript: Transcript | None = None
        self.messages: list[dict] = []
        self.template: ChatTemplate | None = None
        self.request_tools: list[dict] | None = None
        self.tool_calls = self.tool_errors = self.malformed_tool_calls = 0
        self.tool_s = 0.0
        self._busy = False
        self.error: str | None = None
        """Why the episode ended early (sticky: an environment that catches the AgentError
        still gets the error reward)."""

    @property
    def base_url(self) -> str:
        """This session's OpenAI base URL (.../v1), for an environment in another process."""
        if self.served_at is None:  # never None into an OpenAI client: it would call api.openai.com
            raise RuntimeError(f"client.base_url needs {DOMAIN_SETTINGS}.http: true")
        return self.served_at

    @property
    def tools(self) -> list[dict]:
        """OpenAI schemas of the agent domain's tools, to pass as `tools=`."""
        return list(self.tool_box.schemas) if self.tool_box else []

    def _end(self, error: AgentError) -> AgentError:
        self.error = self.error or str(error)
        return error

    async def create(
        self,
        messages: list[Any],
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        n: int = 1,
        stop: str | list[str] | None = None,
        stream: bool = False,
        **_ignored: Any,
    ) -> ChatCompletion:
        """One model turn (as openai's `client.chat.completions.create`)."""
        if stream:
            raise ValueError("stream=true is not served: the reply comes whole")
        if self.error is not None:
            raise AgentError(f"the episode has ended: {self.error}")
        if self._busy:
            raise ValueError("one request at a time: this conversation has a turn in progress")
        if n != 1:
            raise ValueError(f"n={n}: each episode is one conversation (actor.attempts episodes make a group)")
        self._busy = True
        try:
            return await self._turn(
                [as_dict(m) for m in messages], tools or None, max_completion_tokens or max_tokens, stop
            )
        finally:
            self._busy = False

    async def _turn(
        self, sent: list[dict], tools: list[dict] | None, max_tokens: int | None, stop: str | list[str] | None
    ) -> ChatCompletion:
        between = self._between(sent, tools)
        transcript = self.transcript
        assert transcript is not None
        prompt = transcript.tokens + between
        if transcript.turns >= self.max_turns:
            raise self._end(AgentError(f"more than {DOMAIN_SETTINGS}.max_turns={self.max_turns} model turns"))
        room = self.llm.max_model_len - len(prompt)
        limit = min(max_tokens or self.actor.max_new_tokens, self.actor.max_new_tokens, room)
        if limit < 1:
            raise self._end(AgentError(f"the conversation fills the context ({len(prompt)} tokens)"))
        (completion,) = await self.llm.generate(
            prompt,
            n=1,
            max_tokens=limit,
            temperature=self.temperature,
            top_p=self.actor.top_p,
            stop=[stop] if isinstance(stop, str) else stop,
        )
        if between:
            transcript.add_environment(between)
        transcript.add_model_turn(completion)
        reply = parse_reply(completion.text, f"call_{self.id}_{transcript.turns}_")
        self.malformed_tool_calls += reply.malformed
        self.messages = sent + [
            {
                "role": "assistant",
                "content": reply.content,
                **({"tool_calls": reply.tool_calls} if reply.tool_calls else {}),
            }
        ]
        calls = [ToolCall(c["id"], Function(**c["function"])) for c in reply.tool_calls] or None
        finish = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
        return ChatCompletion(
            id=f"chatcmpl-{self.id}-{transcript.turns}",
            model="policy",
            created=int(time.time()),
            choices=[Choice(Message(reply.content, calls), finish)],
            usage=Usage(len(prompt), len(completion.token_ids), len(prompt) + len(completion.token_ids)),
        )

    def _between(self, sent: list[dict], tools: list[dict] | None) -> list[int]:
        """The new messages' tokens after the transcript (none on the first call, whose messages
        become the transcript's prompt). They join the transcript only with the turn they prompt."""
        if not sent or sent[-1].get("role") == "assistant":
            raise ValueError("messages must end with a message for the model to answer (not an assistant message)")
        if self.transcript is None:
            self.template = ChatTemplate(self.llm.tokenizer, self.template_text, tools)
            self.request_tools = tools
            self.transcript = Transcript(self.template.prompt_ids(sent))
            return []
        assert self.template is not None
        if tools != self.request_tools:
            raise ValueError("tools changed within a conversation (they are rendered once, into its first prompt)")
        known = len(self.messages)
        if len(sent) <= known or not all(_same_turn(s, k) for s, k in zip(sent, self.messages)):
            raise ValueError(
                "messages do not continue this conversation: send every earlier message and assistant reply "
                "unchanged, then the new ones"
            )
        new = sent[known:]
        if any(m.get("role") == "assistant" for m in new):
            raise ValueError("a new assistant message: only the model writes the assistant's turns")
        last = self.transcript.completion_ids[-1] if self.transcript.completion_ids else None
        return self.template.between_turns(last, new)

    async def call_tool(self, tool_call: Any) -> dict:
        """Run one of the model's tool calls (a returned ToolCall, or its dict) with the configured
        tool; the tool message to send back. A failure ends the episode (AgentError)."""
        call = as_dict(tool_call)
        function = call.get("function", {})
        self.tool_calls += 1
        if self.tool_box is None:  # counted as a failed call, as one naming an unknown tool is
            self.tool_errors += 1
            raise self._end(
                AgentError(f"the model called a tool, but {DOMAIN_SETTINGS}.tools and mcp_servers are empty")
            )
        start = time.monotonic()
        try:
            text = await self.tool_box.call(function.get("name", ""), function.get("arguments", "{}"))
        except ToolError as e:
            self.tool_errors += 1
            raise self._end(AgentError(str(e))) from None
        finally:  # a failed call's time counts too (a hanging tool's is the limit)
            self.tool_s += time.monotonic() - start
        return {"role": "tool", "tool_call_id": call.get("id", ""), "name": function.get("name"), "content": text}

    def rollout(self, reward: float | None, error_reward: float) -> Rollout:
        """The finished episode's Rollout; `reward` is the environment's (None: it raised an AgentError)."""
        if self.transcript is None:
            raise RuntimeError("the environment returned before its first chat.completions.create call")
        metadata: dict[str, Any] = {
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_s": self.tool_s,
            "malformed_tool_calls": self.malformed_tool_calls,
        }
        if self.error is not None:
            return self.transcript.rollout(error_reward, "error", agent_error=self.error, **metadata)
        assert reward is not None
        return self.transcript.rollout(reward, **metadata)
