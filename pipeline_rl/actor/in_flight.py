"""Rollouts in flight, kept across stops: what an actor saves of the groups it is generating, and
how a saved group is continued instead of generated again.

Every group's rollout (the domain's function) samples through a `RecordingGenerator`, which
keeps the handles of its generate calls. At a save (every `actor.in_flight_save_s`, and at a
graceful stop with the engine held, so that nothing is generated after it) the actor takes one
engine snapshot of every call of every group in flight (engine/llm_client.py `snapshot`) and
writes an `InFlight` file: per group its id, its problem and per call the prompt, n and each
sequence as far as it had got (tokens, sampled logprobs, per-token versions; finished ones whole).

Continuing: the domain's rollout runs again on the saved problem, through a RecordingGenerator
that holds the saved calls. Its k-th generate call must be the saved k-th (the same prompt and
n; else `ContinuationMismatch`, and the group is counted lost) and gets the saved sequences back:
finished ones as they were, unfinished ones continued under the engine's current weights. The
record is the one an uninterrupted rollout would have made, apart from the versions of the
tokens generated after the stop. Only domains marked continuable are continued
(rollouts/domains `continuable`): given the same results, their rollout makes the same calls.

Which saved groups a restarted actor continues: those that did not land in its stream partition
after the save (`InFlight.stream_end`). So a file read at two restarts in a row continues
nothing twice, and an actor killed between saves loses only what it generated after the last.
Redis streams drop what the preprocessors consumed: where groups that landed after the save are
gone, which saved groups landed cannot be told, and none is continued (they are counted lost,
never trained twice).

Hand-over: an actor leaving a scaled-down job saves its groups into a hand-over file and leaves
at once; an actor that stays claims the file by renaming it (one claimant) and continues them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline_rl.engine.sequences import Completion

HANDOVER_PREFIX = "handover-"


class ContinuationMismatch(RuntimeError):
    """A continued rollout asked for another generation than the one saved."""


def completion_to_dict(c: Completion | None) -> dict | None:
    if c is None:
        return None
    return {
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
        "versions": c.versions,
        "finish_reason": c.finish_reason,
        "text": c.text,
    }


def completion_from_dict(d: dict | None, where: str) -> Completion | None:
    if d is None:
        return None
    try:
        c = Completion(d["token_ids"], d["logprobs"], d["versions"], d["finish_reason"], d["text"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a saved completion ({e!r})") from None
    if not len(c.token_ids) == len(c.logprobs) == len(c.versions):
        raise ValueError(
            f"{where}: {len(c.token_ids)} tokens, {len(c.logprobs)} logprobs and {len(c.versions)} versions"
        )
    return c


@dataclass
class SavedCall:
    """One generate call of a rollout, as far as it had got."""

    prompt_ids: list[int]
    n: int
    parts: list[Completion | None]
    """Per sequence: finished, unfinished (finish_reason ""), or None (no token yet)."""

    @property
    def tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.parts if p is not None)


@dataclass
class SavedGroup:
    """One group in flight: enough to continue its rollout on any actor."""

    group_id: str
    problem: dict[str, Any]
    calls: list[SavedCall] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Generated tokens it holds (what continuing it saves generating again)."""
        return sum(c.tokens for c in self.calls)

    def to_dict(self) -> dict:
        return {
            "group_id": self.group_id,
            "problem": self.problem,
            "calls": [
                {"prompt_ids": c.prompt_ids, "n": c.n, "parts": [completion_to_dict(p) for p in c.parts]}
                for c in self.calls
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, where: str) -> SavedGroup:
        try:
            calls = [
                SavedCall(
                    c["prompt_ids"],
                    c["n"],
                    [completion_from_dict(p, f"{where}, call {k}, sequence {i}") for i, p in enumerate(c["parts"])],
                )
                for k, c in enumerate(d["calls"])
            ]
            return cls(d["group_id"], d["problem"], calls)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a saved group ({e!r})") from None


@dataclass
class InFlight:
    """An actor's groups in flight at one save."""

    groups: list[SavedGroup]
    stream_end: str | None = None
    """Its stream partition's end at the save: a saved group that landed after it is not continued."""

    def save(self, path: Path) -> None:
        """Replace `path` atomically (a kill mid-write leaves the previous save)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps({"stream_end": self.stream_end, "groups": [g.to_dict() for g in self.groups]}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> InFlight | None:
        """The saved groups, or None when `path` does not exist."""
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as e:
            raise ValueError(f"in-flight file {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
            raise ValueError(f"in-flight file {path}: expected an object with a list of groups")
        groups = [SavedGroup.from_dict(g, f"{path}, group {i}") for i, g in enumerate(data["groups"])]
        return cls(groups, data.get("stream_end"))


def claim_handovers(directory: Path, claimant: str) -> tuple[list[SavedGroup], list[Path]]:
    """The groups of every hand-over file in `directory` that `claimant` wins (by renaming it:
    of actors claiming at once, one gets each file), and the claimed files, which the claimant
    removes once its own file holds the groups. Files claimed by an earlier `claimant` that was
    killed before removing them are taken again (a group it had saved already has its id)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], []
    mine = f"claimed-by-{claimant}-"
    claimed = [directory / n for n in names if n.startswith(mine)]
    for name in names:
        if name.startswith(HANDOVER_PREFIX) and name.endswith(".json"):
            try:
                os.rename(directory / name, directory / f"{mine}{name}")
            except FileNotFoundError:
                continue  # another actor claimed it
            claimed.append(directory / f"{mine}{name}")
    groups: list[SavedGroup] = []
    for path in claimed:
        saved = InFlight.load(path)
        groups.extend(saved.groups if saved else [])
    return groups, claimed


class RecordingGenerator:
    """What one group's rollout samples through: the actor's engine, with its generate calls'
    handles kept for snapshots and, for a continued group, its saved calls given back in order."""

    def __init__(self, llm: Any, saved: Sequence[SavedCall] = ()):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.saved = list(saved)
        self.prompts: list[tuple[list[int], int]] = []
        """Each call's prompt and n, in order."""
        self.handles: list[Any] = []
        """Each call's group in the engine, in order (a call appends its own when it starts)."""

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        *,
        ignore_eos: bool = False,
    ) -> list[Completion]:
        k = len(self.prompts)
        resume = None
        if k < len(self.saved):
            saved = self.saved[k]
            if saved.prompt_ids != list(prompt_ids) or saved.n != n:
                raise ContinuationMismatch(
                    f"generate call {k} of the continued rollout has a prompt of {len(prompt_ids)} tokens and "
                    f"n={n}, the saved call {len(saved.prompt_ids)} tokens and n={saved.n}"
                )
            resume = saved.parts
        self.prompts.append((list(prompt_ids), n))
        return await self.llm.generate(
            prompt_ids,
            n,
            max_tokens,
            temperature,
            top_p,
            stop,
            ignore_eos=ignore_eos,
            resume=resume,
            handle=self.handles,
        )

    def calls(self, parts: Sequence[list[Completion | None]]) -> list[SavedCall]:
        """The calls so far, with `parts` the engine's snapshot of `handles`."""
        return [SavedCall(p, n, list(q)) for (p, n), q in zip(self.prompts, parts)]
