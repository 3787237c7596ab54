"""What faults cost a self-healing run: `launch.py conf=CONF` twice on the same seed and time
budget, once without faults and once with the faults of --faults, each at its share of the
budget; held-out reward and policy version against time, side by side.

    python scripts/bench_faults.py [--conf tiny_long] [--budget-s 300]
        [--faults actor:0.15,interrupt:0.35,scale_down:0.5,trainer:0.65] [--out runs/bench_faults]
        [--json docs/bench_faults.json] [override ...]

Faults: `actor` and `trainer` kill actor0 or trainer0 (SIGKILL); `interrupt` stops the run with
Ctrl-C and launches it again at once (it resumes from its checkpoint and continues the rollouts
in flight); `scale_down` asks the run for one actor fewer (`--actors`; both runs then start with
world.actors=2). The faults are timed from the run's first trainer step. A fault's cost is the
time its run lost: from the fault to the next one (or the run's end) the faulted run went from
version a to version b; the clean run took t_clean(b) - t_clean(a) for that, and the rest of
the interval is the cost (all of it when the run made no progress: a stall). With each fault,
what became of the rollouts in flight (the actors' metrics): groups lost at a stop, groups and
tokens continued, groups handed over. Prints the costs, each restart's recovery time
(RUN_DIR/restarts.jsonl) and both runs' final reward; writes OUT/faults.json and
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

from bench_tables import commit, machine

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


def launch(run_dir: Path, conf: str, budget_s: float, overrides: list[str], fresh: bool = True) -> subprocess.Popen:
    argv = [sys.executable, "launch.py", f"conf={conf}", f"run_dir={run_dir}", f"max_time_s={budget_s}"]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    return subprocess.Popen(
        [*argv, *(["--fresh"] if fresh else []), *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )


IN_FLIGHT_KEYS = (
    "groups_lost/stopped_total",
    "groups_continued_total",
    "tokens_continued_total",
    "groups_handed_over_total",
)
"""The actors' counters of what became of their rollouts in flight (actor/in_flight.py)."""


def in_flight_growth(run_dir: Path, t0: float, t1: float) -> dict[str, float]:
    """How much each IN_FLIGHT_KEYS counter grew over the actors' reports between wall times t0
    and t1, summed over actors; a counter that fell started again with a new process."""
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in read_metrics(run_dir):
        if r["process"].startswith("actor"):
            for k in IN_FLIGHT_KEYS:
                if k in r["values"]:
                    series.setdefault((r["process"], k), []).append((r["time"], r["values"][k]))
    growth: dict[str, float] = dict.fromkeys(IN_FLIGHT_KEYS, 0.0)
    for (_, k), points in series.items():
        last = 0.0
        for t, v in sorted(points):
            if t0 <= t < t1:
                growth[k] += v - last if v >= last else v
            last = v
    return {k.removesuffix("_total"): v for k, v in growth.items()}


def fault(proc: subprocess.Popen, run_dir: Path, conf: str, what: str, left_s: float, overrides: list[str]):
    """Cause fault `what`; returns the launcher process from then on."""
    if what in ("actor", "trainer"):
        pid = pid_of(run_dir, what)
        if pid is None:
            raise RuntimeError(f"no {what} process to kill")
        os.kill(pid, signal.SIGKILL)
    elif what == "interrupt":
        proc.send_signal(signal.SIGINT)
        proc.wait()
        return launch(run_dir, conf, left_s, overrides, fresh=False)
    elif what == "scale_down":
        argv = [sys.executable, "launch.py", f"conf={conf}", f"run_dir={run_dir}", *overrides, "--actors", "1"]
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=180)
    else:
        raise ValueError(f"unknown fault {what!r} (actor, trainer, interrupt, scale_down)")
    return proc


