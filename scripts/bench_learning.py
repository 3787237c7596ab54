"""Pipelined vs conventional RL on the tiny CPU demo, same seed, data and time budget.

    python scripts/bench_learning.py [--budget-s 900] [--out runs/bench_learning]
        [--variant NAME:KEY=VALUE,KEY=VALUE ...] [override ...]

Runs `launch.py conf=tiny` with actor.mode=async, then with actor.mode=sync, and prints for
each the wall time until the held-out mean reward first reaches 0.7 and 0.9, the speed-up,
the actor and trainer idle fractions, and peak RSS per process. With --variant, runs the
named variants instead, one after the other (e.g. `--variant sample:trainer.lag_gate=sample
--variant token:trainer.lag_gate=token`), and also prints dropped samples and masked tokens.
`model.path=.cache/tiny_learner` as an override runs on the second tiny model (built if missing).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from pipeline_rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (0.7, 0.9)


def time_to_reach(records: list[dict], t0: float, threshold: float) -> float | None:
    for r in records:
        value = r["values"].get("eval/reward")
        if isinstance(value, (int, float)) and value >= threshold:
            return r["time"] - t0
    return None


def last_values(records: list[dict]) -> dict[str, dict]:
    latest: dict[str, dict] = defaultdict(dict)
    for r in records:
        latest[r["process"]].update(r["values"])
    return latest


def actor_idle(latest: dict[str, dict]) -> float | None:
    """Share of each actor's uptime with no group in flight (blocked on admission, nothing to generate)."""
    fractions = [
        v["idle_total_s"] / v["uptime_s"]
        for p, v in latest.items()
        if p.startswith("actor") and v.get("uptime_s") and "idle_total_s" in v
    ]
    return sum(fractions) / len(fractions) if fractions else None


def trainer_idle(records: list[dict]) -> float | None:
    """Share of trainer rank 0's step time spent waiting for data."""
    steps = [r["values"] for r in records if r["process"] == "trainer0" and "wait_s" in r["values"]]
    total = sum(v["wait_s"] + v["compute_s"] for v in steps)
    return sum(v["wait_s"] for v in steps) / total if total else None


def versions_per_s(records: list[dict]) -> float | None:
    """Policy versions (optimizer steps) per second of trainer rank 0's run."""
    steps = [
        (r["time"], r["values"]["version"])
        for r in records
        if r["process"] == "trainer0" and "compute_s" in r["values"]
    ]
    return (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0]) if len(steps) > 1 else None


def run(mode: str, budget_s: float, out: Path, overrides: list[str]) -> dict:
    run_dir = out / mode
    argv = [
        sys.executable,
        "launch.py",
        "conf=tiny",
        f"run_dir={run_dir}",
        f"name=bench_{mode}",
        f"max_time_s={budget_s}",
        "--fresh",
        *overrides,
    ]
    print(f"[{mode}] {' '.join(argv[1:])}", flush=True)
    start = time.time()
    code = subprocess.run(argv, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"[{mode}] launch.py exited with {code}; see {run_dir / 'logs'}")
    return summarize(mode, run_dir, time.time() - start)


def summarize(mode: str, run_dir: Path, wall_s: float) -> dict:
    records = read_metrics(run_dir)
    t0 = min(r["time"] for r in records)
    latest = last_values(records)
    return {
        "mode": mode,
        "wall_s": wall_s,
        "reach": {t: time_to_reach(records, t0, t) for t in THRESHOLDS},
        "final_eval": max((r["values"]["eval/reward"], r["time"]) for r in records if "eval/reward" in r["values"])[0]
        if any("eval/reward" in r["values"] for r in records)
        else None,
        "eval_span_s": max((r["time"] - t0 for r in records if "eval/reward" in r["values"]), default=0.0),
        "versions_per_s": versions_per_s(records),
        "actor_idle": actor_idle(latest),
        "trainer_idle": trainer_idle(records),
        "peak_rss_mb": {p: v.get("peak_rss_mb") for p, v in latest.items() if v.get("peak_rss_mb")},
        "dropped_samples": latest.get("trainer0", {}).get("dropped_total"),
        "masked_tokens": sum(r["values"].get("masked_tokens", 0) for r in records if r["process"] == "trainer0"),
        "trained_tokens": sum(r["values"].get("trained_tokens", 0) for r in records if r["process"] == "trainer0"),
    }


def fmt(x, spec=".0f", unit="") -> str:
    return "not reached" if x is None else f"{x:{spec}}{unit}"


def report(results: list[dict]) -> None:
    print("\n=== bench_learning: held-out mean reward (T=1) on the tiny arithmetic demo ===")
    for r in results:
        reach = ", ".join(f"{t}: {fmt(r['reach'][t], '.0f', ' s')}" for t in THRESHOLDS)
        print(
            f"{r['mode']:>5}: time to reach {reach}; best eval {fmt(r['final_eval'], '.3f')}; "
            f"actor idle {fmt(r['actor_idle'], '.2f')}, trainer idle {fmt(r['trainer_idle'], '.2f')}; "
            f"{fmt(r['versions_per_s'], '.2f')} versions/s"
        )
        print(
            f"       dropped samples {fmt(r['dropped_samples'])}, masked tokens {r['masked_tokens']:.0f}, "
            f"trained tokens {r['trained_tokens']:.0f}"
        )
        print(f"       peak RSS MB: {', '.join(f'{p}={v:.0f}' for p, v in sorted(r['peak_rss_mb'].items()))}")
    if [r["mode"] for r in results] != ["async", "sync"]:
        return
    pipe, sync = results
    for t in THRESHOLDS:
        a, s = pipe["reach"][t], sync["reach"][t]
        if a and s:
            print(f"speed-up to {t}: {s / a:.2f}x (sync {s:.0f} s / pipelined {a:.0f} s)")
        elif a:
            # Sync ran the whole budget without reaching t: the ratio is at least budget / pipelined.
            print(
                f"speed-up to {t}: > {sync['eval_span_s'] / a:.2f}x (sync not reached in {sync['eval_span_s']:.0f} s "
                f"of evaluations / pipelined {a:.0f} s)"
            )
        else:
            print(f"speed-up to {t}: n/a (pipelined {fmt(a, '.0f', ' s')}, sync {fmt(s, '.0f', ' s')})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=900.0, help="wall-time budget of each run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_learning")
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME:KEY=VALUE,... a run to compare (repeatable)"
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args()
    variants = [v.partition(":") for v in args.variant]
    runs = [(name, [o for o in rest.split(",") if o]) for name, _, rest in variants]
    runs = runs or [(mode, [f"actor.mode={mode}"]) for mode in ("async", "sync")]
    report([run(name, args.budget_s, args.out, own + args.overrides) for name, own in runs])


if __name__ == "__main__":
    main()
