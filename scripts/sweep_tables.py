"""The tables of docs/learning.md that compare settings one sweep at a time (pipelining against
sync, the lr schedule, the defaults, routing replay, the off-policy corrections), each made from
its kept JSON by scripts/bench_tables.py. Each row keeps what scripts/bench_learning.py printed for
one run, and the machine and commit it was measured on (or the commit that recorded it)."""

from __future__ import annotations

from table_cells import cell, markdown, measured_on, seconds


def pct(x: float | None, spec: str = ".2f") -> str:
    """A share as a percentage, or "n/a"."""
    return "n/a" if x is None else f"{100 * x:{spec}} %"


def reached(t: float | None) -> str:
    """A time to a reward, or "not reached"."""
    return seconds(t) if t else "not reached"


def sooner_ratio(slow: float | None, fast: float | None) -> str:
    """Two times to one reward side by side, and how much sooner the second is."""
    if not slow or not fast:
        return f"{seconds(slow)} / {seconds(fast)}"
    return f"{seconds(slow)} / {seconds(fast)} ({slow / fast:.2f}x)"


def pipelining_actors_table(rows: list[dict]) -> str:
    """`--variant` runs pipelined and sync with one and two actors: the sync run's time a version
    (waiting for samples + training), the two caps it sets on the pipelined run's versions/s
    (overlap: (wait + train) / max(wait, train); CPU: a version's CPU seconds over the 2 cores),
    the measured ratio, and both runs' times to 0.7."""

    def row(r: dict) -> list[str]:
        return [
            f"`{r['model']}`, {r['actors']}",
            f"{r['sync_wait_s']:.3f} + {r['sync_train_s']:.3f}",
            f"{r['overlap_cap']:.2f}x",
            f"{r['cpu_s_per_version']:.3f}",
            f"{r['cpu_cap']:.2f}x",
            f"{r['versions_ratio']:.2f}x",
            f"{seconds(r['sync_time_to_0.7_s'])} / {seconds(r['async_time_to_0.7_s'])}",
            measured_on(r),
        ]

    header = ["model, actors", "sync s/version: generation + training", "overlap cap", "CPU s/version (2 cores)"]
    header += ["CPU cap", "measured versions/s ratio", "time to 0.7, sync / pipelined", "measured on"]
    return markdown(header, [row(r) for r in rows])


def family_sync_table(rows: list[dict]) -> str:
    """Family members pipelined and sync: times to 0.7 and 0.9 side by side, the finals, and the
    versions/s ratio beside the overlap cap the sync run sets."""

    def row(r: dict) -> list[str]:
        return [
            f"`{r['model']}`",
            sooner_ratio(r["sync_time_to_0.7_s"], r["async_time_to_0.7_s"]),
            sooner_ratio(r["sync_time_to_0.9_s"], r["async_time_to_0.9_s"]),
            f"{r['sync_final']:.3f} / {r['async_final']:.3f}",
            f"{r['versions_ratio']:.2f}x ({r['overlap_cap']:.2f}x)",
            measured_on(r),
        ]

    header = ["model", "time to 0.7, sync / pipelined", "time to 0.9, sync / pipelined", "final, sync / pipelined"]
    header += ["versions/s ratio (overlap cap)", "measured on"]
    return markdown(header, [row(r) for r in rows])


def decay_table(rows: list[dict]) -> str:
    """lr schedules on one model: times to 0.7 and 0.9, the final, the worst drop and the KL
    between behaviour and trained policy over the run's last third."""

    def row(r: dict) -> list[str]:
        return [
            r["mode"],
            reached(r["time_to_0.7_s"]),
            reached(r["time_to_0.9_s"]),
            f"{r['final']:.3f}",
            f"{r['worst_drop']:.3f}",
            cell(r["behaviour_kl_last_third"], ".4f", ""),
            measured_on(r),
        ]

    header = ["variant", "time to 0.7", "time to 0.9", "final", "worst drop", "KL to behaviour, last third"]
    return markdown(header + ["measured on"], [row(r) for r in rows])


