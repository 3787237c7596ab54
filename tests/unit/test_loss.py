"""policy_loss on small hand-computed cases (values and gradients w.r.t. the logprobs)."""

import math

import pytest
import torch

from pipeline_rl.config import LossConfig
from pipeline_rl.trainer.loss import STAT_KEYS, LossInputs, policy_loss, summarize


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def run(cfg, lp, old, adv, mask, seq=None, step_tokens=None, step_samples=1, ref=None, ent=None):
    lp = t(lp).requires_grad_(True)
    ent_t = t(ent).requires_grad_(True) if ent is not None else torch.zeros(len(lp))
    seq_index = torch.tensor(seq if seq is not None else [0] * len(lp))
    inputs = LossInputs(
        logprobs=lp,
        entropy=ent_t,
        old_logprobs=t(old),
        advantages=t(adv),
        loss_mask=torch.tensor(mask),
        seq_index=seq_index,
        step_tokens=step_tokens if step_tokens is not None else sum(mask),
        step_samples=step_samples,
        ref_logprobs=None if ref is None else t(ref),
    )
    loss, stats = policy_loss(inputs, cfg)
    loss.backward()
    return loss.item(), lp.grad, stats, ent_t.grad if ent is not None else None


def test_on_policy_reinforce_is_advantage_weighted_mean_over_step_tokens():
    lp = [0.0, -1.0, -2.0, -0.5]
    loss, grad, stats, _ = run(
        LossConfig(kind="reinforce"), lp, old=lp, adv=[0.0, 1.0, 1.0, -2.0], mask=[0, 1, 1, 1], step_tokens=6
    )
    # -(1*(-1) + 1*(-2) - 2*(-0.5)) / 6
    assert loss == pytest.approx(2.0 / 6)
    torch.testing.assert_close(grad, t([0.0, -1 / 6, -1 / 6, 2 / 6]))
    assert set(stats) == set(STAT_KEYS) and stats["tokens"].item() == 3


def test_truncated_importance_weights():
    old = [0.0, -1.0 - math.log(10.0), -1.0 + math.log(2.0)]  # ratios 10 and 0.5
    loss, grad, stats, _ = run(
        LossConfig(kind="reinforce", is_truncation=5.0),
        [0.0, -1.0, -1.0],
        old,
        adv=[0.0, 1.0, 1.0],
        mask=[0, 1, 1],
        step_tokens=2,
    )
    torch.testing.assert_close(grad, t([0.0, -5.0 / 2, -0.5 / 2]))
    assert loss == pytest.approx(-(5.0 * -1.0 + 0.5 * -1.0) / 2)
    assert stats["clipped"].item() == 1
    assert stats["w"].item() == pytest.approx(10.5)


def test_ppo_clipping_zeroes_the_gradient_only_where_the_clipped_branch_wins():
    r = [1.5, 1.5, 0.5, 0.5]
    adv = [1.0, -1.0, 1.0, -1.0]
    lp = [-1.0] * 4
    old = [-1.0 - math.log(x) for x in r]
    loss, grad, stats, _ = run(LossConfig(kind="ppo", ppo_clip=0.2), lp, old, adv, mask=[1, 1, 1, 1], step_tokens=4)
    # per-token objective min(r A, clip(r) A): 1.2 (clipped), -1.5, 0.5, -0.8 (clipped)
    assert loss == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4)
    # d/dlp of -r*A = -r*A where unclipped, 0 where clipped
    torch.testing.assert_close(grad, t([0.0, 1.5 / 4, -0.5 / 4, 0.0]))
    assert stats["clipped"].item() == 2


def test_k3_kl_term():
    lp, ref = math.log(0.5), math.log(0.25)
    k3 = 0.25 / 0.5 - math.log(0.25 / 0.5) - 1
    loss, grad, stats, _ = run(
        LossConfig(kl_coef=0.1), [0.0, lp], [0.0, lp], adv=[0.0, 0.0], mask=[0, 1], ref=[0.0, ref], step_tokens=1
    )
    assert loss == pytest.approx(0.1 * k3)
    # d k3 / d lp = 1 - exp(ref - lp)
    torch.testing.assert_close(grad, t([0.0, 0.1 * (1 - 0.5)]))
    assert stats["kl"].item() == pytest.approx(k3)


def test_kl_without_reference_logprobs_is_an_error():
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(LossConfig(kl_coef=0.1), [0.0, -1.0], [0.0, -1.0], [0.0, 1.0], [0, 1])


def test_entropy_bonus():
    loss, _, stats, ent_grad = run(
        LossConfig(entropy_coef=0.01),
        [0.0, -1.0, -1.0],
        [0.0, -1.0, -1.0],
        adv=[0.0, 0.0, 0.0],
        mask=[0, 1, 1],
        ent=[9.0, 2.0, 3.0],
        step_tokens=2,
    )
    assert loss == pytest.approx(-0.01 * (2.0 + 3.0) / 2)
    torch.testing.assert_close(ent_grad, t([0.0, -0.005, -0.005]))
    assert stats["entropy"].item() == pytest.approx(5.0)


