"""The settings of the domains that talk to the engine through a chat client (the agent and
verifiers domains, under `actor.domain_settings`): the chat session's, and the MCP servers'."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline_rl.config import ConfigError
from pipeline_rl.config.bounds import bounded
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS


@dataclass
class ChatSettings:
    """The chat client's settings (pipeline_rl/rollouts/agent/session.py)."""

    chat_template: str | None = None
    """Path to a Jinja chat template; null: the tokenizer's own."""
    max_turns: int = bounded(8, ge=1)
    """Most model turns of one episode; one more ends it with an error."""
    error_reward: float = 0.0
    """Reward of an episode that ended with an error (a failed tool, too many turns, a full
    context, an environment's own failure)."""

    def template_text(self) -> str | None:
        """The text of chat_template (None: the tokenizer's own)."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        if not path.is_file():
            raise ConfigError(f"bad value for '{DOMAIN_SETTINGS}.chat_template': {path} is not a file")
        return path.read_text()


@dataclass
class McpServerConfig:
    """One MCP tool server the agent domain starts over stdio (its `mcp_servers`)."""

    command: str = ""
    """The program that runs the server, e.g. python or npx."""
    args: list[str] = field(default_factory=list)
    """Its arguments, e.g. the server script's path."""
    env: dict[str, str] | None = None
    """Its environment variables; null: the mcp package's default (a safe subset of the actor's)."""