def lr_sweep_table(rows: list[dict]) -> str:
    """A sweep of the defaults on several models: one line per variant, one column per model, each
    cell the final (mean of the last 3 evaluations) and the time to 0.7 (and to 0.9 where reached)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    variants = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["mode"], r["model"]): r for r in rows}

    def result(r: dict | None) -> str:
        if r is None:
            return "not run"
        nine = f" (0.9 at {seconds(r['time_to_0.9_s'])})" if r["time_to_0.9_s"] else ""
        return f"{r['final']:.3f}, {reached(r['time_to_0.7_s'])}{nine}"

    lines = [[v, *(result(by.get((v, m))) for m in models), measured_on(by[v, models[0]])] for v in variants]
    return markdown(["variant", *(f"`{m}`" for m in models), "measured on"], lines)


def moe_table(rows: list[dict]) -> str:
    """The MoE policy with and without routing replay: learning, pace, the trained version's KL
    to the engine at lag 0 (all tokens; the tokens of rollouts no swap cut) and the share of
    routes the replay moved."""

    def row(r: dict) -> list[str]:
        unswapped = cell(r["lag0_kl_unswapped"], ".1e", "(not measured)")
        return [
            r["mode"],
            f"{r['start']:.3f}",
            f"{seconds(r['time_to_0.7_s'])} / {seconds(r['time_to_0.9_s'])}",
            f"{r['final']:.3f}",
            f"{r['worst_drop']:.3f}",
            f"{r['versions_per_s']:.2f}",
            f"{r['lag0_kl']:.1e} / {unswapped}",
            "" if r["routes_moved"] is None else pct(r["routes_moved"]),
            measured_on(r),
        ]

    header = ["run", "start", "time to 0.7 / 0.9", "final", "worst drop", "versions/s"]
    header += ["lag-0 KL, all / unswapped", "routes moved by the replay", "measured on"]
    return markdown(header, [row(r) for r in rows])


def moe_sync_table(rows: list[dict]) -> str:
    """The MoE policy in sync mode, every trained token lag 0 and unswapped: KL(engine || trainer)
    per token (the mean, and the median and 90th percentile of the steps' means), the mean
    absolute logprob difference and the routes the replay moved."""

    def row(r: dict) -> list[str]:
        return [
            r["mode"],
            str(r["steps"]),
            f"{r['kl_mean']:.1e}",
            f"{r['kl_step_median']:.1e}",
            f"{r['kl_step_p90']:.1e}",
            f"{r['logprob_abs_diff']:.5f}",
            "" if r["routes_moved"] is None else pct(r["routes_moved"], ".3f"),
            measured_on(r),
        ]

    header = ["run", "steps", "KL(engine \\|\\| trainer), token mean", "median step", "90th percentile step"]
    header += ["mean abs logprob diff", "routes moved", "measured on"]
    return markdown(header, [row(r) for r in rows])


def lag_table(rows: list[dict]) -> str:
    """Off-policy corrections at a `max_lag`: learning, pace, the share of trained samples at each
    lag (those past `max_lag`, dropped by the gate, marked), and over the run's last third the KL
    to behaviour and the share of tokens clipped (or masked)."""

    def lags(r: dict) -> str:
        shares = [f"{100 * s:.2g}" if s else "0" for s in r["lag_shares"]]
        marked = [s + (" (dropped)" if lag > r["max_lag"] and s != "0" else "") for lag, s in enumerate(shares)]
        return " / ".join(marked) + " %"

    def clipped(r: dict) -> str:
        masked = r["masked_range"]
        extra = "" if masked is None else f" (masked {100 * masked[0]:.1f}-{100 * masked[1]:.1f} %)"
        return pct(r["clipped_last_third"], ".3f") + extra

    def row(r: dict) -> list[str]:
        return [
            r["mode"],
            f"{r['final']:.3f}",
            f"{r['worst_drop']:.3f}",
            f"{r['versions_per_s']:.2f}",
            lags(r),
            f"{r['mean_lag']:.2f}",
            f"{r['behaviour_kl_last_third']:.1e}",
            clipped(r),
            measured_on(r),
        ]

    header = ["run", "final", "worst drop", "versions/s", "lag of the samples: 0 / 1 / 2 / 3 / 4", "mean lag"]
    header += ["behaviour KL, last third", "clipped (or masked) tokens, last third", "measured on"]
    return markdown(header, [row(r) for r in rows])
