"""A ChatSession's conversation bookkeeping on a scripted engine and a ChatML template with tools
(tests/fixtures/agent_chatml.jinja, the Qwen2.5 layout): the transcript is the first prompt, then per
turn exactly the engine's tokens and the template's text of the new messages alone, so that it
decodes to the template's rendering of the whole conversation; continuations that do not repeat
the conversation, a changed tool list, n > 1, too many turns and a full context are refused."""

from __future__ import annotations

import asyncio
import json

import pytest
from fixtures.agent_checks import ScriptedEngine
from fixtures.helpers import TESTS

from pipeline_rl.config.pool_sections import ActorConfig
from pipeline_rl.rollouts.agent.session import AgentError, ChatSession

TEMPLATE = (TESTS / "fixtures" / "agent_chatml.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline_rl.demo.tiny_model import make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    return tok


def actor() -> ActorConfig:
    return ActorConfig(max_new_tokens=64)


def run(coro):
    return asyncio.run(coro)


def test_tool_conversation_is_token_exact(tokenizer):
    engine = ScriptedEngine(tokenizer, [(CALL, "stop"), ("The sum is 3.", "stop")])

    async def episode():
        session = ChatSession(engine, actor(), 1.0, 8, TEMPLATE, None)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
        first = await session.chat.completions.create(messages=messages, tools=TOOLS, temperature=0.3)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.tool_calls is not None
        [call] = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
        # The returned object goes back as is, as openai code does; the tool's reply follows.
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        second = await session.chat.completions.create(messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "The sum is 3." and second.choices[0].finish_reason == "stop"
        return session, messages + [second.choices[0].message.model_dump(exclude_none=True)]

    session, messages = run(episode())
    r = session.rollout(1.0, error_reward=0.0)
    tokens = r.prompt_ids + r.completion_ids
    # Token-exact and still what the template makes of the whole conversation.
    whole = tokenizer.apply_chat_template(
        [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages],
        tools=TOOLS,
        chat_template=TEMPLATE,
        tokenize=False,
    )
    # (the template closes the last turn with a newline after the model's EOS)
    assert tokenizer.decode(tokens, skip_special_tokens=False) + "\n" == whole
    # Each turn's prompt was everything before it; the model's tokens are the engine's.
    assert engine.prompts == [r.prompt_ids, tokens[: len(engine.prompts[1])]]
    first_len = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1
    env = r.completion_ids[first_len : len(engine.prompts[1]) - len(r.prompt_ids)]
    assert tokenizer.decode(env, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    n_env, n_second = len(env), len(r.completion_ids) - first_len - len(env)
    assert r.mask == [1] * first_len + [0] * n_env + [1] * n_second
    assert r.versions == [1] * first_len + [-1] * n_env + [2] * n_second
    assert r.logprobs == [-0.25] * first_len + [0.0] * n_env + [-0.25] * n_second
    assert r.metadata["turns"] == 2 and r.finish_reason == "stop"


def test_a_turn_cut_off_gets_the_whole_closing(tokenizer):
    engine = ScriptedEngine(tokenizer, [("12", "length"), ("3", "stop")])

    async def episode():
        session = ChatSession(engine, actor(), 1.0, 8, TEMPLATE, None)
        messages = [{"role": "user", "content": "q"}]
        reply = await session.chat.completions.create(messages=messages)
        assert reply.choices[0].finish_reason == "length"
        await session.chat.completions.create(
            messages=messages + [reply.choices[0].message, {"role": "user", "content": "again"}]
        )
        return session

    r = run(episode()).rollout(0.0, error_reward=0.0)
    env = [t for t, m in zip(r.completion_ids, r.mask or []) if m == 0]
    assert tokenizer.decode(env, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda m, reply: [{"role": "user", "content": "other"}, reply, {"role": "user", "content": "x"}], "continue"),
        (lambda m, reply: m + [{"role": "assistant", "content": "9"}, {"role": "user", "content": "x"}], "continue"),
        (lambda m, reply: m + [reply], "must end with a message for the model"),
        (
            lambda m, reply: m + [reply, {"role": "assistant", "content": "9"}, {"role": "user", "content": "x"}],
            "only the model",
        ),
    ],
)
def test_messages_that_do_not_continue_the_conversation_are_refused(tokenizer, change, error):
    engine = ScriptedEngine(tokenizer, [("1", "stop")])

    async def episode():
        session = ChatSession(engine, actor(), 1.0, 8, TEMPLATE, None)
        messages = [{"role": "user", "content": "q"}]
        reply = await session.chat.completions.create(messages=messages)
        with pytest.raises(ValueError, match=error):
            await session.chat.completions.create(messages=change(messages, reply.choices[0].message))

    run(episode())


def test_refusals_and_limits(tokenizer):
    async def episode():
        engine = ScriptedEngine(tokenizer, [("1", "stop")] * 3)
        session = ChatSession(engine, actor(), 1.0, 2, TEMPLATE, None)
        messages = [{"role": "user", "content": "q"}]
        with pytest.raises(RuntimeError, match=r"actor\.domain_settings\.http: true"):
            _ = session.base_url
        with pytest.raises(ValueError, match="n=2"):
            await session.chat.completions.create(messages=messages, n=2)
        with pytest.raises(ValueError, match="stream=true"):
            await session.chat.completions.create(messages=messages, stream=True)
        for _ in range(2):
            reply = await session.chat.completions.create(messages=messages, tools=[])  # [] is no tools
            messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        with pytest.raises(ValueError, match="tools changed"):
            await session.chat.completions.create(messages=messages, tools=TOOLS)
        with pytest.raises(AgentError, match="max_turns=2"):
            await session.chat.completions.create(messages=messages)
        # The error sticks: an environment that catches it still ends the episode.
        with pytest.raises(AgentError, match="episode has ended"):
            await session.chat.completions.create(messages=messages)
        r = session.rollout(1.0, error_reward=-1.0)
        assert r.reward == -1.0 and r.finish_reason == "error" and "max_turns" in r.metadata["agent_error"]
        # The refused turn's messages never joined the transcript: it ends with the model's tokens.
        assert r.mask is not None and r.mask[-1] == 1 and r.metadata["turns"] == 2

        full = ChatSession(ScriptedEngine(tokenizer, [], max_model_len=8), actor(), 1.0, 8, TEMPLATE, None)
        with pytest.raises(AgentError, match="fills the context"):
            await full.chat.completions.create(messages=[{"role": "user", "content": "a long question"}])
        with pytest.raises(RuntimeError, match="before its first"):
            ChatSession(engine, actor(), 1.0, 8, TEMPLATE, None).rollout(1.0, 0.0)

    run(episode())


def test_a_template_that_drops_assistant_content_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, [])

    async def episode():
        session = ChatSession(engine, actor(), 1.0, 8, "{% for m in messages %}{{ m.role }}{% endfor %}", None)
        with pytest.raises(ValueError, match="does not render an assistant message's content"):
            await session.chat.completions.create(messages=[{"role": "user", "content": "q"}])

    run(episode())
