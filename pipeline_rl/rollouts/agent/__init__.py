"""Agent environments: an OpenAI-style chat client over the actor's own engine.

An environment is `async def run(client, problem) -> float` (named by actor.domain_settings.environment,
run by the `agent` domain, pipeline_rl/rollouts/domains/agent.py). `client` is a `ChatSession`
(session.py): `await client.chat.completions.create(messages=..., tools=...)` as with
openai.AsyncOpenAI, `client.tools` (the OpenAI schemas of the tools in actor.domain_settings.tools),
`await client.call_tool(tool_call)` (runs one in a worker under a time limit, tools.py) and,
with actor.domain_settings.http, `client.base_url` for an environment in another process (http.py).

Every call is a generation request of the run on the actor's LLMClient; the conversation is
kept as tokens (transcript.py): the model's turns exactly as the engine produced them (with
their behaviour logprobs and policy versions) and, between turns, the new messages rendered by
the chat template once (template.py), with mask 0. The model's tool calls are parsed from its
text (tool_calls.py).

Errors: a tool that raises, hangs past actor.domain_settings.tool_timeout_s or returns neither a string
nor a JSON value, a conversation past actor.domain_settings.max_turns or past the engine's context all
raise an `AgentError` in the environment and end the episode; the rollout keeps the tokens so
far, gets actor.domain_settings.error_reward and the error text (metadata["agent_error"]), and the actor
counts it. Anything else an environment raises fails its group (counted as a lost group).
"""
