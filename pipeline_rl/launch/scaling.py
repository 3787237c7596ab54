"""Scaling a running job's actors: `pipeline-rl conf=X [key=value ...] --actors N` asks the
launcher running X's run directory to go to N actors, and prints its answer.

The request is a file in the run directory (REQUEST_FILE, replaced atomically; a newer request
replaces one not taken yet), which the run loop looks for between two polls of its processes.
The launcher writes the new count to the "actor_count" stream (pipeline_rl/core/actor_count.py)
and then, for more actors, starts the new ones where the placement of a run of N actors puts
them (one node: the plan's slots, GPUs included; Ray: a placement group of their own); for
fewer, the actors of the highest indices drain: each finishes its groups in flight, leaves the
weight-update group and exits 0, and is not restarted. Raised again before an actor has
drained, it just goes on. Each answer is a line of ANSWERS_FILE, which the asking command waits
for (ANSWER_WAIT_S) and prints.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

REQUEST_FILE = "scale_request.json"
ANSWERS_FILE = "scaling.jsonl"
ANSWER_WAIT_S = 120.0
"""How long `--actors` waits for the launcher's answer (it answers once the new actors were
placed and started: on Ray, once the cluster had room)."""
POLL_S = 0.2


@dataclass
class ScaleRequest:
    id: str
    actors: int
    time: float


@dataclass
class ScaleAnswer:
    id: str
    ok: bool
    message: str
    time: float


def request_actors(run_dir: Path, actors: int, wait_s: float = ANSWER_WAIT_S) -> tuple[bool, str]:
    """Ask the launcher of `run_dir` for `actors` actors; (whether it did, its answer)."""
    if actors < 1:
        return False, f"--actors {actors}: a job needs at least one actor"
    if not run_dir.is_dir():
        return False, f"no run directory {run_dir}: is the run started?"
    req = ScaleRequest(uuid.uuid4().hex, actors, time.time())
    tmp = run_dir / f"{REQUEST_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(req)))
    os.replace(tmp, run_dir / REQUEST_FILE)
    deadline = time.monotonic() + wait_s
    answers = run_dir / ANSWERS_FILE
    while time.monotonic() < deadline:
        for answer in read_answers(answers):
            if answer.id == req.id:
                return answer.ok, answer.message
        time.sleep(POLL_S)
    return False, f"no launcher answered within {wait_s:g} s: is a run of {run_dir} running?"


def read_answers(path: Path) -> list[ScaleAnswer]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [ScaleAnswer(**json.loads(line)) for line in lines if line.strip()]


class ScaleRequests:
    """The launcher's end: takes requests from the run directory and answers them."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / REQUEST_FILE
        self.answers = run_dir / ANSWERS_FILE
        self.path.unlink(missing_ok=True)  # one left from an earlier launch is not for this one

    def take(self) -> ScaleRequest | None:
        """The request waiting, if any (taken: it will not be returned again)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        self.path.unlink(missing_ok=True)
        try:
            fields = json.loads(text)
            return ScaleRequest(str(fields["id"]), int(fields["actors"]), float(fields["time"]))
        except (ValueError, KeyError, TypeError) as e:
            print(f"ignored a malformed scale request in {self.path}: {e}: {text[:200]!r}", flush=True)
            return None

    def answer(self, request: ScaleRequest, ok: bool, message: str) -> None:
        with open(self.answers, "a") as f:
            f.write(json.dumps(asdict(ScaleAnswer(request.id, ok, message, time.time()))) + "\n")
