"""Learning per wall-clock second on the tiny arithmetic task: pipeline_rl pipelined, pipeline_rl
sync and TRL's GRPOTrainer, one after the other on the same model, problems, held-out set,
reward and time budget.

    python scripts/bench_learning.py [--budget-s 600] [--out runs/bench_learning]
        [--conf tiny] [--models NAME,...|--family] [--reuse]
        [--variant NAME:KEY=VALUE,KEY=VALUE ... [--against NAME]] [override ...]

Runs `launch.py conf=tiny` with actor.mode=async, then with actor.mode=sync, then
scripts/bench_trl.py (when the `bench` extra is installed: `bash scripts/setup_cpu.sh --bench`).
For each run it prints the held-out reward (T=1, 200 problems) read as moving averages of 3
evaluations (pipeline_rl/learning_curve.py): time to 0.7 and 0.9, time to TRL's final reward,
the final reward and the worst drop after the best; completions/s, versions/s, idle fractions,
peak RSS per process; where a version's time goes; and the metrics that explain a fall
(entropy, KL to the behaviour policy, clip fraction, ESS, gradient norm) over the run's last
third. Then the goals against TRL and the pipelined/sync speed-up, with its bounds from
the sync run. Each pipeline_rl run also prints its first updates' size against the later ones'
(the behaviour KL of versions 2-5 against the median and largest after). Variants named
async<suffix> and sync<suffix> are compared the same way.

--models runs all of that on each named model (a directory, or a name scripts/make_tiny_model.py
builds, built if missing) and ends with one table over the models (OUT/table.md) and their
curves side by side (OUT/curves.png); --family is --models with every model of
pipeline_rl/demo/family.py, and --fresh SEED adds each member made afresh from that seed (a new
initialisation and batch order, built before its runs: models no default was chosen on). Each model's runs go to OUT/<model>/. --reuse keeps a finished run
(TRL or pipeline_rl) of the same model, data, budget, seed and settings instead of running it
again, so that a table can be built over several sessions and a sweep pays for TRL once (TRL
does not depend on pipeline_rl's settings). Overrides apply to the pipeline_rl runs. With
--variant, runs the named pipeline_rl variants instead (e.g. `--variant sample:actor.admission_lag=2 --variant
token:actor.admission_lag=2,trainer.lag_gate=token`), with dropped samples and masked tokens;
--against NAME compares each other variant with NAME's run as with TRL's (time to its final
reward, the final against it). Each run also reports the tokens its engines generated per
trained token and, with step guidance, the attempts cut and the step scorer's share of the CPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench_tables import commit, keep, machine

from pipeline_rl import learning_curve
from pipeline_rl.config import load_config
from pipeline_rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (0.7, 0.9)
TRAINERS = ("trainer0", "trl")
"""Processes whose step records carry "version" and "compute_s"."""


def eval_curve(records: list[dict], t0: float) -> list[tuple[float, float]]:
    return [(r["time"] - t0, r["values"]["eval/reward"]) for r in records if "eval/reward" in r["values"]]


def series(records: list[dict], t0: float, key: str) -> list[tuple[float, float]]:
    """(seconds since t0, value) of every record that has `key`."""
    return [(r["time"] - t0, r["values"][key]) for r in records if isinstance(r["values"].get(key), (int, float))]


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


def step_records(records: list[dict]) -> list[dict]:
    """The trainer's step records (trainer rank 0's, or TRL's), in time order."""
    return [r for r in records if r["process"] in TRAINERS and "compute_s" in r["values"]]


def waits(steps: list[dict]) -> list[dict]:
    """Values of the step records that say how long the step waited for data (not TRL's)."""
    return [r["values"] for r in steps if "wait_s" in r["values"]]


def trainer_idle(steps: list[dict]) -> float | None:
    """Share of trainer rank 0's step time spent waiting for data."""
    values = waits(steps)
    total = sum(v["wait_s"] + v["compute_s"] for v in values)
    return sum(v["wait_s"] for v in values) / total if total else None


def step_split(steps: list[dict]) -> tuple[float, float] | None:
    """Mean seconds per version that trainer rank 0 spent waiting for data and training
    (compute plus weight broadcast)."""
    values = waits(steps)
    if not values:
        return None
    train = sum(v["compute_s"] + v.get("weight_broadcast_s", 0.0) for v in values)
    return sum(v["wait_s"] for v in values) / len(values), train / len(values)


