"""The wire contract: every name that crosses a process boundary, defined once.

Pools talk only through streams (see ARCHITECTURE.md). A topic name, a record kind or an
environment variable written by one process and read by another lives here and nowhere
else, so renaming one cannot leave a reader listening on the old name.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Topic(StrEnum):
    """Stream topics. Partitioned topics say who owns which partition."""

    ACTOR = "actor"
    """Rollout groups; partition i is written by actor i."""
    SCORED = "scored"
    """Scored groups from preprocessors 1..n-1 to preprocessor 0 (partition = preprocessor)."""
    TRAINER = "trainer"
    """Micro-batches; partition r is read by trainer rank r."""
    WEIGHTS = "weights"
    """Weight-version announcements from trainer rank 0 to every actor."""
    METRICS = "metrics"
    """Metrics records from every process, read by the launcher's status line."""
    SCORER_DEAD = "scorer.dead"
    """Groups a scorer failed on, with the error (dead letters)."""
    LOST = "lost"
    """Groups an actor wrote that no step will take (scorer failure, undecodable record);
    partition i is read by actor i, whose admission budget gives them back."""
    STEP_REQUESTS = "step_requests"
    """Step guidance: partial rollouts to score at a step boundary; partition i is written by
    actor i and read by the preprocessor that reads actor i's groups."""
    STEP_VERDICTS = "step_verdicts"
    """Step guidance: the scores of those steps; partition i is read by actor i."""
    ACTOR_COUNT = "actor_count"
    """The number of actors a running job was scaled to, from the launcher (its last record
    written since the launch holds; before any, world.actors): read by every pool."""


CONSUMED_TOPICS = frozenset({Topic.ACTOR, Topic.SCORED, Topic.TRAINER})
"""Topics whose every entry must reach its reader: never capped by length, trimmed only below
the positions their readers have durably saved (`Streams.trim_below`)."""


def dead_topic(topic: str) -> str:
    """Where a reader puts entries it cannot decode, with the error and the raw payload."""
    return f"{topic}.dead"


class Kind(StrEnum):
    """The `kind` field of every record; a reader refuses a record of another kind."""

    ROLLOUT_GROUP = "rollout_group"
    MICRO_BATCH = "micro_batch"
    WEIGHT_UPDATE = "weight_update"
    METRICS = "metrics"
    DEAD_LETTER = "dead_letter"
    GROUPS_LOST = "groups_lost"
    ACTOR_COUNT = "actor_count"
    STEP_REQUEST = "step_request"
    STEP_VERDICT = "step_verdict"


POOL_MODULES = {
    "actor": "pipeline_rl.actor",
    "preprocessor": "pipeline_rl.preprocess",
    "trainer": "pipeline_rl.trainer",
}
"""Pool name -> module the launcher runs as `python -m MODULE --run-dir DIR --index I`."""

WEIGHT_SYNC_ADDR_ENV = "PIPELINE_RL_WEIGHT_SYNC_ADDR"
"""host:port of the weight-broadcast group's rendezvous (trainer rank 0), set by the launcher."""

RUN_NONCE_ENV = "PIPELINE_RL_RUN_NONCE"
"""The nonce the launcher wrote into the run directory (RUN_NONCE_FILE) for this start: a pool
process refuses to run unless it reads the same (pipeline_rl/launch/run_dir.py)."""

LAUNCHED_AT_ENV = "PIPELINE_RL_LAUNCHED_AT"
"""When the launcher started the run (time.time()): the start of max_time_s, from which a
trainer pool restarted mid-run goes on with a schedule by time (trainer/model.py lr_factor)."""

RUN_NONCE_FILE = "run.nonce"
"""File of the run directory that holds the nonce of the launcher's latest start."""

CACHE_ENV = "PIPELINE_RL_CACHE"
"""Directory of locally built models and data sets (default `.cache`), read by the configs."""


def redis_namespace(run_name: str) -> str:
    """Prefix of every Redis key of a run, so runs can share one server."""
    return f"pipeline_rl:{run_name}"


class ExitCode(IntEnum):
    """Every exit code of the project's processes: the launcher's says how the run ended, a
    pool process's how it did."""

    OK = 0
    """The run finished (its trainers, or max_time_s), or a pool process did its part."""
    FAILED = 1
    """A process or a node failed (the launcher names it), or this pool process raised."""
    CONFIG_ERROR = 2
    """The launcher refused the configuration (the message names the key)."""
    PEER_GONE = 3
    """A pool process that failed because a peer it exchanges weights with is gone
    (weight_sync.PeerGone): the launcher then waits up to PEER_REPORT_WAIT_S for that peer's
    own failure and reports it as the cause (a worker that died, not the trainer that noticed
    first)."""
    STALLED = 4
    """The launcher's watchdog found no progress (watchdog_s) and stopped the run."""
    INTERRUPTED = 130
    """The launcher was stopped by a signal (Ctrl-C, SIGTERM)."""
