import pytest

from pipeline_rl import learning_curve as lc


def curve(*values: float) -> lc.Curve:
    return [(20.0 * (i + 1), v) for i, v in enumerate(values)]


def test_moving_average_is_timed_at_the_windows_last_evaluation():
    times, means = zip(*lc.moving_average(curve(0.1, 0.2, 0.6, 0.4)))
    assert times == (60.0, 80.0)
    assert means == pytest.approx((0.3, 0.4))
    assert lc.moving_average(curve(0.1, 0.2)) == []


def test_time_to_needs_a_whole_window_not_one_lucky_evaluation():
    c = curve(0.1, 0.9, 0.1, 0.5, 0.6, 0.7)
    # Windows: 0.367, 0.5, 0.4, 0.6. The single 0.9 at 40 s does not count: the first window
    # averaging >= 0.55 ends at 120 s.
    assert lc.time_to(c, 0.55) == 120.0
    assert lc.time_to(c, 0.5) == 80.0
    assert lc.time_to(c, 0.61) is None


def test_final_is_the_mean_of_the_last_window():
    assert lc.final(curve(0.0, 0.3, 0.6, 0.9)) == pytest.approx(0.6)
    assert lc.final(curve(0.4)) == pytest.approx(0.4)
    assert lc.final([]) is None


def test_worst_drop_is_measured_from_the_best_window_to_the_lowest_later_one():
    # Windows: 0.5, 0.7 (best), 0.6, 0.4, 0.5: the drop is 0.7 - 0.4.
    c = curve(0.3, 0.6, 0.6, 0.9, 0.3, 0.0, 1.2)
    assert lc.worst_drop(c) == pytest.approx(0.3)


def test_a_curve_that_never_falls_back_has_no_drop():
    assert lc.worst_drop(curve(0.1, 0.2, 0.3, 0.4, 0.5)) == 0.0
    assert lc.worst_drop(curve(0.1, 0.2)) == 0.0
    # A fall before the best window is not a drop after it.
    assert lc.worst_drop(curve(0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.9, 0.9, 0.9)) == 0.0


def test_early_fall_reads_single_evaluations_in_the_first_minute_after_the_start():
    # Evaluations every 20 s from 20 s: the start 0.23, a collapse to 0.055 at 40 s, back by 60 s.
    c = curve(0.23, 0.055, 0.26, 0.30, 0.01)
    assert lc.early_fall(c) == pytest.approx(0.23 - 0.055)  # the 0.01 at 100 s is 80 s after the start
    assert lc.early_fall(c, within_s=90.0) == pytest.approx(0.23 - 0.01)
    assert lc.early_fall(curve(0.2, 0.3, 0.4)) == 0.0
    assert lc.early_fall(curve(0.2)) == 0.0 and lc.early_fall([]) == 0.0
