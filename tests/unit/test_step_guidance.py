"""Step guidance without an engine: the rule checker of conf=tiny_long's steps, the scoring
service on real JSONL streams (verdicts to the asking actor, stale requests skipped and counted),
the actor's handling of verdicts (a cut at the scored step, a late verdict ignored and counted),
and what the policy gradient does with a cut attempt, against hand arithmetic."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from pipeline_rl.actor.step_guide import StepGuide
from pipeline_rl.config import AdvantageConfig, ConfigError, LossConfig, load_config
from pipeline_rl.demo.long_chain import StepChecker, chain
from pipeline_rl.engine.sequences import Completion
from pipeline_rl.preprocess.advantages import group_advantages
from pipeline_rl.preprocess.step_service import BATCH, STALE_S, StepService
from pipeline_rl.rollouts.domains import make_rollout
from pipeline_rl.rollouts.domains.multistep import score
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import RolloutGroup, StepRequest, StepVerdict
from pipeline_rl.trainer.loss import LossInputs, policy_loss
from pipeline_rl.wire import Topic


def test_the_checker_scores_a_prefix_right_while_every_finished_line_is_the_solutions():
    prompt, solution, _ = chain(3, 5, 4)  # "a3+5=8\nb5+8=3\nc8+3=1\nd3+1=4"
    lines = solution.split("\n")
    assert StepChecker.check(prompt, lines[0] + "\n") == 1.0
    assert StepChecker.check(prompt, "\n".join(lines[:3]) + "\n") == 1.0
    # The unfinished last line is not judged: its step has not ended.
    assert StepChecker.check(prompt, lines[0] + "\nb5+8=") == 1.0
    assert StepChecker.check(prompt, "a3+5=9\n") == 0.0  # a wrong sum
    assert StepChecker.check(prompt, lines[0] + "\nb8+5=3\n") == 0.0  # operands not read from the line before
    assert StepChecker.check(prompt, solution + "\ne1+4=5\n") == 0.0  # past the letter the prompt names
    assert StepChecker.check("no question", "a3+5=8\n") == 0.0


def service_config(tmp_path, **overrides):
    items = [f"run_dir={tmp_path}", "world.actors=2", "step_guidance.mode=cut"]
    items += ["step_guidance.scorer.cls=fixtures.step_scorers:WrongFromStep", "step_guidance.scorer.kwargs.bad=1"]
    return load_config("tiny", items + [f"{k}={v}" for k, v in overrides.items()])


def test_the_service_answers_each_actor_on_its_own_partition_and_skips_stale_requests(tmp_path):
    cfg = service_config(tmp_path)
    streams = open_streams(cfg)
    service = StepService(cfg, streams, index=0, actors=2)  # one preprocessor: both actors' requests
    assert service.partitions == [0, 1]
    now = time.time()
    requests = [
        StepRequest("g0/0/0", 0, 0, [1, 2], [5, 6, 9], now),
        StepRequest("g1/0/3", 1, 1, [1, 2], [5, 6, 9, 7, 9], now),
        StepRequest("g0/0/1", 0, 0, [1, 2], [5, 9], now - STALE_S - 1),  # left by an earlier run
    ]
    service.serve(requests)
    assert service.scorer.seen == [0, 1]  # pyright: ignore[reportAttributeAccessIssue]
    assert service.values()["step_guidance/stale_requests_total"] == 1
    assert service.values()["step_guidance/steps_scored_total"] == 2
    read = {
        actor: [e.record for e in streams.reader(Topic.STEP_VERDICTS, StepVerdict, partitions=(actor,)).read(0.5)]
        for actor in (0, 1)
    }
    assert [(v.key, v.end, v.score) for v in read[0]] == [("g0/0/0", 3, 1.0)]
    assert [(v.key, v.end, v.score) for v in read[1]] == [("g1/0/3", 5, 0.0)]
    streams.close()


def test_a_backlog_is_served_newest_first_and_what_is_passed_over_counted(tmp_path):
    cfg = service_config(tmp_path)
    streams = open_streams(cfg)
    service = StepService(cfg, streams, index=0, actors=2)
    now = time.time()
    # BATCH + 3 requests, read newest first (the order of two partitions may be any).
    requests = [StepRequest(f"g0/0/{i}", i % 2, i, [1], [5, 9], now - 1 + i / 1000) for i in range(BATCH + 3)]
    service.serve(requests[::-1])
    assert sorted(service.scorer.seen) == list(range(3, BATCH + 3))  # pyright: ignore[reportAttributeAccessIssue]
    assert service.values()["step_guidance/stale_requests_total"] == 3
    assert service.values()["step_guidance/steps_scored_total"] == BATCH
    streams.close()


class Engine:
    """What the guide asks of the actor's engine, recording the cuts: sequences given as parts."""

    def __init__(self, tokenizer, parts):
        self.tokenizer = tokenizer
        self.parts = parts
        self.cuts: list[tuple[object, int, int, Completion | None]] = []
        self.cuts_missed = self.tokens_cut = self.branches = 0

    async def snapshot(self, groups, hold=False):
        return [self.parts[id(g)] for g in groups]

    def cut(self, group, index, keep, refill=None):
        self.cuts.append((group, index, keep, refill))


class Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def run_of(group_id, handle, prompt_ids):
    generator = SimpleNamespace(handles=[handle], prompts=[(prompt_ids, 2)])
    return SimpleNamespace(group_id=group_id, generator=generator)


def test_the_guide_requests_each_step_once_cuts_at_the_scored_step_and_counts_late_verdicts(tmp_path):
    cfg = service_config(tmp_path)
    streams = open_streams(cfg)
    nl = ord("\n")
    handle = object()
    part = Completion([5, 6, nl, 7, nl, 8], [-0.1] * 6, [0] * 6, "", "")
    finished = Completion([5, nl, 9], [-0.1] * 3, [0] * 3, "stop", "")
    engine = Engine(Tokenizer(), {id(handle): [part, finished]})
    guide = StepGuide(cfg, engine, streams, actor=1, actors=2)
    run = run_of("actor1-x-0", handle, [1, 2])
    asyncio.run(guide.poll([run]))
    asyncio.run(guide.poll([run]))  # nothing new: no request twice
    guide.requests.flush()
    sent = [e.record for e in streams.reader(Topic.STEP_REQUESTS, StepRequest, partitions=(1,)).read(0.5)]
    assert [(r.key, r.step, r.completion_ids) for r in sent] == [
        ("actor1-x-0/0/0", 0, [5, 6, nl]),
        ("actor1-x-0/0/0", 1, [5, 6, nl, 7, nl]),
    ]  # the finished sequence is not scored: nothing is left to cut
    verdicts = streams.writer(Topic.STEP_VERDICTS, partitions=2)
    verdicts.write(StepVerdict("actor1-x-0/0/0", 0, 3, 0.9, time.time()), partition=1)
    verdicts.write(StepVerdict("actor1-x-0/0/0", 1, 5, 0.1, time.time()), partition=1)
    verdicts.write(StepVerdict("actor1-x-0/0/0", 2, 7, 0.0, time.time()), partition=1)  # already cut
    verdicts.write(StepVerdict("actor1-x-0/0/1", 0, 2, 0.0, time.time()), partition=1)  # already finished
    verdicts.write(StepVerdict("actor1-old-0/0/0", 0, 2, 0.0, time.time()), partition=1)  # no longer watched
    verdicts.flush()
    asyncio.run(guide.poll([run]))
    assert engine.cuts == [(handle, 0, 5, None)]
    values = guide.values()
    assert values["step_guidance/cuts_total"] == 1
    assert values["step_guidance/verdicts_total"] == 2
    assert values["step_guidance/late_verdicts_total"] == 3
    streams.close()


def test_a_branch_continues_the_calls_best_scored_prefix_while_the_calls_budget_lasts(tmp_path):
    nl = ord("\n")
    handle = SimpleNamespace(max_tokens=12)
    parts = [
        Completion([5, nl, 6, nl, 7, nl], [-0.5] * 6, [3] * 6, "", ""),
        Completion([8, nl, 9, 9, nl, 4], [-0.25] * 6, [4] * 6, "", ""),
        Completion([2, nl, 3, nl], [-0.1] * 4, [4] * 4, "", ""),
    ]
    # 12 tokens of branches per call: one branch from a 5-token prefix costs 7, a second no longer fits.
    cfg = service_config(tmp_path, **{"step_guidance.mode": "branch", "step_guidance.branch_tokens": 12})
    streams = open_streams(cfg)
    engine = Engine(Tokenizer(), {id(handle): parts})
    guide = StepGuide(cfg, engine, streams, actor=0, actors=2)
    run = run_of("actor0-x-0", handle, [1])
    asyncio.run(guide.poll([run]))
    verdicts = streams.writer(Topic.STEP_VERDICTS, partitions=2)
    for key, step, end, value in [
        ("actor0-x-0/0/0", 0, 2, 0.9),
        ("actor0-x-0/0/1", 0, 2, 0.9),
        ("actor0-x-0/0/1", 1, 5, 0.9),  # as good as the others' best, and longer: the prefix
        ("actor0-x-0/0/0", 1, 4, 0.2),  # cut, refilled
        ("actor0-x-0/0/2", 0, 2, 0.7),
        ("actor0-x-0/0/2", 1, 4, 0.1),  # cut; 5 tokens of budget left, a branch may need 7
    ]:
        verdicts.write(StepVerdict(key, step, end, value, time.time()), partition=0)
    verdicts.flush()
    asyncio.run(guide.poll([run]))
    (_, index, keep, refill), (_, index2, keep2, refill2) = engine.cuts
    assert (index, keep, index2, keep2, refill2) == (0, 4, 2, 4, None)
    assert refill is not None and refill.token_ids == [8, nl, 9, 9, nl] and refill.finish_reason == ""
    assert refill.logprobs == [-0.25] * 5 and refill.versions == [4] * 5
    # The branch, once it shows in a snapshot, is not asked about the steps of its prefix again.
    engine.parts[id(handle)] = parts + [Completion([8, nl, 9, 9, nl, 6, nl], [-0.25] * 7, [4] * 7, "", "", shared=5)]
    asyncio.run(guide.poll([run]))
    guide.requests.flush()
    sent = [e.record for e in streams.reader(Topic.STEP_REQUESTS, StepRequest, partitions=(0,)).read(0.5)]
    assert [(r.key, r.step) for r in sent if r.key.endswith("/3")] == [("actor0-x-0/0/3", 2)]
    streams.close()