def cpu_per_version(records: list[dict], steps: list[dict]) -> float | None:
    """CPU seconds of all processes together per version, over the trainer's steps (start-up
    excluded): each process's `cpu_s` from its last record before the first step to its last
    record before the last step. vLLM's TP worker processes (tensor_parallel_size > 1 on CPU)
    have no records, so their CPU is left out and the bound is then too optimistic."""
    if len(steps) < 2:
        return None
    t0, t1 = steps[0]["time"], steps[-1]["time"]
    before: dict[str, float] = defaultdict(float)
    upto: dict[str, float] = {}
    for r in records:  # in time order: the last value seen is the latest
        if "cpu_s" in r["values"] and r["time"] <= t1:
            upto[r["process"]] = r["values"]["cpu_s"]
            if r["time"] <= t0:
                before[r["process"]] = r["values"]["cpu_s"]
    return sum(c - before[p] for p, c in upto.items()) / (
        steps[-1]["values"]["version"] - steps[0]["values"]["version"]
    )


def versions_per_s(steps: list[dict]) -> float | None:
    """Policy versions (optimizer steps) per second of the trainer's run."""
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    return (last["values"]["version"] - first["values"]["version"]) / (last["time"] - first["time"])


def completions_per_s(records: list[dict]) -> float | None:
    """Mean of the generators' completions/s (actor windows, or TRL steps)."""
    rates = [r["values"]["rollouts_per_s"] for r in records if "rollouts_per_s" in r["values"]]
    return sum(rates) / len(rates) if rates else None


def run_key(conf: str, budget_s: float, overrides: list[str], settings: list[str]) -> dict:
    """What makes two runs the same experiment: model (its weight files' times, so that a rebuilt
    model at the same path counts as another), data, budget, seed and the run's own settings."""
    cfg = load_config(conf, overrides)
    model, data = Path(cfg.model.path), Path(cfg.actor.dataset.train).parent
    weights = {f.name: f.stat().st_mtime_ns for f in sorted(model.glob("*.safetensors"))}
    key = {"model": str(model.resolve()), "weights": weights, "data": str(data.resolve()), "budget_s": budget_s}
    return {**key, "seed": cfg.seed, "settings": settings}


def reused(name: str, run_dir: Path, key: dict, reuse: bool) -> dict | None:
    """The summary of a finished run of the same experiment, when asked to keep one."""
    done = run_dir / "done.json"
    found = json.loads(done.read_text()) if reuse and done.exists() else {}
    if found.get("key") == key:
        print(f"[{name}] reusing {run_dir} (same model, data, budget, seed and settings)", flush=True)
        # A reused run keeps the machine and commit it ran on (None: recorded before they were).
        return {**summarize(name, run_dir, found["wall_s"], found["started"]), "provenance": found.get("provenance")}
    done.unlink(missing_ok=True)
    return None


def finished(name: str, run_dir: Path, key: dict, started: float, provenance: dict) -> dict:
    wall_s = time.time() - started
    done = {"key": key, "started": started, "wall_s": wall_s, "provenance": provenance}
    (run_dir / "done.json").write_text(json.dumps(done))
    return {**summarize(name, run_dir, wall_s, started), "provenance": provenance}


def step_of(conf: str, overrides: list[str]) -> dict:
    """The settings a row of the family's table names: a step's problems and attempts at each, and
    the entropy bonus."""
    cfg = load_config(conf, overrides)
    return {
        "groups_per_step": cfg.shared.groups_per_step,
        "attempts": cfg.actor.attempts,
        "entropy_coef": cfg.trainer.loss.entropy_coef,
    }


def run(name: str, conf: str, budget_s: float, out: Path, overrides: list[str], reuse: bool, provenance: dict) -> dict:
    run_dir = out / name
    key = run_key(conf, budget_s, overrides, [f"conf={conf}", *overrides])
    step = {"step": step_of(conf, overrides)}
    if (kept := reused(name, run_dir, key, reuse)) is not None:
        return kept | step
    warm_up(Path(key["model"]))
    warm_up_engine(Path(key["model"]))
    argv = [
        sys.executable,
        "launch.py",
        f"conf={conf}",
        f"run_dir={run_dir}",
        f"name=bench_{name}",
        f"max_time_s={budget_s}",
        "--fresh",
        *overrides,
    ]
    print(f"[{name}] {' '.join(argv[1:])}", flush=True)
    start = time.time()
    code = subprocess.run(argv, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"[{name}] launch.py exited with {code}; see {run_dir / 'logs'}")
    return finished(name, run_dir, key, start, provenance) | step


TRL_DOMAINS = ("arithmetic", "multistep")
"""Domains scripts/bench_trl.py can score (a single completion checked by the domain's score())."""