def test_sequence_normalisation_averages_within_then_across_sequences():
    # Sequence 0 has one trained token, sequence 1 three; 4 sequences in the whole step.
    lp = [0.0, -1.0, 0.0, -1.0, -1.0, -1.0]
    _, grad, _, _ = run(
        LossConfig(normalize="sequence"),
        lp,
        lp,
        adv=[0.0, 1.0, 0.0, 1.0, 1.0, 1.0],
        mask=[0, 1, 0, 1, 1, 1],
        seq=[0, 0, 1, 1, 1, 1],
        step_samples=4,
    )
    torch.testing.assert_close(grad, t([0.0, -1 / 4, 0.0, -1 / 12, -1 / 12, -1 / 12]))
    _, grad_tok, _, _ = run(
        LossConfig(normalize="token"),
        lp,
        lp,
        adv=[0.0, 1.0, 0.0, 1.0, 1.0, 1.0],
        mask=[0, 1, 0, 1, 1, 1],
        seq=[0, 0, 1, 1, 1, 1],
        step_tokens=4,
    )
    torch.testing.assert_close(grad_tok, t([0.0, -1 / 4, 0.0, -1 / 4, -1 / 4, -1 / 4]))


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_split_over_ranks_sums_to_the_whole(normalize):
    """Two halves of a step with the step-global denominators add up to the whole step."""
    cfg = LossConfig(kind="ppo", normalize=normalize, kl_coef=0.05)
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(8, generator=g) * 3).tolist()
    old = (torch.tensor(lp) + torch.randn(8, generator=g) * 0.3).tolist()
    adv = torch.randn(8, generator=g).tolist()
    ref = (-torch.rand(8, generator=g) * 3).tolist()
    mask = [0, 1, 1, 0, 1, 1, 1, 1]
    seq = [0, 0, 0, 1, 1, 2, 2, 2]
    whole, grad, _, _ = run(cfg, lp, old, adv, mask, seq, step_tokens=6, step_samples=3, ref=ref)
    a, grad_a, _, _ = run(cfg, lp[:3], old[:3], adv[:3], mask[:3], seq[:3], 6, 3, ref[:3])
    b, grad_b, _, _ = run(cfg, lp[3:], old[3:], adv[3:], mask[3:], [s - 1 for s in seq[3:]], 6, 3, ref[3:])
    assert a + b == pytest.approx(whole, rel=1e-6)
    torch.testing.assert_close(torch.cat([grad_a, grad_b]), grad)


def test_masked_tokens_with_extreme_logprobs_stay_finite():
    loss, grad, _, _ = run(
        LossConfig(kind="ppo", kl_coef=0.1),
        lp=[-200.0, -1.0],
        old=[0.0, -1.0],
        adv=[5.0, 1.0],
        mask=[0, 1],
        ref=[0.0, -1.0],
    )
    assert math.isfinite(loss) and torch.isfinite(grad).all() and grad[0] == 0


def test_summarize_effective_sample_size():
    sums = {k: 0.0 for k in STAT_KEYS}
    sums.update(tokens=2.0, w=4.0, w_sq=10.0, adv=2.0, adv_sq=10.0)  # weights 1 and 3, advantages -1 and 3
    out = summarize(sums)
    assert out["ess"] == pytest.approx(16 / 20)
    assert out["advantage_mean"] == pytest.approx(1.0)
    assert out["advantage_std"] == pytest.approx(2.0)


def test_clip_higher_widens_only_the_upper_bound():
    """DAPO clip-higher: with eps 0.2 and eps_high 0.28 a ratio of 1.25 on a positive advantage
    keeps its gradient (it is clipped with the symmetric range), the lower bound is unchanged."""
    r = [1.25, 1.35, 0.75]
    adv = [1.0, 1.0, -1.0]
    lp = [-1.0] * 3
    old = [-1.0 - math.log(x) for x in r]
    symmetric = run(LossConfig(kind="ppo", ppo_clip=0.2), lp, old, adv, mask=[1, 1, 1])
    higher = run(LossConfig(kind="ppo", ppo_clip=0.2, ppo_clip_high=0.28), lp, old, adv, mask=[1, 1, 1])
    torch.testing.assert_close(symmetric[1], t([0.0, 0.0, 0.0]))
    # d/dlp of -r*A / 3 where unclipped: token 0 now; token 1 still above 1.28, token 2 below 0.8.
    torch.testing.assert_close(higher[1], t([-1.25 / 3, 0.0, 0.0]))
    assert higher[0] == pytest.approx(-(1.25 + 1.28 - 0.8) / 3)
    assert symmetric[2]["clipped"].item() == 3 and higher[2]["clipped"].item() == 2


