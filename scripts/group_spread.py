"""Whether a run's problems were equally hard for its policy: the groups its actors wrote, by how
many attempts were right, against a binomial at the same mean reward.

A group whose attempts all agree (all wrong or all right) carries no advantage. If every problem
were as hard as every other, the share of such groups would follow from the mean reward p and
the group size n alone: p^n + (1 - p)^n. Where problems differ in difficulty, right attempts
gather in the problems the policy can solve: the spread of right attempts between groups is
wider than the binomial's n p (1 - p) (dispersion above 1) and more groups agree than the
binomial says. Only then can more attempts on some problems (those whose last group had no
spread) add signal; at dispersion near 1 a problem's last group says nothing of its next.

    python scripts/group_spread.py RUN_DIR [RUN_DIR ...] [--labels A,B,...] [--window 2000]
        [--json PATH]

Reads RUN_DIR/streams/actor/*.jsonl (a run on JSONL streams), in each file's order, in windows
of --window groups; rewards must be 0 or 1 (the arithmetic task's). Prints one row per window
and keeps them with --json, naming this machine and commit: run it where the runs ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pipeline_rl.streams.records import RecordError, RolloutGroup, decode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def right_counts(run_dir: Path) -> tuple[list[int], int]:
    """Each written group's number of right attempts (the actor files in name order) and the
    group size. A reward other than 0 or 1, or groups of different sizes, is refused naming the
    file and line."""
    files = sorted((run_dir / "streams" / "actor").glob("*.jsonl"))
    if not files:
        raise ValueError(f"{run_dir}: no streams/actor/*.jsonl (a run on JSONL streams)")
    counts, size = [], None
    for path in files:
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                group = decode(line, RolloutGroup)
            except RecordError as e:
                raise ValueError(f"{path}:{number}: {e}") from e
            rewards = [r.reward for r in group.rollouts]
            if any(r not in (0.0, 1.0) for r in rewards):
                raise ValueError(f"{path}:{number}: rewards {rewards} are not all 0 or 1")
            if size is not None and len(rewards) != size:
                raise ValueError(f"{path}:{number}: a group of {len(rewards)} attempts after groups of {size}")
            size = len(rewards)
            counts.append(int(sum(rewards)))
    if size is None:
        raise ValueError(f"{run_dir}: its actors wrote no groups")
    return counts, size


def window_report(counts: list[int], attempts: int) -> dict:
    """The window's mean reward, the share of its groups without a spread and of those every
    attempt of which was right, each beside its share under a binomial at the same mean, and the
    dispersion (the variance of right attempts per group over the binomial's)."""
    if not counts:
        raise ValueError("an empty window")
    p = sum(counts) / (attempts * len(counts))
    binomial_var = attempts * p * (1 - p)
    return {
        "groups": len(counts),
        "attempts": attempts,
        "mean_reward": p,
        "no_spread": sum(k in (0, attempts) for k in counts) / len(counts),
        "no_spread_binomial": p**attempts + (1 - p) ** attempts,
        "all_right": counts.count(attempts) / len(counts),
        "all_right_binomial": p**attempts,
        "dispersion": statistics.pvariance(counts) / binomial_var if binomial_var else None,
    }


def report(counts: list[int], attempts: int, window: int) -> list[dict]:
    """window_report over consecutive windows of `window` groups (the last one may be shorter)."""
    rows = []
    for first in range(0, len(counts), window):
        row = window_report(counts[first : first + window], attempts)
        rows.append({"first_group": first, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--labels", help="comma-separated names of the runs in the rows (default: their paths)")
    parser.add_argument("--window", type=int, default=2000, help="groups per row")
    parser.add_argument("--json", type=Path, help="also keep the rows in this JSON (a run's rows replaced)")
    args = parser.parse_args()
    if args.window < 1:
        parser.error(f"--window: {args.window} is not a positive number of groups")
    labels = args.labels.split(",") if args.labels else [str(r) for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    rows = []
    print("| run | groups | attempts | mean reward | no spread (binomial's) | all right (binomial's) | dispersion |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run_dir, label in zip(args.runs, labels, strict=True):
        counts, attempts = right_counts(run_dir)
        for row in report(counts, attempts, args.window):
            name = f"{label} {row['first_group']}-{row['first_group'] + row['groups']}"
            rows.append({"name": name, "run": label, **row})
            dispersion = "" if row["dispersion"] is None else f"{row['dispersion']:.2f}"
            print(
                f"| {label} | {row['first_group']}-{row['first_group'] + row['groups']} | {attempts} | "
                f"{row['mean_reward']:.3f} | {row['no_spread']:.3f} ({row['no_spread_binomial']:.3f}) | "
                f"{row['all_right']:.3f} ({row['all_right_binomial']:.3f}) | {dispersion} |"
            )
    if args.json:
        from bench_tables import commit, keep, machine

        measured_on = {"machine": machine(), "commit": commit()}  # once: commit() runs git
        keep(args.json, [{**r, **measured_on} for r in rows])
        print(f"kept in {args.json}")


if __name__ == "__main__":
    main()