def run_trl(conf: str, budget_s: float, out: Path, overrides: list[str], reuse: bool, provenance: dict) -> dict:
    cfg = load_config(conf, overrides)
    model, data = Path(cfg.model.path), Path(cfg.actor.dataset.train).parent
    run_dir = out / "trl"
    # TRL does not read pipeline_rl's settings: only the model, data, budget and seed make it another run.
    key = run_key(conf, budget_s, overrides, [])
    if (kept := reused("trl", run_dir, key, reuse)) is not None:
        return kept
    warm_up(Path(key["model"]))  # the resolved path, as run() passes: once per model
    start = time.time()
    argv = [sys.executable, "scripts/bench_trl.py", f"--model={model}", f"--data={data}", f"--budget-s={budget_s}"]
    argv += [f"--out={run_dir}", f"--seed={cfg.seed}", f"--started-at={start}"]
    argv += [f"--domain={cfg.actor.domain}", f"--max-new-tokens={cfg.actor.max_new_tokens}"]
    print(f"[trl] {' '.join(argv[1:])} (TRL's log: {run_dir / 'trl.log'})", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in (run_dir / "metrics").glob("*.jsonl"):
        old.unlink()
    with open(run_dir / "trl.log", "w") as log:
        code = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"[trl] bench_trl.py exited with {code}; see {run_dir / 'trl.log'}")
    return finished("trl", run_dir, key, start, provenance)


STABILITY = ("entropy", "behaviour_kl", "clip_fraction", "ess", "grad_norm")
"""Step metrics that explain a fall of the held-out reward, averaged over the run's last third."""


CONSISTENCY = (
    "mismatch/lag0_kl",
    "mismatch/lag0_abs_logprob_diff",
    "mismatch/unswapped_kl",
    "mismatch/unswapped_abs_logprob_diff",
)
"""Step metrics of how far the trainer's logprobs are from the engine's on tokens of the version
being trained (lag 0: the same weights; unswapped: of rollouts no swap touched, so the engine's
KV cache came from those weights too), averaged over the whole run; with an MoE policy the
unswapped ones show what routing replay (shared.routing_replay) removes."""
SMOOTH_STEPS = 50
"""Steps per point of the lag-0 plot: one step's figure is near 0 or far from it, by chance."""


FIRST_UPDATES = (2, 5)
"""The versions (first and last) whose updates a learning-rate warm-up shrinks: Adam's moment
estimates hold a sample or two, so an unwarmed first update moves every weight by about the lr."""


def update_sizes(steps: list[dict]) -> dict[str, float]:
    """How far each update moved the policy, read as the behaviour KL (between the policy that
    generated a version's samples and the one trained on them): the largest over the first
    updates (FIRST_UPDATES), and the median and the largest over all later ones."""
    first, last = FIRST_UPDATES
    kl = [
        (r["values"]["version"], r["values"]["behaviour_kl"])
        for r in steps
        if isinstance(r["values"].get("behaviour_kl"), (int, float)) and "version" in r["values"]
    ]
    early = [k for v, k in kl if first <= v <= last]
    later = [k for v, k in kl if v > last]
    if not early or not later:
        return {}
    return {"first_kl_max": max(early), "later_kl_median": statistics.median_high(later), "later_kl_max": max(later)}


