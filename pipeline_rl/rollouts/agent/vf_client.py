"""A verifiers client over one ChatSession (imported only with the `verifiers` extra).

verifiers environments call the model through a `vf.Client`: it turns verifiers' messages and
tools into a provider's format, sends the request and turns the reply back into a
`vf.Response`. `SessionClient` keeps verifiers' own conversions for OpenAI chat completions and
sends the request to the episode's ChatSession instead of an HTTP endpoint, so every model turn
of a verifiers rollout is a generation request of the run, kept as the engine's tokens in the
session's transcript. verifiers reads no token ids from the reply: the trainer's tokens come from
the transcript alone.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf  # pyright: ignore[reportMissingImports]  (the optional `verifiers` extra)

from pipeline_rl.rollouts.agent.session import ChatSession


class SessionClient(vf.OpenAIChatCompletionsClient):
    def __init__(self, session: ChatSession):
        # Typed AsyncOpenAI upstream; the session has the one method used, chat.completions.create.
        super().__init__(session)  # pyright: ignore[reportArgumentType]

    async def get_native_response(
        self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **_request: Any
    ) -> Any:
        # _request: verifiers' per-request extras (its state, HTTP headers); the session needs none.
        args = {k: v for k, v in dict(sampling_args or {}).items() if v is not None}
        return await self.client.chat.completions.create(messages=prompt, model=model, tools=tools, **args)

    async def close(self) -> None:
        """The session belongs to the episode, not to the client."""