def test_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    """GSPO: sequence 0 has token ratios 2 and 1/2 (geometric mean 1), sequence 1 ratios 1.5 and
    1.5; the masked prompt token is left out. The per-token objective uses the sequence's ratio."""
    lp = [-3.0, -1.0, -1.0, -5.0, -1.0, -1.0]
    ratios = [1.0, 2.0, 0.5, 1.0, 1.5, 1.5]
    old = [x - math.log(r) for x, r in zip(lp, ratios)]
    old[0] = old[3] = 7.0  # prompt tokens: any behaviour logprob, masked out
    adv = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    mask = [0, 1, 1, 0, 1, 1]
    seq = [0, 0, 0, 1, 1, 1]
    cfg = LossConfig(kind="ppo", ppo_clip=0.2, ratio="sequence", normalize="sequence")
    loss, grad, stats, _ = run(cfg, lp, old, adv, mask, seq, step_samples=2)
    # Sequence 0: s = 1, unclipped; d(-s A)/d lp_t = -s A / |y| per token, then / 2 sequences.
    # Sequence 1: s = 1.5 > 1.2 with A > 0: clipped, no gradient.
    assert loss == pytest.approx(-(1.0 + 1.2) / 2)
    torch.testing.assert_close(grad, t([0.0, -0.25, -0.25, 0.0, 0.0, 0.0]))
    assert stats["w"].item() == pytest.approx(2 * 1.0 + 2 * 1.5)
    assert stats["clipped"].item() == 2
    token_level = run(
        LossConfig(kind="ppo", ppo_clip=0.2, normalize="sequence"), lp, old, adv, mask, seq, step_samples=2
    )
    # Token by token, 2, 1.5 and 1.5 are clipped (A > 0); 0.5 is not (the lower bound binds for A < 0).
    assert token_level[2]["clipped"].item() == 3


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    # Ratios 10 and 0.5, clipped to [1 - 0.2, 1 + 0.28]: weights 1.28 and 0.8, both detached.
    old = [0.0, -1.0 - math.log(10.0), -1.0 + math.log(2.0)]
    cfg = LossConfig(kind="cispo", ppo_clip=0.2, ppo_clip_high=0.28)
    loss, grad, stats, _ = run(cfg, [0.0, -1.0, -1.0], old, adv=[0.0, 1.0, 1.0], mask=[0, 1, 1], step_tokens=2)
    assert loss == pytest.approx(-(1.28 * -1.0 + 0.8 * -1.0) / 2)
    torch.testing.assert_close(grad, t([0.0, -1.28 / 2, -0.8 / 2]))
    assert stats["clipped"].item() == 2
    # PPO on the same tokens: the ratio-10 token with a positive advantage gets no gradient at all.
    _, ppo_grad, _, _ = run(
        LossConfig(kind="ppo", ppo_clip=0.2, ppo_clip_high=0.28),
        [0.0, -1.0, -1.0],
        old,
        adv=[0.0, 1.0, 1.0],
        mask=[0, 1, 1],
        step_tokens=2,
    )
    assert ppo_grad[1].item() == 0.0 and grad[1].item() != 0.0


def test_ratio_mask_leaves_tokens_outside_the_band_out_of_the_gradient():
    # Ratios 3, 1.5 and 1/3 with c = 2: the first and last are masked, the middle one trains
    # with its truncated weight 1.5; all three still count in the normalisation (step_tokens 3).
    lp = [-1.0, -1.0, -1.0]
    old = [-1.0 - math.log(3.0), -1.0 - math.log(1.5), -1.0 + math.log(3.0)]
    cfg = LossConfig(kind="reinforce", is_truncation=5.0, ratio_mask=2.0)
    loss, grad, stats, _ = run(cfg, lp, old, adv=[1.0, 1.0, 1.0], mask=[1, 1, 1], step_tokens=3)
    torch.testing.assert_close(grad, t([0.0, -1.5 / 3, 0.0]))
    assert loss == pytest.approx(-(1.5 * -1.0) / 3)
    assert stats["masked"].item() == 2
    sums = {k: v.item() for k, v in stats.items()}
    assert summarize(sums)["ratio_masked_fraction"] == pytest.approx(2 / 3)
    # Without the mask every token trains.
    _, unmasked, stats, _ = run(
        LossConfig(kind="reinforce", is_truncation=5.0), lp, old, [1.0] * 3, [1, 1, 1], step_tokens=3
    )
    torch.testing.assert_close(unmasked, t([-3.0 / 3, -1.5 / 3, -(1 / 3) / 3]))
    assert stats["masked"].item() == 0


def test_ratio_mask_ignores_tokens_outside_the_loss_mask():
    # A prompt token (mask 0) with a wild logprob difference is neither masked nor counted.
    cfg = LossConfig(kind="reinforce", ratio_mask=2.0)
    _, _, stats, _ = run(cfg, [0.0, -1.0], [-5.0, -1.0], adv=[1.0, 1.0], mask=[0, 1], step_tokens=1)
    assert stats["masked"].item() == 0
