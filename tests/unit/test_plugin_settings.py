"""Plug-ins' own settings (pipeline_rl/config/plugin_settings.py): a domain's, a loss's and an
agent environment's settings (the fixtures, written as a user would) are read into the type each
declares, refused naming the key as the core schema's keys are, and reach the plug-in."""

from __future__ import annotations

import pytest
import torch

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.rollouts.domains import load_domain
from pipeline_rl.trainer.loss import LossInputs, load_loss, policy_loss

TWO_TURNS = "actor.domain=fixtures.multiturn_domain:rollout"
AGENT = ["actor.domain=agent", "actor.domain_settings.environment=fixtures.agent_envs:asked_again"]


def domain_settings(*overrides: str):
    return load_domain(load_config("tiny", list(overrides)).actor).settings


def test_a_domains_settings_are_read_into_its_type():
    assert domain_settings(TWO_TURNS).turn_reward == 0.5
    assert domain_settings(TWO_TURNS, "actor.domain_settings.turn_reward=0.25").turn_reward == 0.25
    assert domain_settings() is None  # arithmetic declares none


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [TWO_TURNS, "actor.domain_settings.turn_rewards=1"],
            "unknown key 'actor.domain_settings.turn_rewards' (did you mean 'actor.domain_settings.turn_reward'?)",
        ),
        ([TWO_TURNS, "actor.domain_settings.turn_reward=0"], "'actor.domain_settings.turn_reward': 0.0, must be > 0"),
        ([TWO_TURNS, "actor.domain_settings.turn_reward=high"], "bad value for 'actor.domain_settings.turn_reward'"),
        (["actor.domain_settings.turn_reward=1"], "'actor.domain_settings.turn_reward': domain 'arithmetic' takes no"),
        (
            [*AGENT, "actor.domain_settings.environment_settings.timez=3"],
            "unknown key 'actor.domain_settings.environment_settings.timez' (did you mean "
            "'actor.domain_settings.environment_settings.times'?)",
        ),
        (
            [*AGENT, "actor.domain_settings.environment_settings.times=0"],
            "'actor.domain_settings.environment_settings.times': 0, must be >= 1",
        ),
        (
            [
                "actor.domain=agent",
                "actor.domain_settings.environment=fixtures.agent_envs:two_questions",
                "actor.domain_settings.environment_settings.times=3",
            ],
            "environment 'fixtures.agent_envs:two_questions' takes no settings",
        ),
        (["actor.domain=math", "actor.domain_settings.corect=1"], "did you mean 'actor.domain_settings.correct'?"),
        (["actor.domain=agent"], "'actor.domain' agent needs 'actor.domain_settings.environment'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as caught:
        domain_settings(*overrides)
    assert message in str(caught.value)


def test_a_key_of_a_section_that_became_a_domains_settings_says_where_it_went():
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.math_reward'.*moved to 'actor\.domain_settings'"):
        load_config("tiny", ["actor.domain=math", "actor.math_reward.wrong=-1"])


def hand_made_inputs() -> tuple[LossInputs, torch.Tensor]:
    logprobs = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    return (
        LossInputs(
            logprobs=logprobs,
            entropy=torch.zeros(3),
            old_logprobs=torch.tensor([-1.0, -0.5, -2.0]),
            advantages=torch.tensor([1.0, -1.0, 0.5]),
            loss_mask=torch.tensor([1, 1, 1]),
            seq_index=torch.tensor([0, 0, 0]),
            step_tokens=3.0,
            step_samples=1.0,
        ),
        logprobs,
    )


def test_a_losss_settings_reach_it():
    cfg = load_config("tiny", ["trainer.loss.function=fixtures.scaled_loss:loss", "trainer.loss.settings.factor=3"])
    inputs, logprobs = hand_made_inputs()
    scaled, _ = load_loss(cfg.trainer.loss)(inputs, cfg.trainer.loss)
    scaled.backward()
    scaled_grad = logprobs.grad.clone()
    inputs, logprobs = hand_made_inputs()
    plain, _ = policy_loss(inputs, cfg.trainer.loss)
    plain.backward()
    # On-policy ppo: loss = -sum(A) / 3 = 0.5 / 3 -> times 3; d/dlogprob = -A / 3 -> times 3.
    assert plain.item() == pytest.approx(-0.5 / 3) and scaled.item() == pytest.approx(-0.5)
    torch.testing.assert_close(scaled_grad, 3 * logprobs.grad)


def test_a_losss_unknown_setting_is_refused_naming_the_key():
    cfg = load_config("tiny", ["trainer.loss.function=fixtures.scaled_loss:loss", "trainer.loss.settings.factr=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.loss\.settings\.factr' \(did you mean"):
        load_loss(cfg.trainer.loss)
    with pytest.raises(ConfigError, match=r"'trainer\.loss\.settings\.factor': loss .* takes no settings"):
        load_loss(load_config("tiny", ["trainer.loss.settings.factor=3"]).trainer.loss)
