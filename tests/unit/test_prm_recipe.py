"""The classifier builds' recipes (pipeline_rl/demo/prm.py): a fixed recipe runs its steps
whatever the evaluations say and keeps its best evaluation; a target-based one stops at its
targets or gives up at its step limit."""

import pytest
import torch

from pipeline_rl.demo import prm

FIXED = prm.Recipe("fixed", target=0.65, class_target=0.6, lr=1e-3, eval_every=100, steps=300)
TARGETED = prm.Recipe("targeted", target=0.7, class_target=0.65, lr=1e-3, eval_every=50)


def report(accuracy, caught, kept):
    return {"accuracy": accuracy, "wrong_caught": caught, "right_kept": kept}


def test_a_fixed_recipe_runs_its_steps_whatever_the_evaluations_say():
    good = report(0.99, 0.99, 0.99)
    assert not prm.finished(299, good, FIXED, max_steps=10, what="x")  # neither targets nor max_steps stop it
    assert prm.finished(300, {}, FIXED, max_steps=10, what="x")
    assert [s for s in range(1, 301) if prm.evaluates_after(s, FIXED)] == [100, 200, 300]
    uneven = prm.Recipe("uneven", 0.65, 0.6, 1e-3, eval_every=100, steps=250)
    assert [s for s in range(1, 251) if prm.evaluates_after(s, uneven)] == [100, 200, 250]


def test_a_target_based_recipe_stops_at_its_targets_or_fails_at_max_steps():
    assert not prm.finished(10, {}, TARGETED, max_steps=100, what="x")
    assert not prm.finished(10, report(0.9, 0.64, 0.9), TARGETED, max_steps=100, what="x")
    assert prm.finished(10, report(0.7, 0.65, 0.65), TARGETED, max_steps=100, what="x")
    with pytest.raises(RuntimeError, match=r"the PRM reached .* in 100 steps, short of 0.7 / 0.65"):
        prm.finished(100, report(0.9, 0.5, 0.9), TARGETED, max_steps=100, what="the PRM")


def test_best_keeps_the_evaluation_with_the_larger_worse_class_rate_and_its_weights():
    model = torch.nn.Linear(2, 1)
    best = prm.Best()
    offers = [
        (100, report(0.80, 0.55, 0.95), 1.0),  # high accuracy, one class barely caught
        (200, report(0.72, 0.70, 0.74), 2.0),  # the best: both classes at 0.70 or more
        (300, report(0.75, 0.95, 0.50), 3.0),
        (400, report(0.71, 0.70, 0.72), 4.0),  # ties on the worse class, lower accuracy
    ]
    for step, r, value in offers:
        with torch.no_grad():
            model.weight.fill_(value)
        best.offer(step, r, model)
    kept = best.restore(model)
    assert kept == dict(offers[1][1], kept_step=200)
    assert torch.all(model.weight == 2.0)


def test_fit_warms_up_decays_over_the_last_third_and_ends_on_the_best_evaluation(monkeypatch):
    """A fixed recipe of 300 steps with `decay`: the lr rises linearly over WARMUP_STEPS, holds,
    and falls to 0 over the last 100 steps; the loop ends on the weights of its best evaluation,
    not its last, and stops a target-based recipe at its targets."""
    model = torch.nn.Linear(1, 1, bias=False)
    lrs: list[float] = []
    opt_seen: list[torch.optim.Optimizer] = []
    real_adamw = torch.optim.AdamW

    def recording_adamw(params, lr):
        opt = real_adamw(params, lr=lr)
        opt_seen.append(opt)
        return opt

    def loss():
        lrs.append(opt_seen[0].param_groups[0]["lr"])
        return (model.weight**2).sum()

    evals = iter([report(0.7, 0.6, 0.9), report(0.9, 0.8, 0.9), report(0.95, 0.5, 1.0)])
    weights_at: dict[int, float] = {}

    def evaluate():
        weights_at[len(lrs)] = model.weight.item()
        return next(evals)

    monkeypatch.setattr(torch.optim, "AdamW", recording_adamw)  # to read the lr each step
    kept, steps = prm.fit(model, list(model.parameters()), FIXED, loss, evaluate, "x", decay=True)
    assert steps == 300
    lr = FIXED.lr
    assert lrs[0] == pytest.approx(lr / prm.WARMUP_STEPS)
    assert lrs[prm.WARMUP_STEPS - 1] == pytest.approx(lr)
    assert lrs[200] == pytest.approx(lr)  # the decay starts at step 200: (300 - 200) / 100 = 1
    assert lrs[250] == pytest.approx(lr * 50 / 100)
    assert lrs[299] == pytest.approx(lr / 100)
    assert kept == dict(report(0.9, 0.8, 0.9), kept_step=200)
    assert model.weight.item() == weights_at[200]
    assert not model.training

    evals = iter([report(0.5, 0.5, 0.5), report(0.8, 0.7, 0.7), report(0.99, 0.99, 0.99)])
    kept, steps = prm.fit(
        model, list(model.parameters()), TARGETED, lambda: (model.weight**2).sum(), lambda: next(evals), "x"
    )
    assert (kept, steps) == (report(0.8, 0.7, 0.7), 100)
