"""Scorers: a PRM-style example whose step rewards reach the advantages, failure isolation,
and the reference scorer against a plain transformers forward pass."""

import pytest
import torch
from fixtures.helpers import random_qwen2
from transformers import AutoModelForCausalLM

from pipeline_rl.config import ConfigError, LogprobKernel, RunConfig, ScorerConfig
from pipeline_rl.preprocess.advantages import group_advantages
from pipeline_rl.preprocess.preprocessor import Counters, LostGroups, ScoringStage
from pipeline_rl.scorers import ReferenceLogprobScorer, Scorer, load_scorers
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import DeadLetter, GroupsLost, Rollout, RolloutGroup, decode
from pipeline_rl.wire import Topic


class StepRewardScorer(Scorer):
    """Example process reward model: a completion is a list of steps, each ending in token
    `sep`; a step that contains token `bad` scores -1, any other +1, on the step's last token."""

    def __init__(self, cfg, sep: int, bad: int):
        super().__init__(cfg)
        self.sep, self.bad = sep, bad

    def score(self, groups):
        for group in groups:
            for r in group.rollouts:
                rewards, step_bad = [0.0] * len(r.completion_ids), False
                for t, tok in enumerate(r.completion_ids):
                    step_bad = step_bad or tok == self.bad
                    if tok == self.sep or t == len(r.completion_ids) - 1:
                        rewards[t] = -1.0 if step_bad else 1.0
                        step_bad = False
                r.token_rewards = rewards


class FailOnProblemScorer(Scorer):
    """Raises on any batch that holds the problem `bad`."""

    def __init__(self, cfg, bad: str = "boom"):
        super().__init__(cfg)
        self.bad = bad

    def score(self, groups):
        if any(g.problem_id == self.bad for g in groups):
            raise RuntimeError(f"cannot score problem {self.bad}")
        for g in groups:
            g.metadata["scored"] = True


def rollout(prompt, completion, reward=1.0):
    n = len(completion)
    return Rollout(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-1.0] * n,
        versions=[0] * n,
        reward=reward,
        finish_reason="stop",
    )


def test_prm_step_rewards_reach_advantages():
    cfg = RunConfig()
    cfg.preprocess.scorers = [ScorerConfig(cls=f"{__name__}:StepRewardScorer", kwargs={"sep": 10, "bad": 13})]
    (scorer,) = load_scorers(cfg)
    # Same outcome reward; rollout 0 has two good steps, rollout 1 a good then a bad step.
    group = RolloutGroup(
        problem_id="p",
        group_id="g",
        rollouts=[
            rollout([1, 2], [5, 10, 6, 7]),
            rollout([1, 2], [5, 10, 13, 7]),
        ],
    )
    scorer.score([group])
    assert group.rollouts[0].token_rewards == [0.0, 1.0, 0.0, 1.0]
    assert group.rollouts[1].token_rewards == [0.0, 1.0, 0.0, -1.0]
    adv = group_advantages(group, cfg.preprocess.advantage)
    # Outcome advantages are 0; the reward-to-go of the step rewards remains.
    assert adv[0] == [2.0, 2.0, 1.0, 1.0]
    assert adv[1] == [0.0, 0.0, -1.0, -1.0]


def test_load_scorers_names_the_bad_key():
    cfg = RunConfig()
    cfg.preprocess.scorers = [ScorerConfig(cls="no_such_module_xyz:Thing")]
    with pytest.raises(ConfigError, match=r"preprocess\.scorers\.0\.cls"):
        load_scorers(cfg)
    cfg.preprocess.scorers = [ScorerConfig(cls="pipeline_rl.streams.records:Rollout")]
    with pytest.raises(ConfigError, match="not a subclass"):
        load_scorers(cfg)


def test_raising_scorer_dead_letters_only_its_batch(tmp_path):
    cfg = RunConfig()
    cfg.run_dir = str(tmp_path)
    streams = open_streams(cfg)
    writer = streams.writer(Topic.ACTOR)
    for pid in ["a", "boom", "b", "c"]:
        writer.write(RolloutGroup(problem_id=pid, group_id=f"g-{pid}", rollouts=[rollout([1], [2, 3])]))
    writer.flush()
    reader = streams.reader(Topic.ACTOR, RolloutGroup)
    counters = Counters()
    stage = ScoringStage([FailOnProblemScorer(cfg)], streams, counters, LostGroups(streams, 1, counters))
    out = [stage(reader.read(timeout=2, max_count=n)) for n in (1, 2, 1)]
    assert [[g.problem_id for g in batch] for batch in out] == [["a"], [], ["c"]]
    assert all(g.metadata["scored"] for batch in out for g in batch)
    assert counters.totals["scorer_failures"] == 1 and counters.totals["scorer_failed_groups"] == 2
    dead = streams.reader(Topic.SCORER_DEAD, DeadLetter).read(timeout=2)
    assert len(dead) == 2
    for entry, pid in zip(dead, ["boom", "b"]):
        letter = entry.record
        assert letter.topic == Topic.ACTOR and "cannot score problem boom" in letter.error
        assert "FailOnProblemScorer" in letter.error
        assert decode(letter.payload, RolloutGroup).problem_id == pid
    # The actor that wrote them is told, so its admission budget does not wait for them.
    lost = streams.reader(Topic.LOST, GroupsLost).read(timeout=2)
    assert [(e.partition, e.record.cause, e.record.ids) for e in lost] == [(0, "scorer", ["g-boom", "g-b"])]
    assert "cannot score problem boom" in lost[0].record.error and counters.totals["groups_lost_scorer"] == 2
    streams.close()


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    """A random tiny Qwen2: the reference scorer's contract holds for any causal LM."""
    path = tmp_path_factory.mktemp("ref_model")
    random_qwen2().save_pretrained(path)
    return path


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_reference_scorer_matches_each_sequence_alone(random_model_dir, kernel):
    """Both logprob kernels (model.logprob_kernel) give each sequence's logprobs alone."""
    cfg = RunConfig()
    cfg.model.logprob_kernel = LogprobKernel(kernel)
    cfg.model.path = str(random_model_dir)
    cfg.shared.temperature = 0.7
    cfg.preprocess.seq_length = 16  # several rows, and one sequence longer than a row
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, 97, (n,), generator=g).tolist()

    groups = [
        RolloutGroup(problem_id="p0", group_id="g0", rollouts=[rollout(ids(4), ids(5)), rollout(ids(4), ids(2))]),
        RolloutGroup(problem_id="p1", group_id="g1", rollouts=[rollout(ids(7), ids(14)), rollout(ids(3), ids(6))]),
    ]
    scorer = ReferenceLogprobScorer(cfg)
    assert scorer.logprobs.compiled == (kernel == "compiled")
    scorer.score(groups)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir).eval()
    for group in groups:
        for r in group.rollouts:
            x = torch.tensor([r.prompt_ids + r.completion_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float() / 0.7, -1)
            expected = logp.gather(-1, x[0, 1:, None])[:, 0][len(r.prompt_ids) - 1 :]
            assert len(r.ref_logprobs) == len(r.completion_ids)
            torch.testing.assert_close(torch.tensor(r.ref_logprobs), expected, atol=1e-5, rtol=1e-5)
    scorer.close()
