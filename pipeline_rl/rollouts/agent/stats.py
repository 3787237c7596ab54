"""The actor's agent metrics, from the metadata of finished agent rollouts: turns, tool calls,
tool errors, tool time, malformed tool calls and episodes ended by an error, per metrics window
and in total."""

from __future__ import annotations

from typing import Any


class AgentStats:
    def __init__(self) -> None:
        self.rollouts = self.turns = self.tool_calls = self.tool_errors = 0
        self.tool_s = 0.0
        self.tool_calls_total = self.tool_errors_total = self.errors_total = self.malformed_total = 0
        self.last_error = ""
        self.seen = False

    def add(self, metadata: dict[str, Any]) -> None:
        if "tool_calls" not in metadata:  # not an agent rollout
            return
        self.seen = True
        self.rollouts += 1
        self.turns += metadata["turns"]
        self.tool_calls += metadata["tool_calls"]
        self.tool_errors += metadata["tool_errors"]
        self.tool_s += metadata["tool_s"]
        self.tool_calls_total += metadata["tool_calls"]
        self.tool_errors_total += metadata["tool_errors"]
        self.malformed_total += metadata.get("malformed_tool_calls", 0)
        if metadata.get("agent_error"):
            self.errors_total += 1
            self.last_error = str(metadata["agent_error"])

    def take(self) -> dict[str, Any]:
        """This window's values (none before the first agent rollout); starts a new window."""
        if not self.seen:
            return {}
        values: dict[str, Any] = {
            "agent/tool_calls": self.tool_calls,
            "agent/tool_errors": self.tool_errors,
            "agent/tool_calls_total": self.tool_calls_total,
            "agent/tool_errors_total": self.tool_errors_total,
            "agent/errors_total": self.errors_total,
            # <tool_call> blocks that were not a call (tool_calls.py): the model still learning the format
            "agent/malformed_tool_calls_total": self.malformed_total,
            "agent/last_error": self.last_error,
        }
        if self.rollouts:
            values["agent/turns_per_rollout"] = self.turns / self.rollouts
            values["agent/tool_calls_per_rollout"] = self.tool_calls / self.rollouts
        if self.tool_calls:
            values["agent/tool_s_per_call"] = self.tool_s / self.tool_calls
        self.rollouts = self.turns = self.tool_calls = self.tool_errors = 0
        self.tool_s = 0.0
        return values