def step_means(steps: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """Mean of each of `keys` over the step records that have it (keys without "mismatch/")."""
    means = {}
    for key in keys:
        values = [r["values"][key] for r in steps if isinstance(r["values"].get(key), (int, float))]
        if values:
            means[key.removeprefix("mismatch/")] = sum(values) / len(values)
    return means


def version_costs(records: list[dict], steps: list[dict]) -> dict[str, float]:
    """Where a version's wall time goes, in mean seconds per version: the trainer's wait for
    data, forward+backward, optimizer step, weight broadcast and checkpoints; the actors' swap
    (the median load, during which generation stops), and the stream hop from actor to
    preprocessor."""
    values = [r["values"] for r in steps if "wait_s" in r["values"]]
    if not values:
        return {}
    n = len(values)

    def mean(key: str) -> float:
        return sum(v.get(key, 0.0) for v in values) / n

    costs = {
        "wait": mean("wait_s"),
        "forward+backward": mean("compute_s") - mean("optimizer_s"),
        "optimizer": mean("optimizer_s"),
        "broadcast": mean("weight_broadcast_s"),
        "checkpoint": mean("checkpoint_s"),
    }
    # The load alone stops generation; the wait for the lock is spent finishing a decode step.
    loads = [r["values"]["swap_load_p50_s"] for r in records if r["values"].get("swap_load_p50_s") is not None]
    if loads:
        costs["actor swap (load)"] = sum(loads) / len(loads)
    hops = [r["values"]["preprocess/lag_s"] for r in records if r["values"].get("preprocess/lag_s")]
    if hops:
        costs["actor->preprocessor hop"] = sum(hops) / len(hops)
    return costs


def summarize(name: str, run_dir: Path, wall_s: float, t0: float) -> dict:
    """A run's figures; times count from t0, the moment its command was started (imports, model
    loading and engine start-up included, for pipeline_rl and TRL alike)."""
    records = read_metrics(run_dir)
    latest = last_values(records)
    curve = eval_curve(records, t0)
    steps = step_records(records)
    return {
        "mode": name,
        "wall_s": wall_s,
        "curve": curve,
        "reach": {t: learning_curve.time_to(curve, t) for t in THRESHOLDS},
        "start_eval": curve[0][1] if curve else None,
        "final_eval": learning_curve.final(curve),
        "worst_drop": learning_curve.worst_drop(curve),
        "early_fall": learning_curve.early_fall(curve),
        "eval_span_s": curve[-1][0] if curve else 0.0,
        "versions_per_s": versions_per_s(steps),
        "completions_per_s": completions_per_s(records),
        "actor_idle": actor_idle(latest),
        "trainer_idle": trainer_idle(steps),
        "step_split": step_split(steps),
        "cpu_per_version": cpu_per_version(records, steps),
        "costs": version_costs(records, steps),
        "late": step_means(steps[len(steps) * 2 // 3 :], STABILITY),
        "consistency": step_means(steps, CONSISTENCY),
        "update_sizes": update_sizes(steps),
        "unswapped_kl": series(steps, t0, "mismatch/unswapped_kl"),
        "peak_rss_mb": {p: v.get("peak_rss_mb") for p, v in latest.items() if v.get("peak_rss_mb")},
        # Agent runs: the actor's tool calls per training rollout, per metrics window.
        "tool_calls": series(records, t0, "agent/tool_calls_per_rollout"),
        "dropped_samples": latest.get("trainer0", {}).get("dropped_total"),
        # Groups whose attempts all got the same reward (no advantage: the preprocessors drop
        # them), of the groups the actors wrote.
        "groups_filtered": sum(
            v.get("preprocess/groups_filtered_total", 0) for p, v in latest.items() if p.startswith("preprocessor")
        ),
        "groups_written": sum(v.get("groups_written_total", 0) for p, v in latest.items() if p.startswith("actor")),
        **{k: sum(r["values"].get(k, 0) for r in steps) for k in ("masked_tokens", "trained_tokens", "samples")},
        # Tokens the engines generated (held-out evaluation included), and with step guidance
        # the attempts cut, the tokens generated past a cut step, and the step scorer's CPU.
        "tokens_generated": sum(v.get("tokens_generated_total", 0) for p, v in latest.items() if p.startswith("actor")),
        **{
            key: sum(v.get(f"step_guidance/{key}_total", 0) for v in latest.values())
            for key in ("cuts", "tokens_cut", "scorer_s")
        },
        "cpu_s": sum(v.get("cpu_s", 0) for v in latest.values()),
    }


def fmt(x, spec=".0f", unit="", missing="n/a") -> str:
    return missing if x is None else f"{x:{spec}}{unit}"


def plot(results: list[dict], ax) -> None:
    for r in results:
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker=".", label=r["mode"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out reward (T=1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_plots(per_model: list[tuple[str, list[dict]]], path: Path) -> None:
    """One panel of curves per model, side by side."""
    plt = pyplot()
    cols = min(len(per_model), 3)
    rows = (len(per_model) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (model, results) in zip(axes.flat, per_model):
        plot(results, ax)
        ax.set_title(model)
    for ax in list(axes.flat)[len(per_model) :]:
        ax.axis("off")
    save_figure(plt, fig, path)


def save_tool_plots(results: list[dict], path: Path) -> None:
    """Agent runs: the held-out reward and the tool calls per training rollout, side by side."""
    plt = pyplot()
    fig, (reward, calls) = plt.subplots(1, 2, figsize=(12, 4))
    plot(results, reward)
    for r in results:
        if r.get("tool_calls"):
            xs, ys = zip(*r["tool_calls"])
            calls.plot(xs, ys, label=r["mode"])
    calls.set_xlabel("wall time (s)")
    calls.set_ylabel("tool calls per training rollout")
    calls.grid(alpha=0.3)
    calls.legend()
    save_figure(plt, fig, path)


def save_lag0_plot(results: list[dict], path: Path) -> None:
    """The trainer's KL to the engine on unswapped lag-0 tokens of each pipeline_rl run, as means
    of SMOOTH_STEPS steps."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        points = r.get("unswapped_kl") or []
        chunks = [points[i : i + SMOOTH_STEPS] for i in range(0, len(points), SMOOTH_STEPS)]
        if chunks:
            xs = [c[-1][0] for c in chunks]
            ys = [sum(v for _, v in c) / len(c) for c in chunks]
            ax.plot(xs, ys, marker=".", label=r["mode"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("KL(engine || trainer)")
    ax.set_title(f"unswapped lag-0 tokens, means of {SMOOTH_STEPS} steps")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def report(results: list[dict], out: Path, conf: str, against: str | None = None) -> None:
    print(f"\n=== bench_learning: held-out mean reward (T=1), conf={conf}, {out.name} ===")
    print(f"(rewards are moving averages of {learning_curve.WINDOW} evaluations; drop: the worst fall after the best)")
    for r in results:
        reach = ", ".join(f"{t}: {fmt(r['reach'][t], '.0f', ' s', 'not reached')}" for t in THRESHOLDS)
        print(
            f"{r['mode']:>6}: start {fmt(r['start_eval'], '.3f')}; time to {reach}; final {fmt(r['final_eval'], '.3f')} "
            f"at {r['eval_span_s']:.0f} s, drop {r['worst_drop']:.3f}, first-minute fall {r['early_fall']:.3f}; "
            f"{fmt(r['completions_per_s'], '.0f')} completions/s, "
            f"{fmt(r['versions_per_s'], '.2f')} versions/s; actor idle {fmt(r['actor_idle'], '.2f')}, "
            f"trainer idle {fmt(r['trainer_idle'], '.2f')}"
        )
        if r["late"]:
            print("        last third: " + ", ".join(f"{k} {v:.3g}" for k, v in r["late"].items()))
        if r["consistency"]:
            print("        whole run, lag 0: " + ", ".join(f"{k} {v:.3g}" for k, v in r["consistency"].items()))
        if r.get("update_sizes"):
            u = r["update_sizes"]
            first, last = FIRST_UPDATES
            print(
                f"        behaviour KL: largest of versions {first}-{last} {u['first_kl_max']:.3g}; "
                f"later median {u['later_kl_median']:.3g}, largest {u['later_kl_max']:.3g}"
            )
        if r["costs"]:
            print("        s per version: " + ", ".join(f"{k} {v:.4f}" for k, v in r["costs"].items()))
        if r["mode"] != "trl":
            print(
                f"        dropped samples {fmt(r['dropped_samples'])} of {r['samples']:.0f}, masked tokens {r['masked_tokens']:.0f}, "
                f"trained tokens {r['trained_tokens']:.0f}"
            )
            print(f"        groups without advantage {r['groups_filtered']:.0f} of {r['groups_written']:.0f} written")
            if r.get("trained_tokens") and r.get("tokens_generated"):
                print(
                    f"        generated tokens per trained token {r['tokens_generated'] / r['trained_tokens']:.2f} "
                    f"(evaluation included)"
                )
            if r.get("scorer_s"):
                print(
                    f"        step guidance: {r['cuts']:.0f} attempts cut, {r['tokens_cut']:.0f} tokens generated past "
                    f"a cut step; step scorer {r['scorer_s']:.0f} s of CPU, {r['scorer_s'] / r['cpu_s']:.1%} of the run's"
                )
        if r.get("tool_calls"):
            first, last = tool_calls_by_third(r)
            print(f"        tool calls per rollout: first third {first:.2f}, last third {last:.2f}")
        rss = ", ".join(f"{p}={v:.0f}" for p, v in sorted(r["peak_rss_mb"].items()))
        if rss:
            print(f"        peak RSS MB: {rss}")
    save_plots([(out.name, results)], out / "learning_curves.png")
    print(f"curves: {out / 'learning_curves.png'}")
    if any(r.get("tool_calls") for r in results):
        save_tool_plots(results, out / "tool_calls.png")
        print(f"held-out reward and tool calls per rollout: {out / 'tool_calls.png'}")
    if any(r.get("unswapped_kl") for r in results):
        save_lag0_plot(results, out / "unswapped_kl.png")
        print(f"KL between engine and trainer on unswapped lag-0 tokens: {out / 'unswapped_kl.png'}")
    by = {r["mode"]: r for r in results}
    trl = by.get("trl")
    base = by.get(against) if against else None
    for name, pipe in by.items():
        if trl and name != "trl":
            goals(pipe, trl)
        if base is not None and name != against and name != "trl":
            g = against_trl(pipe, base)
            span, t = base["eval_span_s"], g["time_to_trl"]
            print(
                f"{name} vs {against}'s final {fmt(base['final_eval'], '.3f')}: reached at "
                f"{fmt(t, '.0f', ' s', 'never')} ({fmt(span / t if t else None, '.2f', 'x', 'never')} sooner); final - "
                f"{against}'s = {fmt(g['gain'], '+.3f')}; worst drop {g['drop']:.3f}"
            )
        # Each pipelined run "async<suffix>" is compared with the sync run of the same suffix.
        sync = by.get("sync" + name[len("async") :]) if name.startswith("async") else None
        if sync:
            pipelining_cap(pipe, sync)
            speed_ups(pipe, sync)


def against_trl(pipe: dict, trl: dict) -> dict:
    """The goals for one run against TRL's on the same model: time to its final reward, the gain over it, the worst drop and the first-minute fall."""
    target = trl["final_eval"]
    t = learning_curve.time_to(pipe["curve"], target) if target is not None else None
    gain = None if pipe["final_eval"] is None or target is None else pipe["final_eval"] - target
    return {
        "time_to_trl": t,
        "gain": gain,
        "drop": pipe["worst_drop"],
        "early_fall": pipe["early_fall"],
        "half": trl["eval_span_s"] / 2,
    }


def goals(pipe: dict, trl: dict) -> None:
    g = against_trl(pipe, trl)
    print(
        f"goals ({pipe['mode']} vs TRL's final {fmt(trl['final_eval'], '.3f')}): reached at "
        f"{fmt(g['time_to_trl'], '.0f', ' s', 'never')} (goal <= {g['half']:.0f} s); final - TRL's = "
        f"{fmt(g['gain'], '+.3f')} (goal >= +0.05); worst drop {g['drop']:.3f} (goal <= 0.05); first-minute "
        f"fall {g['early_fall']:.3f} (goal <= 0.05)"
    )


def tool_calls_by_third(r: dict) -> tuple[float | None, float | None]:
    """An agent run's tool calls per training rollout, mean of the first and of the last third of
    its metrics windows (None, None for a run without tools)."""
    calls = [v for _, v in r.get("tool_calls") or []]
    if not calls:
        return None, None
    third = max(1, len(calls) // 3)
    return sum(calls[:third]) / third, sum(calls[-third:]) / third


def result_rows(per_model: list[tuple[str, list[dict]]], budget_s: float, against: str | None = None) -> list[dict]:
    """One row per model and pipeline_rl run, against TRL's run on that model (and with `against`,
    against that variant's run): the figures docs/learning.md's tables are made of
    (scripts/bench_tables.py), written as JSON, with the machine and commit the pipeline_rl run
    was measured on (none where its run predates their recording)."""
    rows = []
    for model, results in per_model:
        by = {r["mode"]: r for r in results}
        trl = by.get("trl")
        for mode, r in by.items():
            if mode == "trl":
                continue
            g = against_trl(r, trl) if trl else {}
            base = by.get(against) if against else None
            vs = against_trl(r, base) if base is not None and mode != against else {}
            calls_first, calls_last = tool_calls_by_third(r)
            rows.append(
                {
                    "model": model,
                    "mode": mode,
                    "budget_s": budget_s,
                    "start": r["start_eval"],
                    "final": r["final_eval"],
                    "worst_drop": r["worst_drop"],
                    "early_fall": r["early_fall"],
                    **{f"time_to_{t}_s": r["reach"][t] for t in THRESHOLDS},
                    "versions_per_s": r["versions_per_s"],
                    "completions_per_s": r["completions_per_s"],
                    "actor_idle": r.get("actor_idle"),
                    "trainer_idle": r.get("trainer_idle"),
                    # A version's seconds waiting for its samples and training (step_split).
                    "version_wait_s": r["step_split"][0] if r.get("step_split") else None,
                    "version_train_s": r["step_split"][1] if r.get("step_split") else None,
                    "dropped_samples": r.get("dropped_samples"),
                    "samples": r.get("samples"),
                    **(r.get("update_sizes") or {}),
                    "trl_final": trl["final_eval"] if trl else None,
                    "trl_span_s": trl["eval_span_s"] if trl else None,
                    "trl_completions_per_s": trl["completions_per_s"] if trl else None,
                    "time_to_trl_s": g.get("time_to_trl"),
                    "gain": g.get("gain"),
                    **(
                        {
                            "against": against,
                            "against_final": base["final_eval"],
                            "against_span_s": base["eval_span_s"],
                            "time_to_against_s": vs.get("time_to_trl"),
                            "gain_against": vs.get("gain"),
                        }
                        if base is not None
                        else {}
                    ),
                    "tokens_per_trained": r["tokens_generated"] / r["trained_tokens"]
                    if r.get("tokens_generated") and r.get("trained_tokens")
                    else None,
                    "cuts": r.get("cuts"),
                    "tool_calls_first_third": calls_first,
                    "tool_calls_last_third": calls_last,
                    "scorer_share": r["scorer_s"] / r["cpu_s"] if r.get("scorer_s") and r.get("cpu_s") else None,
                    **(r.get("step") or {}),
                    **(r.get("provenance") or {}),
                }
            )
    return rows


def table(per_model: list[tuple[str, list[dict]]]) -> str:
    """Per model, TRL's final reward, and for each pipeline_rl run the time to TRL's final reward,
    its own final reward, its worst drop and its first-minute fall below the start."""
    modes = [r["mode"] for r in per_model[0][1] if r["mode"] != "trl"]
    head = "| model | start | TRL final |" + "".join(
        f" {m}: time to TRL | {m}: final | {m}: drop | {m}: first-minute fall |" for m in modes
    )
    lines = [head, "|" + " --- |" * (3 + 4 * len(modes))]
    for model, results in per_model:
        by = {r["mode"]: r for r in results}
        trl = by.get("trl")
        start = next((r["start_eval"] for r in results if r["mode"] != "trl"), None)
        row = f"| `{model}` | {fmt(start, '.2f')} | {fmt(trl['final_eval'] if trl else None, '.3f')} |"
        for m in modes:
            r = by[m]
            reach = fmt(against_trl(r, trl)["time_to_trl"], ".0f", " s", "never") if trl else "n/a"
            row += f" {reach} | {fmt(r['final_eval'], '.3f')} | {r['worst_drop']:.3f} | {r['early_fall']:.3f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def speed_ups(pipe: dict, sync: dict) -> None:
    pair = f"{sync['mode']} / {pipe['mode']}"
    if (target := sync["final_eval"]) is not None:
        # Where sync ended, the thresholds aside: how much sooner pipelined got there.
        s, a = learning_curve.time_to(sync["curve"], target), learning_curve.time_to(pipe["curve"], target)
        if a and s:
            print(f"speed-up to sync's final {target:.3f} ({pair}): {s / a:.2f}x ({s:.0f} s / {a:.0f} s)")
        else:
            print(
                f"speed-up to sync's final {target:.3f} ({pair}): n/a (pipelined {fmt(a, '.0f', ' s', 'not reached')})"
            )
    for t in THRESHOLDS:
        a, s = pipe["reach"][t], sync["reach"][t]
        if a and s:
            print(f"speed-up to {t} ({pair}): {s / a:.2f}x ({s:.0f} s / {a:.0f} s)")
        elif a:
            # Sync ran the whole budget without reaching t: the ratio is at least its span / pipelined.
            print(
                f"speed-up to {t} ({pair}): > {sync['eval_span_s'] / a:.2f}x (sync not reached in "
                f"{sync['eval_span_s']:.0f} s of evaluations / pipelined {a:.0f} s)"
            )
        else:
            print(
                f"speed-up to {t} ({pair}): n/a (pipelined {fmt(a, '.0f', ' s', 'not reached')}, sync {fmt(s, '.0f', ' s', 'not reached')})"
            )


def pipelining_cap(pipe: dict, sync: dict) -> None:
    """Two bounds on the pipelined speed-up at the same per-step work, from the sync run. A sync
    version costs generation (the trainer's wait) plus training, one after the other: perfect
    overlap costs only the longer of the two, (wait + train) / max(wait, train). And all
    processes together need C CPU seconds per version: on N cores a version takes at least C / N
    seconds, however well it overlaps."""
    if not (pipe["step_split"] and sync["step_split"]):
        return
    wait, train = sync["step_split"]
    a_wait, a_train = pipe["step_split"]
    overlap_cap = (wait + train) / max(wait, train)
    print(
        f"pipelining cap ({sync['mode']} / {pipe['mode']}): sync spends {wait:.3f} s per version waiting for "
        f"generation and {train:.3f} s training; perfect overlap gives {overlap_cap:.2f}x. Pipelined: {a_wait:.3f} s "
        f"waiting, {a_train:.3f} s training per version; measured versions/s ratio "
        f"{fmt(ratio(pipe['versions_per_s'], sync['versions_per_s']), '.2f')}x"
    )
    cpu, a_cpu = sync["cpu_per_version"], pipe["cpu_per_version"]
    if cpu and a_cpu:
        cores = len(os.sched_getaffinity(0))
        print(
            f"        CPU: sync uses {cpu:.3f} CPU s per version, pipelined {a_cpu:.3f}; on {cores} cores a sync "
            f"version takes at least {cpu / cores:.3f} s, so pipelining gains at most "
            f"{min(overlap_cap, (wait + train) / (cpu / cores)):.2f}x"
        )


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def model_path(name: str, default: Path) -> Path:
    """A directory as given, or a model scripts/make_tiny_model.py builds (built if missing)."""
    from pipeline_rl.demo import buildable, ensure_built

    path = Path(name)
    if path.exists() or not buildable(name):
        return path
    path = default.parent / name
    ensure_built(path)
    return path


@functools.cache
def warm_up(model: Path) -> None:
    """Untimed, before a model's first run that is not reused: read the stacks every run imports
    (from disk into the page cache) and let vLLM inspect the model's architecture, which it does
    in a subprocess the first time on a machine and then caches (measured: 113 s from launch to
    the first step in a fresh environment, 46 s after), so that the first run timed is not the
    only one to pay. DeepSpeed's CPU Adam op is compiled too (scripts/build_deepspeed_ops.py): a
    variant with trainer.optimizer.offload would otherwise compile it in its first timed run."""
    code = f"import deepspeed, transformers; from vllm.config import ModelConfig; ModelConfig(model={str(model)!r})"
    start = time.time()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    subprocess.run([sys.executable, "scripts/build_deepspeed_ops.py"], cwd=ROOT, check=True, capture_output=True)
    print(
        f"warm-up: {time.time() - start:.0f} s (imports, vLLM's architecture inspection, DeepSpeed's ops)", flush=True
    )


@functools.cache
def warm_up_engine(model: Path) -> None:
    """Untimed, before a model's first pipeline_rl run: an engine samples once with logprobs, as
    actors do. vLLM's logprob op is compiled by torch inductor on first use and cached per
    machine: the first actor of a fresh machine waited 20 s for its first tokens, later ones 5 s."""
    code = (
        "from pipeline_rl.config import load_config\n"
        "from pipeline_rl.engine.engine_config import engine_args, set_engine_environment\n"
        f"cfg = load_config('tiny', ['model.path={model}'])\n"
        "set_engine_environment(cfg)\n"
        "from vllm import LLM, SamplingParams\n"
        "LLM(**engine_args(cfg, cfg.model.path)).generate(['1+1='], SamplingParams(max_tokens=2, logprobs=0))\n"
    )
    start = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True)
    print(f"warm-up: {time.time() - start:.0f} s (an engine's first sampling: vLLM's compiled ops)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-time budget of each run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_learning")
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME:KEY=VALUE,... a pipeline_rl run to compare (repeatable)"
    )
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL run")
    parser.add_argument(
        "--against",
        metavar="VARIANT",
        help="also compare every other variant with this one's run, as with TRL's (time to its final, the gain over it)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="also keep the per-model rows in this JSON, replacing those of the same model and variant (OUT/results.json is always written)",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep finished runs of the same model, data, budget, seed and settings"
    )
    parser.add_argument("--models", default="", help="comma-separated model directories or names to run on, in turn")
    parser.add_argument("--family", action="store_true", help="run on every model of pipeline_rl/demo/family.py")
    parser.add_argument(
        "--fresh",
        type=int,
        action="append",
        default=[],
        metavar="SEED",
        help="with --family: also every member made afresh from this seed (NAME_sSEED, built now; repeatable)",
    )
    parser.add_argument(
        "--conf",
        default="tiny",
        help="config of the pipeline_rl runs (and TRL's task: its domain must be one of TRL_DOMAINS)",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every pipeline_rl run")
    args = parser.parse_args()
    variants = [v.partition(":") for v in args.variant]
    runs = [(name, [o for o in rest.split(",") if o]) for name, _, rest in variants]
    runs = runs or [(mode, [f"actor.mode={mode}"]) for mode in ("async", "sync")]
    cfg = load_config(args.conf, args.overrides)
    with_trl = not args.no_trl and cfg.actor.domain in TRL_DOMAINS
    if with_trl and importlib.util.find_spec("trl") is None:
        print("[trl] skipped: TRL is not installed (bash scripts/setup_cpu.sh --bench)")
        with_trl = False
    if args.family:
        from pipeline_rl.demo.family import FAMILY, fresh

        names = [m.name for m in FAMILY] + [fresh(m, seed).name for seed in args.fresh for m in FAMILY]
    else:
        names = [m for m in args.models.split(",") if m]
    default = Path(cfg.model.path)
    if not names:  # the config's own model, built now if missing (as --models does), not inside a timed run
        from pipeline_rl.demo import ensure_built

        ensure_built(default)
    models = [model_path(n, default) for n in names] or [default]
    provenance = {"machine": machine(), "commit": commit()}  # before the runs: what they ran
    per_model = []
    for model in models:
        overrides = ([f"model.path={model}"] if names else []) + args.overrides
        out = args.out / model.name
        results = [
            run(name, args.conf, args.budget_s, out, own + overrides, args.reuse, provenance) for name, own in runs
        ]
        if with_trl:
            results.append(run_trl(args.conf, args.budget_s, out, overrides, args.reuse, provenance))
        report(results, out, args.conf, args.against)
        per_model.append((model.name, results))
    rows = result_rows(per_model, args.budget_s, args.against)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"results: {args.out / 'results.json'}")
    if args.json:
        keep(args.json, rows)
        print(f"kept in {args.json}")
    if len(per_model) > 1:
        text = table(per_model)
        (args.out / "table.md").write_text(text)
        save_plots(per_model, args.out / "curves.png")
        print(f"\n{text}\ntable: {args.out / 'table.md'}; curves: {args.out / 'curves.png'}")


if __name__ == "__main__":
    main()