def run(run_dir: Path, conf: str, budget_s: float, overrides: list[str], faults: list[tuple[float, str]]) -> list[dict]:
    """One run; `faults`: (seconds after the first step, fault). Returns the faults as done: the
    time (since the first step) and the trainer version at each."""
    shutil.rmtree(run_dir, ignore_errors=True)  # no step of an earlier run may start the clock
    (run_dir.parent / f"{run_dir.name}.log").unlink(missing_ok=True)
    proc = launch(run_dir, conf, budget_s, overrides)
    started = time.time()
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
            _, what = pending.pop(0)
            version = steps(run_dir)[-1]["values"]["version"]
            at_s = round(time.time() - first, 1)
            proc = fault(proc, run_dir, conf, what, budget_s - (time.time() - started), overrides)
            done.append({"fault": what, "at_s": at_s, "at": time.time(), "version": version})
            print(f"  {what} at {at_s:.0f} s (version {version})", flush=True)
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
    parser.add_argument("--conf", default="tiny_long")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument(
        "--faults",
        default="actor:0.15,interrupt:0.35,scale_down:0.5,trainer:0.65",
        help="FAULT:SHARE,... (shares of the budget, in order)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_faults")
    parser.add_argument("--skip-clean", action="store_true", help="keep OUT/clean from an earlier run")
    parser.add_argument("--json", type=Path, help="also keep the result here, with the machine and commit it ran on")
    args, overrides = parser.parse_known_args()
    provenance = {"conf": args.conf, "machine": machine(), "commit": commit()}  # before the runs: what they ran
    args.out.mkdir(parents=True, exist_ok=True)
    clean_dir, faults_dir = (args.out / "clean").resolve(), (args.out / "faults").resolve()
    schedule = [(float(share) * args.budget_s, what) for what, share in (f.split(":") for f in args.faults.split(","))]
    if any(what == "scale_down" for _, what in schedule):
        overrides = ["world.actors=2", *overrides]

    if not args.skip_clean:
        print(f"clean run ({args.budget_s:.0f} s) ...", flush=True)
        run(clean_dir, args.conf, args.budget_s, overrides, [])
    print(f"faulted run ({args.budget_s:.0f} s) ...", flush=True)
    done = run(faults_dir, args.conf, args.budget_s, overrides, schedule)

    clean, clean_t0 = curve(clean_dir)
    faulted, faulted_t0 = curve(faults_dir)
    run_end = max(r["time"] for r in read_metrics(faults_dir)) - faulted_t0
    ends = [f["at_s"] for f in done[1:]] + [run_end]
    costs = [{**f, "cost_s": round(lost_s(faulted, clean, f, end), 1)} for f, end in zip(done, ends)]
    # What each fault did to the rollouts in flight: the counters' growth up to the next fault.
    for c, end in zip(costs, [f["at"] for f in done[1:]] + [float("inf")]):
        c["in_flight"] = in_flight_growth(faults_dir, c.pop("at"), end)
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
    if args.json:
        args.json.write_text(json.dumps(result | provenance, indent=1) + "\n")
    for c in costs:
        kept = ", ".join(f"{k} {v:g}" for k, v in c["in_flight"].items())
        print(f"{c['fault']} at {c['at_s']:.0f} s (version {c['version']}): cost {c['cost_s']:.0f} s; {kept}")
    for r in result["restarts"]:
        print(f"restart of {r['what']} ({r['died']} lost): back after {r['recovered_s']} s")
    print(f"final reward: clean {result['final_reward']['clean']}, with faults {result['final_reward']['faults']}")
    print(f"final version: clean {clean[-1][1]}, with faults {faulted[-1][1]}")
    faults = ", ".join(c["fault"] for c in costs)
    title = f"conf={args.conf} with faults ({faults}), beside the same run without"
    plot(args.out / "reward_through_faults.png", curves, clean, faulted, costs, title)


def plot(path: Path, curves: dict, clean: list, faulted: list, costs: list[dict], title: str) -> None:
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
        top.annotate(f"{c['fault']}\ncost {c['cost_s']:.0f} s", (c["at_s"], 0.05), fontsize=8)
    top.set_ylabel("held-out reward (moving average of 3 evaluations)")
    top.set_ylim(0, 1)
    bottom.set_ylabel("policy version")
    bottom.set_xlabel("seconds since the first trainer step")
    top.legend()
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
