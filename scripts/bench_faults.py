"""What a lost actor and a lost trainer cost a self-healing run: `launch.py conf=tiny` twice on
the same seed and time budget, once without faults and once with actor0 killed (SIGKILL) at
one point of the budget and trainer0 at a later one; held-out reward and policy version against
time, side by side.

    python scripts/bench_faults.py [--budget-s 300] [--actor-at 0.33] [--trainer-at 0.66]
        [--out runs/bench_faults] [override ...]

The faults are timed from the run's first trainer step. A fault's cost is the time its run
lost: from the fault to the next one (or the run's end) the faulted run went from version a to
version b; the clean run took t_clean(b) - t_clean(a) for that, and the rest of the interval is
the cost (all of it when the run made no progress: a stall). Prints those costs, each restart's
recovery time (RUN_DIR/restarts.jsonl) and both runs' final reward; writes OUT/faults.json and
OUT/reward_through_faults.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline_rl import learning_curve
from pipeline_rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.5


def pid_of(run_dir: Path, module: str) -> int | None:
    """The pid of the run's `python -m pipeline_rl.<module>` process, if it is running."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"-m pipeline_rl.{module} " in args and str(run_dir) in args:
            return int(cmdline.parent.name)
    return None


def steps(run_dir: Path) -> list[dict]:
    return [
        r
        for r in read_metrics(run_dir)
        if r["process"] == "trainer0" and "version" in r["values"] and "waiting_on" not in r["values"]
    ]


def launch(run_dir: Path, budget_s: float, overrides: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "launch.py", "conf=tiny", f"run_dir={run_dir}", f"max_time_s={budget_s}", "--fresh"]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen([*argv, *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def run(run_dir: Path, budget_s: float, overrides: list[str], faults: list[tuple[float, str]]) -> list[dict]:
    """One run; `faults`: (seconds after the first step, pool module to kill). Returns the
    faults as done: the time (since the first step) and the trainer version at each."""
    shutil.rmtree(run_dir, ignore_errors=True)  # no step of an earlier run may start the clock
    proc = launch(run_dir, budget_s, overrides)
    done: list[dict] = []
    first: float | None = None
    pending = list(faults)
    while proc.poll() is None:
        time.sleep(POLL_S)
        if first is None:
            found = steps(run_dir)
            first = found[0]["time"] if found else None
            continue
        if pending and time.time() - first >= pending[0][0]:
            at, module = pending.pop(0)
            pid = pid_of(run_dir, module)
            if pid is None:
                raise RuntimeError(f"no {module} process to kill at {at:.0f} s")
            version = steps(run_dir)[-1]["values"]["version"]
            os.kill(pid, signal.SIGKILL)
            done.append({"process": module, "at_s": round(time.time() - first, 1), "version": version})
            print(f"  killed {module} at {done[-1]['at_s']:.0f} s (version {version})", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir} ended with exit code {proc.returncode}: see {run_dir.parent / run_dir.name}.log")
    return done


def curve(run_dir: Path) -> tuple[list[tuple[float, int]], float]:
    """(seconds since the first step, version) of every trainer step; the first step's time."""
    found = steps(run_dir)
    t0 = found[0]["time"]
    return [(r["time"] - t0, r["values"]["version"]) for r in found], t0


def first_reached(points: list[tuple[float, int]], version: int) -> float:
    return next(t for t, v in points if v >= version)


def lost_s(faulted: list[tuple[float, int]], clean: list[tuple[float, int]], start: dict, end_s: float) -> float:
    """The seconds the faulted run lost between a fault (`start`: its time and version) and
    end_s, against the clean run's pace over the same versions."""
    reached = max([v for t, v in faulted if start["at_s"] <= t <= end_s], default=start["version"])
    reached = min(max(reached, start["version"]), clean[-1][1])
    clean_s = first_reached(clean, reached) - first_reached(clean, start["version"])
    return end_s - start["at_s"] - clean_s


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--actor-at", type=float, default=0.33, help="share of the budget")
    parser.add_argument("--trainer-at", type=float, default=0.66, help="share of the budget")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_faults")
    args, overrides = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    clean_dir, faults_dir = (args.out / "clean").resolve(), (args.out / "faults").resolve()

    print(f"clean run ({args.budget_s:.0f} s) ...", flush=True)
    run(clean_dir, args.budget_s, overrides, [])
    print(f"faulted run ({args.budget_s:.0f} s) ...", flush=True)
    schedule = [(args.actor_at * args.budget_s, "actor"), (args.trainer_at * args.budget_s, "trainer")]
    done = run(faults_dir, args.budget_s, overrides, schedule)

    clean, clean_t0 = curve(clean_dir)
    faulted, faulted_t0 = curve(faults_dir)
    run_end = max(r["time"] for r in read_metrics(faults_dir)) - faulted_t0
    ends = [f["at_s"] for f in done[1:]] + [run_end]
    costs = [{**f, "cost_s": round(lost_s(faulted, clean, f, end), 1)} for f, end in zip(done, ends)]
    lines = (faults_dir / "restarts.jsonl").read_bytes().splitlines()
    restarts = list({(r["what"], r["at"]): r for r in map(json.loads, lines)}.values())
    curves = {}
    for name, run_dir, t0 in (("clean", clean_dir, clean_t0), ("faults", faults_dir, faulted_t0)):
        records = read_metrics(run_dir)
        curves[name] = [(r["time"] - t0, r["values"]["eval/reward"]) for r in records if "eval/reward" in r["values"]]
    result = {
        "budget_s": args.budget_s,
        "faults": costs,
        "restarts": [{k: r[k] for k in ("what", "died", "recovered_s")} for r in restarts],
        "final_reward": {name: learning_curve.final(curve) for name, curve in curves.items()},
        "final_version": {"clean": clean[-1][1], "faults": faulted[-1][1]},
    }
    (args.out / "faults.json").write_text(json.dumps(result, indent=2))
    for c in costs:
        print(f"{c['process']} killed at {c['at_s']:.0f} s (version {c['version']}): cost {c['cost_s']:.0f} s")
    for r in result["restarts"]:
        print(f"restart of {r['what']} ({r['died']} lost): back after {r['recovered_s']} s")
    print(f"final reward: clean {result['final_reward']['clean']}, with faults {result['final_reward']['faults']}")
    print(f"final version: clean {clean[-1][1]}, with faults {faulted[-1][1]}")
    plot(args.out / "reward_through_faults.png", curves, clean, faulted, costs)


def plot(path: Path, curves: dict, clean: list, faulted: list, costs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, curve in curves.items():
        smooth = learning_curve.moving_average(curve)
        top.plot([t for t, _ in smooth], [r for _, r in smooth], label=name)
    for name, points in (("clean", clean), ("faults", faulted)):
        bottom.plot([t for t, _ in points], [v for _, v in points], label=name)
    for c in costs:
        for ax in (top, bottom):
            ax.axvline(c["at_s"], color="grey", linestyle=":")
        top.annotate(f"{c['process']} killed\ncost {c['cost_s']:.0f} s", (c["at_s"], 0.05), fontsize=8)
    top.set_ylabel("held-out reward (moving average of 3 evaluations)")
    top.set_ylim(0, 1)
    bottom.set_ylabel("policy version")
    bottom.set_xlabel("seconds since the first trainer step")
    top.legend()
    top.set_title("conf=tiny with an actor and a trainer killed, beside the same run without faults")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