def on_policy_gradient(rollouts, advantages) -> torch.Tensor:
    """d policy_loss / d logprob of a group's tokens, trained on policy (reinforce), the step's
    denominators its trained tokens and its samples."""
    mask = [m for r in rollouts for m in (r.mask or [1] * len(r.completion_ids))]
    n = len(mask)
    lp = torch.full((n,), -1.0, requires_grad=True)
    inputs = LossInputs(
        logprobs=lp,
        entropy=torch.zeros(n),
        old_logprobs=torch.full((n,), -1.0),
        advantages=torch.tensor([a for row in advantages for a in row]),
        loss_mask=torch.tensor(mask),
        seq_index=torch.tensor([i for i, r in enumerate(rollouts) for _ in r.completion_ids]),
        step_tokens=sum(mask),
        step_samples=len(rollouts),
    )
    loss, _ = policy_loss(inputs, LossConfig(kind="reinforce"))
    loss.backward()
    assert lp.grad is not None
    return lp.grad


def test_a_branched_pair_trains_its_shared_tokens_once_in_the_parent():
    # The parent failed; its branch shares its first 2 tokens and succeeded; a third attempt failed.
    parent = Completion([1, 2, 3, 4], [-1.0] * 4, [0] * 4, "stop", "")
    branch = Completion([1, 2, 7, 8], [-1.0] * 4, [0, 0, 1, 1], "stop", "", shared=2)
    other = Completion([5, 6, 3], [-1.0] * 3, [0] * 3, "stop", "")
    rollouts = [make_rollout([0], c, r) for c, r in ((parent, 0.0), (branch, 1.0), (other, 0.0))]
    assert rollouts[1].mask == [0, 0, 1, 1] and rollouts[1].versions == [-1, -1, 1, 1]
    advantages = group_advantages(RolloutGroup("p", "g", rollouts), AdvantageConfig())
    # Mean baseline 1/3 over the three; the shared tokens carry no advantage in the branch.
    assert [a for row in advantages for a in row] == pytest.approx(
        [-1 / 3] * 4 + [0.0, 0.0, 2 / 3, 2 / 3] + [-1 / 3] * 3
    )
    # d loss / d logprob = -A / 9 on the trained tokens (shared ones count once), 0 on the shared ones here.
    expected = [1 / 27] * 4 + [0.0, 0.0, -2 / 27, -2 / 27] + [1 / 27] * 3
    torch.testing.assert_close(on_policy_gradient(rollouts, advantages), torch.tensor(expected))


def test_a_cut_attempt_is_trained_as_a_failure_and_keeps_the_groups_baseline():
    # Three attempts at a 2-step problem; the third was cut after its wrong first line.
    _, solution, answer = chain(3, 5, 2)
    attempts = [
        Completion([1, 2, 3], [-1.0] * 3, [0] * 3, "stop", solution),
        Completion([1, 2, 4], [-1.0] * 3, [0] * 3, "stop", "a3+5=8\nb5+8=4"),
        Completion([1, 9], [-1.0] * 2, [0] * 2, "cut", "a3+5=9\n"),
    ]
    rollouts = [make_rollout([0], c, score(c.text, c.finish_reason, str(answer))) for c in attempts]
    assert [r.reward for r in rollouts] == [1.0, 0.0, 0.0]
    advantages = group_advantages(RolloutGroup("p", "g", rollouts), AdvantageConfig())
    # Mean baseline 1/3: the cut attempt's tokens are pushed down as the wrong finished one's are.
    assert [len(row) for row in advantages] == [3, 3, 2]
    assert [a for row in advantages for a in row] == pytest.approx([2 / 3] * 3 + [-1 / 3] * 3 + [-1 / 3] * 2)
    # d loss / d logprob = -A / (tokens of the step), on policy.
    expected = [-2 / 24] * 3 + [1 / 24] * 3 + [1 / 24] * 2
    torch.testing.assert_close(on_policy_gradient(rollouts, advantages), torch.tensor(expected))


def test_step_guidance_needs_a_step_scorer_a_branch_budget_and_no_routing_replay(tmp_path):
    with pytest.raises(ConfigError, match=r"step_guidance\.scorer\.cls"):
        load_config("tiny", [f"run_dir={tmp_path}", "step_guidance.mode=cut"])
    with pytest.raises(ConfigError, match="branch_tokens"):
        service_config(tmp_path, **{"step_guidance.mode": "branch"})
    with pytest.raises(ConfigError, match="routing_replay"):
        service_config(tmp_path, **{"shared.routing_replay": "true"})
    cfg = load_config("tiny_long_cut", [f"run_dir={tmp_path}"])
    assert cfg.step_guidance.mode == "cut" and cfg.step_guidance.scorer.cls.endswith(":StepChecker")
