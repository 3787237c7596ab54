"""Statistics of a held-out reward curve: [(seconds since the run's start, reward)], one point
per evaluation, in time order.

One evaluation of 200 problems has a standard error near 0.03, so every statistic here reads
the moving average of WINDOW consecutive evaluations, not single points: the time a curve
reaches a reward is the time of the last evaluation of the first window whose mean reaches
it, a run's final reward is the mean of its last window, and its worst drop is how far the
mean of a later window falls below the best window's. The early fall is the exception: a
collapse in a run's first updates lasts a few evaluations, which a window would average away,
so it reads single evaluations.
"""

from __future__ import annotations

WINDOW = 3
"""Evaluations per moving average (3 x 200 problems: a standard error near 0.02)."""

Curve = list[tuple[float, float]]


def moving_average(curve: Curve, window: int = WINDOW) -> Curve:
    """(time of the window's last evaluation, mean reward of the window) for each full window."""
    return [
        (curve[i + window - 1][0], sum(v for _, v in curve[i : i + window]) / window)
        for i in range(len(curve) - window + 1)
    ]


def time_to(curve: Curve, target: float, window: int = WINDOW) -> float | None:
    """When the moving average first reaches `target`; None if it never does."""
    return next((t for t, v in moving_average(curve, window) if v >= target), None)


def final(curve: Curve, window: int = WINDOW) -> float | None:
    """Mean reward of the last `window` evaluations (of all of them if fewer)."""
    tail = curve[-window:]
    return sum(v for _, v in tail) / len(tail) if tail else None


def worst_drop(curve: Curve, window: int = WINDOW) -> float:
    """How far the reward fell back after its best: the best window's mean minus the lowest mean
    of the windows that start after it (0 when none does or none is lower)."""
    ma = moving_average(curve, window)
    if not ma:
        return 0.0
    best = max(range(len(ma)), key=lambda i: ma[i][1])
    later = [v for _, v in ma[best + 1 :]]
    return max(0.0, ma[best][1] - min(later)) if later else 0.0


EARLY_S = 60.0
"""The span after a run's first evaluation that `early_fall` looks at."""


def early_fall(curve: Curve, within_s: float = EARLY_S) -> float:
    """How far the lowest single evaluation within `within_s` after the first fell below the first
    (the start): 0 when none did."""
    if not curve:
        return 0.0
    t0, start = curve[0]
    early = [v for t, v in curve[1:] if t - t0 <= within_s]
    return max(0.0, start - min(early)) if early else 0.0
